"""What every launch backend shares: the launch errors, the processes a topology starts, a
cluster job's description and the heartbeat watch. The local launch (`accelerate.py`) and the
cluster backends (`slurm.py`, `kubernetes.py`) import it; it imports none of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from kiln_config import KilnError, LaunchConfig, TrainConfig
from kiln_config.errors import MissingInput

__all__ = [
    "ClusterJob",
    "HeartbeatWatch",
    "LaunchError",
    "LaunchRejected",
    "StageDiverged",
    "local_processes",
    "processes_per_machine",
    "stage_processes",
    "topology_processes",
]


class LaunchError(KilnError, RuntimeError):
    """An `accelerate launch` exited non-zero or hung; the message holds its last output lines."""


class StageDiverged(LaunchError):
    """The stage's `DIVERGED.json` says its loss went non-finite: every relaunch would fail the
    same way, so `launch_stage` is not retried (its `retry_condition_fn`)."""


class LaunchRejected(LaunchError):
    """The cluster refused the launch (a bad partition, account, namespace, runtime or node
    count): launching it again would be refused the same way, so it is not retried."""


def topology_processes(accelerate_config: str, override: int | None) -> int:
    """Processes an `accelerate launch` with this config starts (all machines)."""
    if override:
        return override
    if not Path(accelerate_config).is_file():
        raise MissingInput(
            f"launch.accelerate_config: file not found (received {accelerate_config!r})"
        )
    cfg = yaml.safe_load(Path(accelerate_config).read_text()) or {}
    return int(cfg.get("num_processes") or 1)


def local_processes(accelerate_config: str, num_processes: int | None = None) -> int:
    """Processes a launch with this config starts on each machine."""
    machines = 1
    if Path(accelerate_config).is_file():
        cfg = yaml.safe_load(Path(accelerate_config).read_text()) or {}
        machines = max(1, int(cfg.get("num_machines") or 1))
    total = topology_processes(accelerate_config, num_processes)
    return max(1, -(-total // machines))


def processes_per_machine(launch: LaunchConfig) -> int:
    """Training processes on each node: on a cluster backend its `gpus_per_node` when set,
    else `launch.num_processes` or the topology's count."""
    per_node = {
        "slurm": launch.slurm.gpus_per_node,
        "kubernetes": launch.kubernetes.gpus_per_node,
    }.get(launch.backend)
    return per_node or local_processes(launch.accelerate_config, launch.num_processes)


def stage_processes(launch: LaunchConfig, train: TrainConfig) -> list[int]:
    """Each stage's world size: its `num_machines` times the processes on each node."""
    if launch.backend == "local":  # one machine: the topology's count (validated: 1 node)
        return [topology_processes(launch.accelerate_config, launch.num_processes)] * len(
            train.stages
        )
    return [s.num_machines * processes_per_machine(launch) for s in train.stages]


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
