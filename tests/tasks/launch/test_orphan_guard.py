"""A launch dies with the process that started it, ranks included, however that one dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tasks.launch.orphan_guard import guarded

REPO = Path(__file__).resolve().parents[3]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        # A zombie is dead: only its parent (init, for an orphan) has yet to reap it.
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):  # gone, or reaped in between
        return False


@pytest.mark.parametrize("own_session", [False, True])
def test_a_sigkilled_flow_process_takes_its_launch_and_ranks_with_it(tmp_path, own_session):
    """A rank in the launch's group, and one in a session of its own (as torch's elastic
    agent starts them), both die with the flow process."""
    pids = tmp_path / "pids"
    # The "flow run": starts a guarded launch whose "rank" is a grandchild, then waits on it
    # (as run_launch does), until it is killed outright.
    flow = textwrap.dedent(
        f"""
        import subprocess, sys
        from tasks.launch.orphan_guard import guarded
        rank = "import os, time; open({str(pids)!r}, 'w').write(str(os.getpid())); time.sleep(300)"
        start = ("import subprocess, sys; subprocess.run([sys.executable, '-c', sys.argv[1]], "
                 "start_new_session={own_session})")
        launcher = [sys.executable, "-c", start, rank]
        subprocess.Popen(guarded(launcher), start_new_session=True).wait()
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", flow], cwd=REPO)
    deadline = time.monotonic() + 60
    while not (pids.is_file() and pids.read_text()):
        assert time.monotonic() < deadline, "the rank never started"
        time.sleep(0.1)  # poll interval of a bounded wait
    rank = int(pids.read_text())
    assert _alive(rank)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while _alive(rank):
        assert time.monotonic() < deadline, "the rank outlived the flow process"
        time.sleep(0.1)


def test_the_launch_exit_status_comes_through(tmp_path):
    exits = guarded([sys.executable, "-c", "raise SystemExit(3)"])
    assert subprocess.run(exits, cwd=REPO).returncode == 3
    killed = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    assert subprocess.run(guarded(killed), cwd=REPO).returncode == -signal.SIGKILL
