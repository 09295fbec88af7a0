"""The memory model (tasks/planning/memory_model.py, tasks/planning/activation_trace.py) beside
measured CPU peaks: one real training step per case in a fresh process
(tests/tasks/planning/_measure_step_memory.py), the tiny UNet and one with the sd2-base widths, head
counts and text width but fewer blocks.

Parameters, gradients and AdamW state are compared byte for byte; activations as the predicted
peak over the measured rise of the process's peak resident memory.

    python benchmarks/memory_model.py --out benchmarks/results/memory_model.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
SD2 = yaml.safe_load((REPO / "configs" / "sd2-base.yaml").read_text())["train"]["model"]["unet"]
TINY = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())["train"]["model"]["unet"]
SD2_REDUCED = {
    **SD2,
    "block_out_channels": [320, 640],
    "layers_per_block": 1,
    "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
    "attention_head_dim": [5, 10],
}
CASES = [  # name, unet, batch, latent side, attention, checkpointing, precision
    ("tiny", TINY, 32, 32, "sdpa", False, "no"),
    ("tiny eager attention", TINY, 32, 32, "eager", False, "no"),
    ("tiny checkpointing", TINY, 32, 32, "sdpa", True, "no"),
    ("tiny bf16", TINY, 32, 32, "sdpa", False, "bf16"),
    ("sd2 widths", SD2_REDUCED, 2, 16, "sdpa", False, "no"),
    ("sd2 widths", SD2_REDUCED, 4, 32, "sdpa", False, "no"),
    ("sd2 widths checkpointing", SD2_REDUCED, 4, 32, "sdpa", True, "no"),
    ("sd2 widths bf16", SD2_REDUCED, 2, 16, "sdpa", False, "bf16"),
]


def _case(unet: dict, batch: int, side: int, attention: str, ckpt: bool, precision: str) -> dict:
    from tasks.planning.activation_trace import trace_activations, unet_parameter_count

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "tests" / "tasks" / "planning" / "_measure_step_memory.py"),
            json.dumps([unet, batch, side, 77, attention, ckpt, precision]),
        ],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    n = unet_parameter_count(unet)
    predicted = trace_activations(unet, batch, side, 77, attention).peak_bytes(
        precision, ckpt, fp32_norms=False
    ) + (2 * n if precision == "bf16" else 0)
    return {
        "parameters": n,
        "state_exact": measured["parameters"] == 4 * n
        and measured["gradients"] == 4 * n
        and measured["optimizer"] == 8 * n,
        "activations_predicted_mb": round(predicted / 1e6, 1),
        "activations_measured_mb": round(measured["activations"] / 1e6, 1),
        "error": round(predicted / measured["activations"] - 1, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON output path")
    args = p.parse_args()
    rows = []
    for name, unet, batch, side, attention, ckpt, precision in CASES:
        row = {
            "case": name,
            "batch": batch,
            "latent_side": side,
            **_case(unet, batch, side, attention, ckpt, precision),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {
        "benchmark": "memory_model",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "cases": rows,
        "max_abs_error": max(abs(r["error"]) for r in rows),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
