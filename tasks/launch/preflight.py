"""Pre-flight health check before training launches: fail in seconds, with a clear message.

Before any of these, before anything is launched or submitted, `stage_feasibility` fails a
stage that cannot run as configured (a dataset smaller than one global batch; on GPUs, a step
the memory model says does not fit `launch.gpu_memory_gb`). Such a failure is deterministic,
so it is raised once, never retried. The memory half needs only the config: `kiln run` and
`kiln train` check it before ingesting anything (`tasks.launch.gpu_fit`).

Checks, in order of cost:

1. the topology's GPU needs against the GPUs this machine sees;
2. storage: every stage's MDS index is readable and the run folder is writable;
3. free disk under the run folder against an estimate of the checkpoints (weights, AdamW
   moments, EMA, times `train.keep_checkpoints`, plus one export);
4. a collective: `accelerate launch -m models.collective_check` all-reduces across every launched
   process, bounded by `launch.health_timeout_s` (skipped for one process on a machine
   without a GPU: there is no collective to form and no device to probe).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml
from prefect import task
from prefect.cache_policies import NO_CACHE

from kiln_config import HealthCheckRun, LaunchConfig, TrainConfig, write_run_file
from tasks.launch.accelerate import LaunchError, cuda_available, launch_module
from tasks.launch.gpu_fit import HealthCheckError, check_memory, declares_gpus
from tasks.planning.topology import stage_processes, topology_processes
from tasks.runtime.logs import task_logger

__all__ = [
    "HealthCheckError",
    "check_collective",
    "check_disk",
    "check_gpus",
    "check_stages",
    "check_storage",
    "checkpoint_bytes",
    "preflight",
    "stage_feasibility",
]


def check_gpus(accelerate_config: str, num_processes: int | None, visible: int | None = None):
    """GPU topologies need one visible GPU per process on each machine."""
    cfg = yaml.safe_load(Path(accelerate_config).read_text()) or {}
    dist = str(cfg.get("distributed_type", "NO")).upper()
    if cfg.get("use_cpu") or dist not in ("MULTI_GPU", "FSDP", "DEEPSPEED"):
        return
    procs = num_processes or int(cfg.get("num_processes") or 1)
    per_machine = -(-procs // int(cfg.get("num_machines") or 1))
    if visible is None:
        import torch

        visible = torch.cuda.device_count()
    if visible < per_machine:
        raise HealthCheckError(
            f"topology {Path(accelerate_config).name} ({dist}) starts {per_machine} processes "
            f"per machine, one per GPU, but this machine sees {visible} GPU(s). Check "
            "CUDA_VISIBLE_DEVICES and the driver, set launch.num_processes, or use "
            "configs/accelerate/single.yaml (one process) or cpu-ddp-2.yaml (CPU)."
        )


def check_storage(run_dir: Path, shard_dirs: list[str]) -> None:
    """Every stage's dataset index parses (each bucket's, for a bucketed stage), and the run
    folder accepts a write."""
    for d in shard_dirs:
        indexes = [Path(d) / "index.json"]
        try:
            if (Path(d) / "buckets.json").is_file():
                buckets = json.loads((Path(d) / "buckets.json").read_text())["buckets"]
                indexes = [Path(d) / b["name"] / "index.json" for b in buckets]
            for index in indexes:
                json.loads(index.read_text())
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise HealthCheckError(f"storage: cannot read the dataset index in {d}: {e}") from e
    probe = run_dir / ".health-probe"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise HealthCheckError(f"storage: the run folder {run_dir} is not writable: {e}") from e


def checkpoint_bytes(train: TrainConfig) -> int:
    """Disk a stage needs: `keep_checkpoints` x (fp32 weights + 2 AdamW moments + EMA in
    `train.ema_dtype`) plus one fp32 export. Parameters are counted on a meta copy of the UNet
    (no memory)."""
    import torch
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(train.model.unet)
    n = sum(p.numel() for p in unet.parameters())
    ema_bytes = (2 if train.ema_dtype == "bfloat16" else 4) if train.ema.enabled else 0
    per_ckpt = n * (4 * 3 + ema_bytes)
    return per_ckpt * train.keep_checkpoints + n * 4 * 2  # export: EMA and raw UNet


def check_disk(run_dir: Path, train: TrainConfig) -> None:
    need = checkpoint_bytes(train)
    free = shutil.disk_usage(run_dir if run_dir.exists() else run_dir.parent).free
    if free < need:
        raise HealthCheckError(
            f"disk: {free / 1e9:.1f} GB free under {run_dir}, but a stage's checkpoints need "
            f"about {need / 1e9:.1f} GB (train.keep_checkpoints={train.keep_checkpoints}); "
            "free space, lower keep_checkpoints, or move storage.root"
        )


def check_collective(launch: LaunchConfig, out: Path, timeout_s: float, nodes: int = 1) -> dict:
    """All-reduce across every process of the launch; returns models.collective_check's report.

    On a cluster backend the check is one job on `nodes` nodes (the largest pending stage's),
    so every rank of such an allocation takes part, as the stage's will.
    """
    run_file = write_run_file(HealthCheckRun(out_dir=str(out)), out / "health.yaml")
    try:
        launch_module(
            launch,
            "models.collective_check",
            ["--config", str(run_file)],
            nodes=nodes,
            workdir=out,
            name="health",
            timeout_s=timeout_s,
        )
    except LaunchError as e:
        raise HealthCheckError(
            f"collective: the all-reduce across the processes of "
            f"{Path(launch.accelerate_config).name} did not complete ({e}). Check that every "
            "node is up and can reach main_process_ip:main_process_port, and the NCCL/gloo "
            "setup."
        ) from e
    return json.loads((out / "health.json").read_text())


@task(name="preflight-health-check", cache_policy=NO_CACHE)
def preflight(
    train: TrainConfig,
    launch: LaunchConfig,
    run_dir: str,
    shard_dirs: list[str],
    nodes: int = 1,
) -> dict:
    """Run every check; raise HealthCheckError naming the first that fails. On a cluster
    backend the all-reduce runs as a job across `nodes` nodes."""
    log = task_logger(__name__)
    run = Path(run_dir)
    local = launch.backend == "local"
    if local:  # on a cluster the GPUs are on the nodes, not on this machine
        check_gpus(launch.accelerate_config, launch.num_processes)
    check_storage(run, shard_dirs)
    check_disk(run, train)
    if (
        local
        and topology_processes(launch.accelerate_config, launch.num_processes) == 1
        and not cuda_available()
    ):
        # One CPU process: no collective to form and no device to probe.
        report = {"world_size": 1, "collective": "skipped: one CPU process, nothing to all-reduce"}
    else:
        report = check_collective(launch, run / "health", launch.health_timeout_s, nodes)
    log.info("pre-flight health check passed: %s", report)
    return report


def _stage_samples(stats: dict) -> int:
    """Samples the loader can batch from: a bucketed stage batches each bucket on its own,
    so its largest bucket."""
    buckets = stats.get("buckets")
    return max(buckets.values()) if buckets else int(stats.get("samples", 0))


def check_stages(
    train: TrainConfig,
    launch: LaunchConfig,
    stage_stats: dict[int, dict],
    pending: list[int],
    on_gpu: bool,
    precomputed: bool = False,
) -> None:
    """Raise HealthCheckError for the first pending stage that cannot run as configured.

    Args:
        train: The `train` section.
        launch: The `launch` section (topology, processes, GPU memory).
        stage_stats: Per resolution, the dataset version's stage entry in shards.json.
        pending: Indexes of the stages still to train.
        on_gpu: Whether the stages train on GPUs (then the memory model is checked too).
        precomputed: Latents and text states come from shards (no frozen encoders).
    """
    worlds = stage_processes(launch, train)
    for i in pending:
        s, world = train.stages[i], worlds[i]
        if s.resolution not in stage_stats or train.mix:
            continue  # no count (check_storage names a missing dataset); a mix is resampled
        have = _stage_samples(stage_stats[s.resolution])
        need = s.global_batch(world)
        if have < need:
            raise HealthCheckError(
                f"stage {i + 1} ({s.resolution}px): its dataset has {have} training samples, "
                f"fewer than one global batch of {need} ({s.batch_size} per process x "
                f"{s.gradient_accumulation_steps} accumulated x {world} processes): no "
                f"optimizer step could complete an epoch; add images, lower "
                f"train.stages.{i}.batch_size or gradient_accumulation_steps, or train on "
                "fewer processes"
            )
    if on_gpu:
        check_memory(train, launch, pending, precomputed)


@task(name="stage-feasibility", cache_policy=NO_CACHE, retries=0)
def stage_feasibility(
    train: TrainConfig,
    launch: LaunchConfig,
    stage_stats: dict[int, dict],
    pending: list[int],
    precomputed: bool = False,
) -> None:
    """`check_stages` before anything is launched: every pending stage's dataset against its
    global batch, and its GPU memory when the run declares GPUs (`declares_gpus`)."""
    on_gpu = declares_gpus(launch)
    check_stages(train, launch, stage_stats, pending, on_gpu, precomputed)
    task_logger(__name__).info(
        "every pending stage fits its dataset%s", " and GPU memory" if on_gpu else ""
    )
