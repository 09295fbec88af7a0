"""Measure one stage's training throughput on this machine, through the real training loop.

Writes a small synthetic MDS dataset at the stage's resolution, then runs `build_models`,
`build_dataloader` and `train_loop` from `models.train` for a few steps in this process (one
device), with no checkpoints and no export. The last logging window (after warm-up and any
compilation) gives samples/s, MFU, the data-wait fraction and peak memory. `kiln plan` and
`benchmarks/train_throughput.py` both use it.
"""

from __future__ import annotations

import io
import json
import resource
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from streaming import MDSWriter

from kiln_config import StageRun, TrainConfig
from kiln_config.errors import InputError
from models.train import build_dataloader, build_models, train_loop
from models.training.cpu_threads import cpu_threads_per_process
from models.training.metrics import MetricsSink
from models.training.state import TrainContext

__all__ = ["MAX_MEASURED_VAL", "measure_stage", "write_synthetic_shards"]

# The largest synthetic validation split a measurement evaluates (its cost is paid twice).
MAX_MEASURED_VAL = 64


def write_synthetic_shards(
    out: Path, resolution: int, n: int, seed: int = 0, size_limit: int = 1 << 24
) -> None:
    """`n` random JPEG images with captions, in the columns the training loader reads."""
    rng = np.random.default_rng(seed)
    cols = {"image": "bytes", "caption": "str", "key": "str"}
    with MDSWriter(out=str(out), columns=cols, size_limit=size_limit) as w:
        for i in range(n):
            arr = rng.integers(0, 255, (resolution, resolution, 3), dtype=np.uint8)
            buf = io.BytesIO()
            Image.fromarray(arr).save(buf, format="JPEG", quality=90)
            w.write({"image": buf.getvalue(), "caption": f"synthetic sample {i}", "key": f"s{i}"})


def measure_stage(
    train: TrainConfig,
    stage_index: int,
    steps: int = 20,
    work_dir: str | None = None,
    local_processes: int = 1,
    val_samples: int | None = None,
) -> dict:
    """Train `steps` optimizer steps of stage `stage_index` on synthetic data; return rates.

    Without a GPU the steps run on the threads one of `local_processes` training processes gets from
    `accelerate launch` (`models.training.cpu_threads`), so the rate is the one a launch sees.

    `val_samples`: the validation images one process evaluates in the real run (its share of
    the split); the synthetic split has that many, up to `MAX_MEASURED_VAL`, because a pass
    has a fixed cost that a small split overstates per image (16 images measured 0.99 ms per
    forward where the run's 64 took 0.72 ms: a validation estimate 38% high).

    Returns img_per_s (this device), val_forward_s (one validation forward of one sample: the
    passes at the start and the end on a small synthetic split, the end's counted), mfu,
    data_wait_frac, peak_mem_gb, flops_per_sample, device, cpu_threads and the settings
    measured.
    """
    threads_before = torch.get_num_threads()
    cpu_threads = None
    if not torch.cuda.is_available():
        cpu_threads = cpu_threads_per_process(local_processes)
        torch.set_num_threads(cpu_threads)
    try:
        return _measure(train, stage_index, steps, work_dir, val_samples) | {
            "cpu_threads": cpu_threads
        }
    finally:
        torch.set_num_threads(threads_before)


def _measure(
    train: TrainConfig, stage_index: int, steps: int, work_dir: str | None, val_samples: int | None
) -> dict:
    if steps < 4:
        raise InputError(f"steps must be at least 4 (warm-up plus a measured window), got {steps}")
    stage = train.stages[stage_index]
    cfg = train.model_copy(deep=True)
    window = max(2, steps // 2)
    cfg.log_every = window
    cfg.checkpoint_every = 10**9
    cfg.eval_every = 10**9
    cfg.stages[stage_index] = stage.model_copy(update={"max_steps": steps, "warmup_steps": 0})
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        tmp = Path(tmp)
        n_val = _write_measured_data(tmp, stage, cfg, steps, val_samples)
        run = StageRun(
            train=cfg,
            stage_index=stage_index,
            shards=str(tmp / "shards"),
            output_dir=str(tmp / "out"),
            val_shards=str(tmp / "val"),
        )
        (tmp / "out").mkdir()
        accelerator = _train_steps(run)
        lines = [json.loads(x) for x in (tmp / "out" / "metrics.jsonl").read_text().splitlines()]
    perf = next(x for x in lines if x.get("event") == "perf")
    last = [x for x in lines if "samples_per_s" in x][-1]
    val = [x for x in lines if "val/eval_s" in x][-1]  # the end's pass: warmed up
    weights = sum(f"{w}/val/loss" in val for w in ("raw", "ema"))
    forwards = weights * 2 * cfg.val_timesteps * n_val  # right and shuffled captions
    if accelerator.device.type == "cuda":
        peak_mem = torch.cuda.max_memory_allocated() / 1e9
    else:  # peak resident set of this process (Linux reports KiB)
        peak_mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    return {
        "resolution": stage.resolution,
        "batch_size": stage.batch_size,
        "steps": steps,
        "measured_steps": window,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "precision": accelerator.mixed_precision,
        "img_per_s": last["samples_per_s"],
        "val_forward_s": val["val/eval_s"] / forwards,
        "mfu": last["mfu"],
        "data_wait_frac": last["data_wait_frac"],
        "peak_mem_gb": round(peak_mem, 3),
        "flops_per_sample": perf["flops_per_sample"],
        "peak_flops_per_device": perf["peak_flops_per_device"],
        "peak_source": perf["peak_source"],
    }


def _write_measured_data(
    tmp: Path, stage, cfg: TrainConfig, steps: int, val_samples: int | None
) -> int:
    """The synthetic training set (`tmp/shards`) and validation split (`tmp/val`); returns the
    validation split's size."""
    per_step = stage.global_batch(1)
    # Enough samples that the whole measurement is one epoch: an epoch boundary restarts
    # the streaming iterator, which on a 2-batch set costs more than the steps (4x too slow).
    write_synthetic_shards(tmp / "shards", stage.resolution, max(per_step * (steps + 2), 8))
    # A validation split of the run's size (one process's share, up to MAX_MEASURED_VAL;
    # else small): the passes at the start and the end give the cost of one
    # validation forward, which the plan multiplies out (a third of a training sample, the
    # rule of thumb, is 2.5x too much on a CPU).
    n_val = min(cfg.val_max_samples, val_samples or max(8, stage.batch_size))
    n_val = max(1, min(n_val, MAX_MEASURED_VAL))
    write_synthetic_shards(tmp / "val", stage.resolution, n_val, seed=1)
    return n_val


def _train_steps(run: StageRun):
    """Run the stage's training loop in this process, without checkpoints; returns the
    Accelerator it ran under."""
    from accelerate import Accelerator

    accelerator = Accelerator(
        gradient_accumulation_steps=run.stage.gradient_accumulation_steps,
        cpu=not torch.cuda.is_available(),
        dynamo_backend="inductor" if run.train.compile else "no",
    )
    sink = MetricsSink(Path(run.output_dir), None, None, "plan", True)
    comps, optimizer, sched, ema, dtype = build_models(run, accelerator)
    loader = build_dataloader(run, comps)
    if accelerator.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    ctx = TrainContext(run, accelerator, comps, optimizer, sched, ema, dtype, loader, sink)
    train_loop(ctx, checkpoints=False)
    loader.dataset.release()  # `kiln plan` measures every stage in one process
    return accelerator
