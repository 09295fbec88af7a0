"""Whether a run's stages fit the GPUs its config declares, from the config alone.

`kiln run` and `kiln train` check every stage's memory here before anything is ingested
(`tasks.inputs.check_inputs`), on the GPUs the config names, even on a machine that has none;
the train flow checks the pending stages again before launching (`tasks.launch.preflight`).
Nothing here imports Prefect, and torch only where a memory model or a GPU probe is needed.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from kiln_config import KilnError, LaunchConfig, TrainConfig
from tasks.planning.topology import stage_processes

__all__ = ["HealthCheckError", "check_memory", "cuda_available", "declares_gpus"]


class HealthCheckError(KilnError, RuntimeError):
    """The machine or cluster is not fit to start this training run."""


def cuda_available() -> bool:
    """Whether this machine's torch sees a GPU (the launch and the health check ask)."""
    import torch

    return torch.cuda.is_available()


def declares_gpus(launch: LaunchConfig, probe: bool = True) -> bool:
    """Whether the stages train on GPUs: a topology without `use_cpu`, and GPUs: the
    backend's `gpus_per_node` on a cluster; on one machine, a GPU topology (MULTI_GPU or
    FSDP, taken from the config on a machine that has none yet) or, with `probe`, this
    machine's GPUs."""
    topology = yaml.safe_load(Path(launch.accelerate_config).read_text()) or {}
    if topology.get("use_cpu"):
        return False
    if launch.backend != "local":
        gpus = {"slurm": launch.slurm.gpus_per_node, "kubernetes": launch.kubernetes.gpus_per_node}
        return bool(gpus[launch.backend])
    kind = str(topology.get("distributed_type", "NO")).upper()
    return kind in ("MULTI_GPU", "FSDP") or (probe and cuda_available())


def check_memory(
    train: TrainConfig, launch: LaunchConfig, pending: list[int], precomputed: bool = False
) -> None:
    """Raise HealthCheckError for the first pending stage whose step the memory model puts
    over `launch.gpu_memory_gb`, naming the YAML to paste (`kiln plan`'s cheapest change)."""
    # The memory model traces the UNet on the meta device with torch (2 s to import): loaded
    # where a run declares GPUs.
    from tasks.planning.memory_model import memory_plan

    worlds = stage_processes(launch, train)
    plan = memory_plan(train, launch.accelerate_config, worlds, launch.gpu_memory_gb, precomputed)
    for i in pending:
        mem = plan[i]["configured"]
        if not mem["fits"]:
            s = train.stages[i]
            raise HealthCheckError(
                f"stage {i + 1} ({s.resolution}px): the memory model puts a step at "
                f"{mem['total'] / 1e9:.3g} GB per GPU ({mem['setup']}, batch {s.batch_size}), "
                f"over launch.gpu_memory_gb {launch.gpu_memory_gb:g}; "
                f"{plan[i]['recommendation']['text']} (`kiln plan` shows every component)"
            )
