"""Every `kiln` command that serves (ui, mlflow-ui, rate serve) stops its whole process tree
on SIGTERM and SIGINT.

Real processes: the command is started as `python -m kiln_cli ...` on a free port of
127.0.0.1, its process tree is listed once it answers, and the signal goes to the `kiln`
process alone (as systemd, Docker or a process manager sends it), never to its group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.servers import free_port

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _wait_up(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited early with {proc.returncode}"
        if _answers(url):
            return
        time.sleep(0.5)  # polling a server that is starting; not a race dodge
    raise AssertionError(f"{url} did not answer within {timeout}s")


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


COMMANDS = {
    "ui": (lambda cfg, port: ["ui", "--port", port], "/api/health"),
    "mlflow-ui": (lambda cfg, port: ["mlflow-ui", "--config", cfg, "--port", port], "/health"),
    "rate serve": (
        lambda cfg, port: ["rate", "serve", "--config", cfg, "--port", port],
        "/healthz",
    ),
}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_serving_command_stops_its_whole_tree(command, sig, tmp_path, tiny_config):
    argv, health = COMMANDS[command]
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_HOME": str(tmp_path / "prefect")}
    cmd = [sys.executable, "-m", "kiln_cli", *argv(str(tiny_config), str(port))]
    # Its own session: the test's signal reaches the kiln process only, not a group.
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_up(f"http://127.0.0.1:{port}{health}", proc)
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        if command == "mlflow-ui":  # kiln, `mlflow ui`, uvicorn and its workers
            assert len(tree) >= 3, [p.cmdline() for p in tree]
        os.kill(proc.pid, sig)
        # A clean stop: exit 0, or (uvicorn re-raises the signal after its shutdown) the
        # status of that signal itself, as with no handler at all, or 128 + the signal when
        # kiln's own SIGTERM handler (which lets every `finally` run) receives it.
        assert proc.wait(timeout=60) in (0, -sig, 128 + sig)
        gone, alive = psutil.wait_procs(tree, timeout=30)
        assert not alive, [p.cmdline() for p in alive]
        assert not _listening(port), f"port {port} still answers"
    finally:  # never leave one behind: an orphan keeps the group of the session started here
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
