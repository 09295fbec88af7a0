"""`kiln ui` and `kiln mlflow-ui` really serve on 127.0.0.1."""

import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.servers import free_port

pytestmark = pytest.mark.e2e


def _wait_ok(url: str, procs: list, timeout: float = 120) -> bytes:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            assert p.poll() is None, f"UI process exited early with {p.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return r.read()
        except OSError:
            pass
        time.sleep(0.5)  # polling a server that is starting; not a race dodge
    raise AssertionError(f"{url} did not answer within {timeout}s")


def test_prefect_and_mlflow_uis_serve(tmp_path, tiny_config):
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_API_URL", None)
    pp, mp = free_port(), free_port()
    cli = [sys.executable, "-m", "kiln_cli"]
    procs = [
        subprocess.Popen(
            [*cli, "ui", "--port", str(pp)],
            env=env,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ),
        subprocess.Popen(
            [*cli, "mlflow-ui", "--config", str(tiny_config), "--port", str(mp)],
            env=env,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ),
    ]
    try:
        assert _wait_ok(f"http://127.0.0.1:{pp}/api/health", procs).strip() == b"true"
        assert _wait_ok(f"http://127.0.0.1:{mp}/health", procs).strip() == b"OK"
        page = _wait_ok(f"http://127.0.0.1:{mp}/", procs)
        assert b"<html" in page.lower()
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=30)
