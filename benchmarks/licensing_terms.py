"""The licensing terms' cost per validate: every row of the view is read and checked at every
run (data_quality/terms.py), while the suite checks only the rows new since the last verdict.

On a synthetic catalog of N rows (the accepted table's licensing columns: source, key,
contributor from 5,000, license end dates over 2025-2045, about 9% ended, 1% null, 0.1% not a
date), in row groups of `ROW_GROUP` as the catalog writes them, measured per size:

* `read_s`: reading the four columns a row group at a time (`tasks.catalog.view.read_part`),
  the baseline: what any full pass over the view costs;
* `terms_s`: the same reads plus `check_terms` with a takedown list of 10,000 images and 10
  contributors (what `tasks.quality.validate._terms` does);
* `check_s` = terms_s - read_s, and `per_million_s`: check_s per million rows;
* `peak_rss_mb` of the process after the terms pass.

    python benchmarks/licensing_terms.py --sizes 1000000 4000000 \\
        --out benchmarks/results/licensing_terms.json
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np
import pandas as pd

from data_quality.terms import Takedowns, check_terms
from kiln_config import QualityConfig
from tasks.catalog.view import ROW_GROUP, ViewPart, read_part

COLUMNS = ["source", "key", "contributor", "license_end"]


def _catalog(path: Path, n: int, seed: int = 0) -> ViewPart:
    rng = np.random.default_rng(seed)
    days = pd.to_datetime("2025-01-01") + pd.to_timedelta(rng.integers(0, 7300, n), unit="D")
    ends = days.strftime("%Y-%m-%d").to_numpy(object)
    ends[rng.random(n) < 0.01] = None
    ends[rng.random(n) < 0.001] = "someday"
    df = pd.DataFrame(
        {
            "source": "s3://bucket/licensed",
            "key": [f"{i:09d}.jpg" for i in range(n)],
            "contributor": [f"c{i:05d}" for i in rng.integers(0, 5000, n)],
            "license_end": ends,
        }
    )
    df.to_parquet(path, index=False, row_group_size=ROW_GROUP)
    groups = -(-n // ROW_GROUP)
    return ViewPart(path=path, ingest_id="bench", seq=1, source=None, rows=n, row_groups=groups)


def _timed(part: ViewPart, check) -> float:
    t = time.perf_counter()
    for g in range(part.row_groups):
        check(read_part(part, COLUMNS, [g]))
    return time.perf_counter() - t


def run(n: int, tmp: Path) -> dict:
    part = _catalog(tmp / f"catalog-{n}.parquet", n)
    rules = QualityConfig()
    rng = np.random.default_rng(1)
    down = Takedowns(
        images=frozenset(
            ("s3://bucket/licensed", f"{i:09d}.jpg") for i in rng.integers(0, n, 10_000)
        ),
        contributors=frozenset(f"c{i:05d}" for i in range(10)),
    )
    today = date(2026, 11, 26)
    read_s = min(_timed(part, lambda df: None) for _ in range(2))
    hits = []
    terms_s = min(
        _timed(part, lambda df: hits.append(len(check_terms(df, rules, down, today))))
        for _ in range(2)
    )
    check_s = max(0.0, terms_s - read_s)
    return {
        "rows": n,
        "read_s": round(read_s, 3),
        "terms_s": round(terms_s, 3),
        "check_s": round(check_s, 3),
        "per_million_s": round(check_s / n * 1e6, 3),
        "quarantined": sum(hits) // 2,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1_000_000])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/licensing_terms.json"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = [run(n, Path(tmp)) for n in args.sizes]
    out = {
        "benchmark": "licensing_terms",
        "machine": platform.platform(),
        "python": platform.python_version(),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    json.dump(out, sys.stdout, indent=2)


if __name__ == "__main__":
    main()
