"""What the tests need to run servers as real processes on loopback: a free port, a bounded
wait, an HTTP probe, a Prefect API client, and `mlflow models serve` started and stopped.

Every wait here is bounded and names what it waited for; a process that exits meanwhile fails
the wait at once, with its exit code.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import httpx

__all__ = ["BIN", "free_port", "http_ok", "model_server", "prefect_client", "wait_for"]

BIN = Path(sys.executable).parent  # the venv's console scripts: kiln, prefect, mlflow


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(
    what: str,
    check: Callable[[], object],
    timeout: float,
    procs: Sequence[subprocess.Popen] = (),
    interval: float = 1.0,
):
    """Poll `check` until it returns something truthy and return that; fail naming `what`
    after `timeout` seconds, or as soon as one of `procs` has exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{p.args[:4]} exited ({p.returncode}) waiting for {what}")
        got = check()
        if got:
            return got
        time.sleep(interval)  # the poll interval of a bounded wait, not a race dodge
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def http_ok(url: str, **kwargs) -> bool:
    """Whether a GET of `url` answers 200 now (no answer at all is False)."""
    try:
        return httpx.get(url, timeout=2, **kwargs).status_code == 200
    except httpx.HTTPError:
        return False


def prefect_client(api_url: str, auth_string: str | None = None) -> httpx.Client:
    """An HTTP client of a Prefect server's REST API, with its `user:password` auth string."""
    auth = None
    if auth_string:
        user, _, password = auth_string.partition(":")
        auth = (user, password)
    return httpx.Client(base_url=api_url, auth=auth, timeout=10)


@contextlib.contextmanager
def model_server(
    model_uri: str, env: dict, log: Path, cwd: Path | None = None, timeout: float = 240
) -> Iterator[str]:
    """`mlflow models serve -m model_uri --env-manager local` on a free loopback port, as the
    README shows; yields its base URL once `/ping` answers, and stops its process group."""
    port = free_port()
    # --env-manager local runs a bare `uvicorn`: the venv's bin must be on PATH.
    env = {**env, "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}"}
    cmd = [str(BIN / "mlflow"), "models", "serve", "-m", model_uri, "--env-manager", "local"]
    with open(log, "w") as out:
        server = subprocess.Popen(
            [*cmd, "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_for("the scoring server", lambda: http_ok(f"{base}/ping"), timeout, [server])
        except AssertionError as e:
            raise AssertionError(f"{e}\n{log.read_text()[-3000:]}") from None
        yield base
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)
