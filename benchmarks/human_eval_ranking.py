"""The Bradley-Terry ranking's cost in a human-evaluation report: its bootstrap intervals are
drawn `human_eval.bootstrap_resamples` times (2,000 by default), the same count as the
preference intervals'.

On synthetic votes (M models with known strengths, each adjacent pair compared on P prompts
with K votes per pair, ties 10%), measured per model count, one question:

* `baseline_s`: `bradley_terry` with 200 resamples, the baseline of the same run;
* `config_s`: with `HumanEvalConfig().bootstrap_resamples`; each also as `*_cpu_s`, the
  process's CPU time, which a busy shared machine changes less than the wall time;
* `ci_width`: each run's mean interval width, and `order_ok`: whether the fit ranks the
  models as their true strengths do.

    python benchmarks/human_eval_ranking.py --models 3 5 \\
        --out benchmarks/results/human_eval_ranking.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

from human_eval.stats import bradley_terry
from kiln_config import HumanEvalConfig

BASELINE_RESAMPLES = 200


def _outcomes(models: int, prompts: int, votes: int, seed: int = 0) -> list[tuple[int, int, float]]:
    """(i, j, score of i) for each adjacent pair's votes, strengths 0, 0.3, 0.6, ..."""
    rng = np.random.default_rng(seed)
    strength = 0.3 * np.arange(models)
    rows = []
    for i in range(models - 1):
        j = i + 1
        p_i = 1 / (1 + np.exp(strength[j] - strength[i]))
        for _ in range(prompts * votes):
            u = rng.random()
            rows.append((i, j, 0.5 if u < 0.1 else float(rng.random() < p_i)))
    return rows


def _timed(models: int, rows: list, n: int) -> tuple[float, float, dict]:
    """(wall seconds, this process's CPU seconds, the ranking)."""
    t, c = time.perf_counter(), time.process_time()
    bt = bradley_terry(models, rows, n_resamples=n, seed=0)
    return time.perf_counter() - t, time.process_time() - c, bt


def run(models: int, prompts: int, votes: int) -> dict:
    rows = _outcomes(models, prompts, votes)
    configured = HumanEvalConfig().bootstrap_resamples
    out = {"models": models, "outcomes": len(rows), "resamples": configured,
           "baseline_resamples": BASELINE_RESAMPLES}  # fmt: skip
    for name, n in (("baseline", BASELINE_RESAMPLES), ("config", configured)):
        seconds, cpu, bt = _timed(models, rows, n)
        out[f"{name}_s"] = round(seconds, 3)
        out[f"{name}_cpu_s"] = round(cpu, 3)
        out[f"{name}_ci_width"] = round(float(np.mean([h - lo for lo, h in bt["ci"]])), 4)
        out[f"{name}_order_ok"] = bt["order"] == list(range(models))[::-1]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=int, nargs="+", default=[3, 5])
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--votes", type=int, default=5, help="votes per pair (raters_per_pair)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/human_eval_ranking.json"))
    args = p.parse_args()
    results = [run(m, args.prompts, args.votes) for m in args.models]
    out = {"benchmark": "human_eval_ranking", "machine": platform.platform(),
           "python": platform.python_version(), "results": results}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    json.dump(out, sys.stdout, indent=2)


if __name__ == "__main__":
    main()
