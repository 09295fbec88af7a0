"""The cost of a training sample grid (models/evaluation/sample_grid.py) against the step time.

    python benchmarks/sample_grids.py --config configs/tiny.yaml --out grids.json

For each stage of the config: the seconds of one grid (export to a temporary folder, load,
generate `len(sample_prompts) x len(sample_seeds)` images at `sample_steps`, tile, save; the
median of `--repeats`), the seconds of one optimizer step (models.measure_throughput, the
real training loop on synthetic data), and their ratio. A grid every `sample_every` steps
then costs `grid_s / (sample_every * step_s)` of the training time, plus one grid at the end
of each stage.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from accelerate import Accelerator

from kiln_config import StageRun, load_config
from models.evaluation.sample_grid import sample_grid
from models.measure_throughput import measure_stage
from models.train import build_models
from models.training.metrics import MetricsSink


def grid_seconds(train, stage_index: int, repeats: int) -> list[float]:
    """Seconds of each of `repeats` grids of the stage's freshly built model."""
    with tempfile.TemporaryDirectory() as tmp:
        run = StageRun(train=train, stage_index=stage_index, shards=tmp, output_dir=tmp)
        accelerator = Accelerator(cpu=not torch.cuda.is_available())
        comps, _, _, ema, _ = build_models(run, accelerator)
        sink = MetricsSink(Path(tmp), None, None, "bench", True)
        times = []
        for step in range(1, repeats + 1):
            t0 = time.perf_counter()
            sample_grid(run, accelerator, comps, ema, step, sink)
            times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--out", required=True)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=8, help="Training steps measured per stage")
    args = p.parse_args()
    train = load_config(args.config).train
    stages = []
    for i, stage in enumerate(train.stages):
        times = grid_seconds(train, i, args.repeats)
        rate = measure_stage(train, i, steps=args.steps)["img_per_s"]
        step_s = stage.global_batch(1) / rate
        grid_s = statistics.median(times)
        stages.append(
            {
                "resolution": stage.resolution,
                "images_per_grid": len(train.sample_prompts) * len(train.sample_seeds),
                "sample_steps": train.sample_steps,
                "grid_s": round(grid_s, 3),
                "grid_s_each": [round(t, 3) for t in times],
                "step_s": round(step_s, 4),
                "grid_over_step": round(grid_s / step_s, 2),
                "max_steps": stage.max_steps,
                "share_of_stage_end_only": round(grid_s / (grid_s + stage.max_steps * step_s), 4),
            }
        )
        print(json.dumps(stages[-1]), flush=True)
    result = {
        "config": args.config,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "threads": torch.get_num_threads(),
        "stages": stages,
    }
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
