"""The Bradley-Terry ranking's cost in a human-evaluation report: its bootstrap intervals are
drawn `human_eval.bootstrap_resamples` times (2,000 by default), the same count as the
preference intervals', each resample one I-LSR fit (`choix`) on a matrix of win counts.

On synthetic votes (M models with known strengths, each adjacent pair compared on P prompts
with K votes per pair, ties 10%), measured per model count, one question:

* `baseline_*`: 200 resamples, each fit from a list of (winner, loser) pairs, one per
  half-outcome (`choix.ilsr_pairwise`): the count and fit the ranking used before it read the
  config, measured in the same run;
* `config_*`: `human_eval.stats.bradley_terry` with `HumanEvalConfig().bootstrap_resamples`;
* `*_s` wall seconds and `*_cpu_s` the process's CPU seconds (a busy shared machine changes
  them less); `*_ci_width` the mean interval width; `*_order_ok` whether the fit ranks the
  models as their true strengths do; `max_strength_diff` between the two fits on all votes.

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


def _list_fit(models: int, rows: np.ndarray) -> np.ndarray:
    """The baseline's fit: one (winner, loser) pair per half-outcome, a tie once each way."""
    import choix

    comps = []
    for i, j, s in rows:
        i, j = int(i), int(j)
        comps += [(i, j)] * int(round(2 * s)) + [(j, i)] * int(round(2 * (1 - s)))
    return choix.ilsr_pairwise(models, comps, alpha=0.01)


def _baseline(models: int, outcomes: list, n: int, seed: int = 0) -> dict:
    """The baseline ranking, drawn as `bradley_terry` draws its resamples."""
    data = np.asarray(outcomes, dtype=float)
    strength = _list_fit(models, data)
    rng = np.random.default_rng(seed)
    boots = np.array(
        [_list_fit(models, data[rng.integers(0, len(data), len(data))]) for _ in range(n)]
    )
    ci = np.percentile(boots, [2.5, 97.5], axis=0).T
    return {
        "strength": strength.tolist(),
        "ci": ci.tolist(),
        "order": [int(k) for k in np.argsort(-strength)],
    }


def _timed(fn) -> tuple[float, float, dict]:
    """(wall seconds, this process's CPU seconds, fn's ranking)."""
    t, c = time.perf_counter(), time.process_time()
    bt = fn()
    return time.perf_counter() - t, time.process_time() - c, bt


def run(models: int, prompts: int, votes: int) -> dict:
    rows = _outcomes(models, prompts, votes)
    configured = HumanEvalConfig().bootstrap_resamples
    out = {
        "models": models,
        "outcomes": len(rows),
        "resamples": configured,
        "baseline_resamples": BASELINE_RESAMPLES,
    }
    runs = {
        "baseline": lambda: _baseline(models, rows, BASELINE_RESAMPLES),
        "config": lambda: bradley_terry(models, rows, n_resamples=configured, seed=0),
    }
    fits = {}
    for name, fn in runs.items():
        seconds, cpu, bt = _timed(fn)
        fits[name] = np.asarray(bt["strength"])
        out[f"{name}_s"] = round(seconds, 3)
        out[f"{name}_cpu_s"] = round(cpu, 3)
        out[f"{name}_ci_width"] = round(float(np.mean([h - lo for lo, h in bt["ci"]])), 4)
        out[f"{name}_order_ok"] = bt["order"] == list(range(models))[::-1]
    out["max_strength_diff"] = float(np.abs(fits["baseline"] - fits["config"]).max())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=int, nargs="+", default=[3, 5])
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--votes", type=int, default=5, help="votes per pair (raters_per_pair)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/human_eval_ranking.json"))
    args = p.parse_args()
    results = [run(m, args.prompts, args.votes) for m in args.models]
    out = {
        "benchmark": "human_eval_ranking",
        "machine": platform.platform(),
        "python": platform.python_version(),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    json.dump(out, sys.stdout, indent=2)


if __name__ == "__main__":
    main()
