"""`python -m tasks.launch.orphan_guard PARENT_PID CMD...`: a launch that dies with its flow run.

A launch runs in a process group of its own, which the flow's task kills however the task
ends. But a flow-run process killed outright (SIGKILL to a Prefect worker and its runs, the
OOM killer) runs no `finally`: its `accelerate launch` and the ranks under it would go on
training as orphans, writing into the stage folder that the next run resumes from.

This guard is the group's leader. It asks the kernel for a signal when the process that started
it dies (Linux's `PR_SET_PDEATHSIG`, which follows the starting *thread*: `run_launch` starts
and waits for the launch on one thread), runs CMD in its own process group, and on that signal
kills the whole group, ranks included. CMD's exit status is its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys

__all__ = ["guarded"]

_PR_SET_PDEATHSIG = 1


def guarded(cmd: list[str]) -> list[str]:
    """`cmd` under the guard, tied to this process."""
    return [sys.executable, "-m", "tasks.launch.orphan_guard", str(os.getpid()), *cmd]


def _kill_group(_signum=None, _frame=None) -> None:
    os.killpg(0, signal.SIGKILL)  # the group: the launch, its ranks and this guard


def main() -> None:
    parent, cmd = int(sys.argv[1]), sys.argv[2:]
    signal.signal(signal.SIGUSR1, _kill_group)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGUSR1, 0, 0, 0)
    if os.getppid() != parent:  # it died before the request took effect
        _kill_group()
    child = subprocess.Popen(cmd)  # the same process group
    rc = child.wait()
    if rc < 0:  # killed by a signal: end the same way, so the caller sees the same status
        with contextlib.suppress(OSError, ValueError):  # SIGKILL has no handler to reset
            signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
    sys.exit(rc)


if __name__ == "__main__":
    main()
