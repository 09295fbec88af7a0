"""`accelerate launch` as a Prefect task: a subprocess whose output streams into the run log.

Prefect wraps the command and never reaches into the training loop. The launched script
resumes from its own checkpoints, so a failed launch is simply launched again: the flow gives
`launch_stage` `retries=launch.max_restarts`. A watchdog kills a launch whose heartbeat file
goes stale (a hang, not a crash), and the whole process group is killed when the task ends
for any reason (failure, cancellation), so no orphan workers are left behind.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from prefect import task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext

from kiln_config import (
    EvaluateConfig,
    GpuLimitConfig,
    LaunchConfig,
    PrecomputeRun,
    StageRun,
    StudyRun,
    write_run_file,
)
from kiln_config.errors import MissingInput
from models.training.cpu_threads import cpu_threads_per_process
from models.training.divergence import DIVERGED
from tasks.launch.common import (
    ClusterJob,
    HeartbeatWatch,
    LaunchError,
    LaunchRejected,
    StageDiverged,
)
from tasks.launch.gpu_fit import cuda_available
from tasks.launch.gpu_limit import gpu_slot
from tasks.launch.kubernetes import run_train_job
from tasks.launch.orphan_guard import guarded, kill_tree
from tasks.launch.slurm import run_slurm_job
from tasks.planning.topology import local_processes, processes_per_machine
from tasks.runtime.logs import task_logger
from tasks.storage.layout import is_published

__all__ = [
    "ClusterJob",
    "HeartbeatWatch",
    "LaunchError",
    "LaunchRejected",
    "StageDiverged",
    "accelerate_command",
    "cuda_available",
    "launch_generate",
    "launch_module",
    "launch_precompute",
    "launch_stage",
    "run_launch",
]


def _raise_if_diverged(out: Path) -> None:
    marker = out / DIVERGED
    if marker.is_file():
        raise StageDiverged(json.loads(marker.read_text())["message"])


def _retry_unless_diverged(task, task_run, state) -> bool:
    """Prefect's retry condition: retry a crash, a hang or a lost node, never a diverged stage
    or a job the cluster refuses (both would fail the same way again)."""
    return not isinstance(getattr(state, "data", None), (StageDiverged, LaunchRejected))


def accelerate_command(
    accelerate_config: str, module: str, args: list[str], num_processes: int | None = None
) -> list[str]:
    """The argv of `accelerate launch --config_file CFG [--num_processes N] -m MODULE ARGS`.

    Without a GPU it also passes `--num_cpu_threads_per_process`
    (`models.training.cpu_threads.cpu_threads_per_process`): accelerate's own default is one thread
    per process unless the config says `use_cpu`, which left a one-process CPU launch on one
    core and `kiln plan`'s measurement (all cores) 30% optimistic.
    """
    if not Path(accelerate_config).is_file():
        raise MissingInput(f"launch.accelerate_config not found: {accelerate_config}")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", accelerate_config]
    if num_processes:
        cmd += ["--num_processes", str(num_processes)]
    if not cuda_available():
        threads = cpu_threads_per_process(local_processes(accelerate_config, num_processes))
        cmd += ["--num_cpu_threads_per_process", str(threads)]
    return cmd + ["-m", module, *args]


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the launch: every process under its guard (ranks in sessions of their own
    included), then the guard's group."""
    if proc.poll() is None:
        kill_tree(proc.pid)
        proc.wait()


