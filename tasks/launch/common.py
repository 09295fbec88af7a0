"""What every launch backend shares: the launch errors, a cluster job's description and the
heartbeat watch (the processes a topology starts are `tasks.planning.topology`'s). The local launch
(`accelerate.py`) and the cluster backends (`slurm.py`, `kubernetes.py`) import it; it imports none
of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

from kiln_config import KilnError

__all__ = [
    "ClusterJob",
    "HeartbeatWatch",
    "LaunchError",
    "LaunchRejected",
    "StageDiverged",
]


class LaunchError(KilnError, RuntimeError):
    """An `accelerate launch` exited non-zero or hung; the message holds its last output lines."""


class StageDiverged(LaunchError):
    """The stage's `DIVERGED.json` says its loss went non-finite: every relaunch would fail the
    same way, so `launch_stage` is not retried (its `retry_condition_fn`)."""


class LaunchRejected(LaunchError):
    """The cluster refused the launch (a bad partition, account, namespace, runtime or node
    count): launching it again would be refused the same way, so it is not retried."""


@dataclasses.dataclass(frozen=True)
class ClusterJob:
    """One launch on a cluster backend: `accelerate launch <rest>` on `nodes` nodes of
    `processes_per_machine` processes each, and how to watch it (`heartbeat` and
    `hang_timeout_s` for the hang watchdog, `on_progress` for each new step, `timeout_s` for
    the whole run, `env` added to the nodes' environment)."""

    rest: list[str]
    nodes: int
    processes_per_machine: int
    name: str
    logger: logging.Logger | logging.LoggerAdapter
    heartbeat: Path | None = None
    hang_timeout_s: float | None = None
    on_progress: Callable[[int], None] | None = None
    timeout_s: float | None = None
    env: dict[str, str] | None = None

    def heartbeat_watch(self) -> HeartbeatWatch:
        return HeartbeatWatch(self.heartbeat, self.hang_timeout_s, self.on_progress)


class HeartbeatWatch:
    """A stage's heartbeat file, read while its launch runs (here, or as a cluster job whose
    run folder this machine sees): progress for the UI, and the hang watchdog."""

    def __init__(
        self,
        path: Path | None,
        hang_timeout_s: float | None,
        on_progress: Callable[[int], None] | None = None,
    ):
        self.path, self.hang_timeout_s, self.on_progress = path, hang_timeout_s, on_progress
        self.last_step = None

    def check(self, started: float) -> str | None:
        """Report a new step; return why the launch counts as hung (no beat for
        `hang_timeout_s`, counted from `started` until the first beat), or None."""
        if self.path is None:
            return None
        if self.on_progress is not None and self.path.exists():
            with contextlib.suppress(OSError, ValueError, KeyError):
                step = json.loads(self.path.read_text())["step"]
                if step != self.last_step:
                    self.last_step = step
                    self.on_progress(step)
        if self.hang_timeout_s:
            beat = self.path.stat().st_mtime if self.path.exists() else started
            if time.time() - max(beat, started) > self.hang_timeout_s:
                return f"hung (no heartbeat for {self.hang_timeout_s:g}s)"
        return None
