"""What a stage's topology says: the processes an `accelerate launch` of its Accelerate config
starts, on each machine and in all, and its sharding strategy and precision.

The launch task starts that many processes; the planner counts memory, time and scaling for
them. Both read the same few fields of the topology file (`launch.accelerate_config`) here.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from kiln_config import LaunchConfig, TrainConfig
from kiln_config.errors import InputError, MissingInput

__all__ = [
    "local_processes",
    "processes_per_machine",
    "stage_processes",
    "topology_processes",
    "topology_setup",
]


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


def topology_setup(accelerate_config: str) -> tuple[str, str]:
    """(strategy, mixed precision) of an accelerate config: `fsdp` for FSDP with
    SHARD_GRAD_OP, else `ddp` (one process, DDP or CPU)."""
    cfg = yaml.safe_load(Path(accelerate_config).read_text()) or {}
    fsdp = str(cfg.get("distributed_type", "NO")).upper() == "FSDP"
    sharding = str((cfg.get("fsdp_config") or {}).get("fsdp_sharding_strategy", ""))
    if fsdp and sharding.upper() not in ("SHARD_GRAD_OP", "2"):
        raise InputError(
            "launch.accelerate_config: the memory model covers FSDP's SHARD_GRAD_OP only "
            f"(received fsdp_sharding_strategy {sharding!r})"
        )
    return ("fsdp" if fsdp else "ddp"), str(cfg.get("mixed_precision") or "no")