def run_launch(
    cmd: list[str],
    *,
    heartbeat: Path | None = None,
    hang_timeout_s: float | None = None,
    logger: logging.Logger | logging.LoggerAdapter | None = None,
    on_progress: Callable[[int], None] | None = None,
    timeout_s: float | None = None,
    env: dict[str, str] | None = None,
    gpu_limit: GpuLimitConfig | None = None,
) -> None:
    """Run `cmd` in its own process group, streaming each output line to `logger`.

    `on_progress(step)` is called when the heartbeat's step changes; `timeout_s` bounds the
    whole launch (used by the health check); `env` adds variables to this process's. With
    `gpu_limit`, the launch waits for and holds a slot of that global concurrency limit
    (tasks/launch/gpu_limit.py).

    Raises:
        LaunchError: on a non-zero exit, or when `heartbeat` is older than `hang_timeout_s`.
    """
    logger = logger or task_logger(__name__)
    tail: collections.deque[str] = collections.deque(maxlen=40)
    env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    ms = [i for i, a in enumerate(cmd) if a == "-m"]
    what = f"launching {cmd[ms[-1] + 1]}" if ms and ms[-1] + 1 < len(cmd) else "launching"
    with gpu_slot(gpu_limit, logger, what):
        _run(cmd, logger, tail, env, heartbeat, hang_timeout_s, on_progress, timeout_s)


