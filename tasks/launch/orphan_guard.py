"""`python -m tasks.launch.orphan_guard PARENT_PID CMD...`: a launch that dies with its flow run.

A launch runs in a process group of its own, which the flow's task kills however the task
ends. But a flow-run process killed outright (SIGKILL to a Prefect worker and its runs, the
OOM killer) runs no `finally`: its `accelerate launch` and the ranks under it would go on
training as orphans, writing into the stage folder that the next run resumes from.

This guard is the group's leader. It asks the kernel for a signal when the process that started
it dies (Linux's `PR_SET_PDEATHSIG`, which follows the starting *thread*: `run_launch` starts
and waits for the launch on one thread), and becomes a subreaper (`PR_SET_CHILD_SUBREAPER`), so
that every process under it stays under it even when the one between dies. On that signal it
kills every process under it and its group: torch's elastic agent starts each rank in a session
of its own, out of reach of the group's kill alone. CMD's exit status is its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys

import psutil

__all__ = ["guarded", "kill_tree"]

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def guarded(cmd: list[str]) -> list[str]:
    """`cmd` under the guard, tied to this process."""
    return [sys.executable, "-m", "tasks.launch.orphan_guard", str(os.getpid()), *cmd]


def kill_tree(pid: int) -> None:
    """SIGKILL every process under `pid` (whatever its session), then `pid`'s group."""
    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _kill_all(_signum=None, _frame=None) -> None:
    kill_tree(os.getpid())  # the launch, its ranks, and this guard last (its group)


def main() -> None:
    parent, cmd = int(sys.argv[1]), sys.argv[2:]
    signal.signal(signal.SIGUSR1, _kill_all)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        for option, arg in ((_PR_SET_PDEATHSIG, signal.SIGUSR1), (_PR_SET_CHILD_SUBREAPER, 1)):
            if libc.prctl(option, arg, 0, 0, 0) != 0:
                err = ctypes.get_errno()
                sys.stderr.write(f"orphan guard: prctl({option}) failed: {os.strerror(err)}\n")
    if os.getppid() != parent:  # it died before the request took effect
        _kill_all()
    child = subprocess.Popen(cmd)  # the same process group
    rc = child.wait()
    if rc < 0:  # killed by a signal: end the same way, so the caller sees the same status
        with contextlib.suppress(OSError, ValueError):  # SIGKILL has no handler to reset
            signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
    sys.exit(rc)


if __name__ == "__main__":
    main()