def _run(cmd, logger, tail, env, heartbeat, hang_timeout_s, on_progress, timeout_s) -> None:
    logger.info("launching: %s", " ".join(cmd))
    proc = subprocess.Popen(
        guarded(cmd),  # dies with this process, however it dies (tasks/launch/orphan_guard.py)
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,  # own process group: one killpg reaches every worker
        env=env,
    )

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            tail.append(line)
            logger.info(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    watch = HeartbeatWatch(heartbeat, hang_timeout_s, on_progress)
    hung = timed_out = None
    try:
        started = time.time()
        while proc.poll() is None:
            reader.join(timeout=1.0)
            if timeout_s and time.time() - started > timeout_s:
                timed_out = f"timed out after {timeout_s}s"
                logger.error("launch still running after %.0fs: killing it", timeout_s)
                break
            if hung := watch.check(started):
                logger.error("%s: killing the launch", hung)
                break
    finally:
        _kill_group(proc)
        reader.join(timeout=5)
    if hung or timed_out or proc.returncode != 0:
        why = hung or timed_out or f"exit code {proc.returncode}"
        raise LaunchError(f"accelerate launch failed: {why}\n" + "\n".join(tail))


def launch_module(
    launch: LaunchConfig,
    module: str,
    args: list[str],
    *,
    nodes: int = 1,
    workdir: Path,
    name: str,
    **watch,
) -> None:
    """`accelerate launch -m module args` through `launch.backend`: on this machine (holding a
    `launch.gpu_limit` slot), as a SLURM job or as a Kubeflow Trainer TrainJob on `nodes`
    nodes. `watch` is the heartbeat, hang timeout, progress callback, timeout and extra
    environment, which every backend honours.

    Raises:
        LaunchError: the launch failed, hung or timed out (the cluster backends' own errors
            are subclasses; a job the cluster refuses is a `LaunchRejected`).
    """
    if launch.backend == "local":
        cmd = accelerate_command(launch.accelerate_config, module, args, launch.num_processes)
        run_launch(cmd, gpu_limit=launch.gpu_limit, **watch)
        return
    rest = ["--config_file", launch.accelerate_config, "-m", module, *args]
    job = ClusterJob(
        rest, nodes, processes_per_machine(launch), name, task_logger(__name__), **watch
    )
    if launch.backend == "slurm":
        run_slurm_job(job, launch.slurm, workdir)
    else:
        run_train_job(job, launch.kubernetes)


@task(name="launch-stage", cache_policy=NO_CACHE, retry_condition_fn=_retry_unless_diverged)
def launch_stage(stage: StageRun, launch: LaunchConfig) -> dict:
    """Train one stage: write its run file (stage.yaml), launch `models.train` on it, return
    its manifest.

    `launch` gives the topology, the process count, the hang timeout and the GPU limit (the
    flow sets `retries=launch.max_restarts`). Idempotent: a relaunch resumes from the newest
    complete checkpoint, and a finished stage returns its manifest without training again.

    Raises:
        StageDiverged: The stage diverged, in this launch or an earlier one (not retried; no
            process is launched for a stage already marked).
        LaunchError: The launch crashed or hung (retried with `retries`).
    """
    out = Path(stage.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    _raise_if_diverged(out)
    stage_yaml = write_run_file(stage, out / "stage.yaml")
    total = stage.stage.max_steps
    progress_id = None
    if TaskRunContext.get() is not None:  # called as a task, not through .fn()
        progress_id = create_progress_artifact(
            progress=0.0,
            key=f"train-{stage.stage.resolution}px-progress",
            description=f"Optimizer steps of stage {stage.stage.resolution}px out of {total}",
        )

    def report(step: int) -> None:
        update_progress_artifact(progress_id, progress=100.0 * min(step, total) / total)

    try:
        launch_module(
            launch,
            "models.train",
            ["--config", str(stage_yaml)],
            nodes=stage.stage.num_machines,
            workdir=out,
            name=f"stage-{stage.stage.resolution}px",
            heartbeat=out / "heartbeat",
            hang_timeout_s=launch.hang_timeout_s,
            on_progress=report if progress_id else None,
            # streaming's S3 client takes a custom endpoint (MinIO, R2...) from the environment.
            env={"S3_ENDPOINT_URL": stage.s3_endpoint_url} if stage.s3_endpoint_url else None,
        )
    except LaunchError:
        _raise_if_diverged(out)
        raise
    if progress_id:
        update_progress_artifact(progress_id, progress=100.0)
    return json.loads((out / "manifest.json").read_text())


@task(name="launch-generate", cache_policy=NO_CACHE)
def launch_generate(
    pipeline_dir: str,
    prompts_csv: str,
    out_dir: str,
    *,
    evaluate: EvaluateConfig,
    launch: LaunchConfig,
    model_ref: str = "",
) -> dict:
    """Generate the evaluation images with `models.study_images`; returns the study.json content.

    The launch reads one run file (`kiln_config.StudyRun`), written into the study folder as
    `run.yaml`.

    Args:
        pipeline_dir: The exported pipeline folder.
        prompts_csv: Prompts file (`evaluate.prompts_csv` resolved, or a subset of it).
        out_dir: The study folder.
        evaluate: Seeds, inference steps, guidance, batch size and prompt limit.
        launch: The topology, process count and GPU limit of the launch.
        model_ref: The model's identity, recorded in study.json.
    """
    out = Path(out_dir)
    run = StudyRun(
        pipeline=pipeline_dir,
        out_dir=out_dir,
        model_ref=model_ref,
        evaluate=evaluate.model_copy(update={"prompts_csv": prompts_csv}),
    )
    run_file = write_run_file(run, out / "run.yaml")
    cmd = accelerate_command(
        launch.accelerate_config,
        "models.study_images",
        ["--config", str(run_file)],
        launch.num_processes,
    )
    run_launch(cmd, gpu_limit=launch.gpu_limit)
    return json.loads((out / "study.json").read_text())


@task(name="launch-precompute", cache_policy=NO_CACHE)
def launch_precompute(run: PrecomputeRun, launch: LaunchConfig) -> str:
    """Precompute one stage's latents with `models.precompute`; returns the dataset folder.

    The launch reads `run`, written beside the output as `.precompute-<name>.yaml`. With
    `run.val_out_dir`, the same launch also encodes the stage's validation split
    (`run.val_shards`) into it. Idempotent: complete folders (see
    `tasks.storage.layout.is_published`) are returned without work.
    """
    out, val_out = Path(run.out_dir), run.val_out_dir
    if is_published(out) and (val_out is None or is_published(Path(val_out))):
        return str(out)
    run_file = write_run_file(run, out.parent / f".precompute-{out.name}.yaml")
    cmd = accelerate_command(
        launch.accelerate_config,
        "models.precompute",
        ["--config", str(run_file)],
        launch.num_processes,
    )
    run_launch(cmd, gpu_limit=launch.gpu_limit)
    return str(out)
