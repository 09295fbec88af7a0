"""The catalog steps at scale: validate, incremental validate, shard planning and an ingest
into a large root, on synthetic catalogs of the ingest schema, each as the real `kiln`
command in a process of its own.

For each size N a root gets one synthetic ingest of N rows (LAION-like captions and sizes,
about 6% planted rule failures: small, blank, long and non-ASCII captions, extreme aspect
ratios, exact copies; skewed pHashes: 5% of rows near one of three placeholder hashes and
20% sharing one 16-bit block), then a second ingest of 10,000 new rows. Measured:

* `validate`: `kiln validate` of the first ingest (every row checked);
* `validate_incremental`: `kiln validate` of the second (its 10,000 rows checked, and
  compared with the first's for duplicates);
* `shard_plan`: `kiln shard --dry-run` (the dataset version and each stage's split);
* `ingest_append`: `kiln ingest` of 20 new images into the root, with the bytes it wrote
  against the size of the catalog's rows (`written_bytes`, `catalog_bytes`).

With `--dask-sizes`, validate and shard_plan also run on a `distributed.LocalCluster` of two
worker processes (`execution.dask_address`). CPU time and peak RSS are of the command's whole
process tree; every command talks to one Prefect server that the benchmark starts (a
deployment's server is not part of a step's cost); on Dask, the cluster's worker processes
are not in the tree either, so `cpu_s` there is the driver's alone. `exponents` are
least-squares slopes of log(wall s) and log(peak RSS) over log(rows), per step and engine;
`per_million` has the marginal CPU seconds per million rows between the smallest and the
largest size.

    python benchmarks/catalog_scale.py --out benchmarks/results/catalog_scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SOURCE = "s3://photos/licensed"
WORDS = [
    "a",
    "photo",
    "of",
    "the",
    "red",
    "blue",
    "green",
    "old",
    "young",
    "man",
    "woman",
    "child",
    "dog",
    "cat",
    "on",
    "in",
    "with",
    "street",
    "city",
    "mountain",
    "lake",
    "sunset",
    "portrait",
    "studio",
    "light",
    "dark",
    "wooden",
    "table",
    "close-up",
    "view",
    "from",
    "above",
    "vintage",
    "modern",
    "house",
    "car",
    "bicycle",
    "flowers",
    "garden",
    "beach",
    "snow",
    "forest",
    "night",
    "market",
]
CHUNK = 1_000_000  # rows synthesised and written at once
HOT = np.array([0x0, 0xFFFFFFFFFFFFFFFF, 0x8000800080008000], dtype=np.uint64)


def synth(n: int, seed: int, start: int, seq: int, ingest_id: str) -> pd.DataFrame:
    """n catalog rows of the ingest schema, keys numbered from `start`."""
    rng = np.random.default_rng(seed)
    w = rng.integers(256, 2048, n)
    h = (w * rng.uniform(0.6, 1.5, n)).astype(np.int64)
    u = rng.random(n)  # planted failures, about 6% in all
    w[u < 0.015] = 24  # too small
    h[(u >= 0.015) & (u < 0.025)] = w[(u >= 0.015) & (u < 0.025)] * 6  # extreme aspect
    idx = rng.integers(0, len(WORDS), (n, 9))
    caps = np.array([" ".join(WORDS[i] for i in row) for row in idx], dtype=object)
    caps[(u >= 0.025) & (u < 0.035)] = "   "
    caps[(u >= 0.035) & (u < 0.04)] = "x " * 600
    caps[(u >= 0.04) & (u < 0.05)] = "東京の夜景と川沿いの桜並木"
    sha = rng.integers(0, 2**63, (n, 4), dtype=np.int64)
    shas = np.array([f"{a:016x}{b:016x}{c:016x}{d:016x}" for a, b, c, d in sha], dtype=object)
    dup = np.flatnonzero((u >= 0.05) & (u < 0.06))
    shas[dup] = shas[rng.integers(0, max(1, n // 2), len(dup))]  # copies of other rows
    ph = rng.integers(0, 2**63, n, dtype=np.int64).astype(np.uint64) << np.uint64(1)
    hot = rng.random(n)
    near = hot < 0.05  # near one of three placeholder hashes
    flips = np.uint64(1) << rng.integers(0, 64, n).astype(np.uint64)
    ph[near] = HOT[rng.integers(0, 3, near.sum())] ^ flips[near]
    block = (hot >= 0.05) & (hot < 0.25)  # one hot 16-bit block
    ph[block] = (ph[block] & ~np.uint64(0xFFFF)) | np.uint64(0x1234)
    keys = np.array([f"{i:010d}.jpg" for i in range(start, start + n)], dtype=object)
    return pd.DataFrame(
        {
            "key": keys,
            "source": SOURCE,
            "object": keys,
            "offset": 0,
            "length": rng.integers(50_000, 900_000, n),
            "sha256": shas,
            "phash": np.array([f"{x:016x}" for x in ph], dtype=object),
            "width": w,
            "height": h,
            "format": "JPEG",
            "mode": "RGB",
            "bytes": rng.integers(50_000, 900_000, n),
            "conversion": "",
            "caption": caps,
            "unit": keys,
            "unit_version": "etag",
            "ingest_id": ingest_id,
            "ingest_seq": seq,
            "license": "licensed",
            "aesthetic": np.round(rng.uniform(3.5, 7.5, n), 2),
        }
    )


def chunks(n: int, seed: int, start: int, seq: int, ingest_id: str):
    """`synth` rows a million at a time (one frame when n is at most that), so that a
    10M-row catalog is written in a few GB; exact copies stay within a million rows."""
    if n <= CHUNK:
        yield synth(n, seed, start, seq, ingest_id)
        return
    for i, lo in enumerate(range(0, n, CHUNK)):
        yield synth(min(CHUNK, n - lo), seed * 1000 + i, start + lo, seq, ingest_id)


def write_ingest(
    root: Path, ingest_id: str, frames, seq: int, prev: str | None, totals: int
) -> None:
    from deltalake import write_deltalake

    from tasks.catalog import view as catalog_view
    from tasks.storage.layout import Layout

    settings = {
        "layout": "imagefolder",
        "caption_column": "text",
        "metadata_columns": ["license", "aesthetic"],
        "max_pixels": 178956970,
        "image_extensions": [".jpg"],
    }
    layout = Layout(root)
    frames = iter(frames)
    rows = next(frames)
    new_items = len(rows)
    version = catalog_view.write_ingest(layout, "accepted", rows, SOURCE, seq, "false")
    for rows in frames:  # the same ingest's further rows, appended to its partition
        dt = catalog_view.open_table(layout, "accepted")
        write_deltalake(
            dt,
            catalog_view._arrow(rows, dt, seq),
            mode="append",
            writer_properties=catalog_view.writer_properties(),
        )
        version = catalog_view.open_table(layout, "accepted").version()
        new_items += len(rows)
    versions = {"accepted": version, "quarantine": None}
    summary = {
        "ingest_id": ingest_id,
        "source": SOURCE,
        "layout": "imagefolder",
        "listed": totals,
        "accepted": totals,
        "quarantined": 0,
        "reasons": {},
        "manifest_problems": 0,
        "new_items": new_items,
        "view_accepted": totals,
        "view_quarantined": 0,
        "ingest_seq": seq,
        "previous": prev,
        "settings": settings,
        "superseded_accepted": 0,
        "manifests": {SOURCE: "none"},
        "source_settings": {SOURCE: settings},
        "removed": [],
        "table_versions": versions,
    }
    catalog_view.write_catalog_dir(
        layout.catalog(ingest_id),
        {
            "listing": pd.DataFrame(columns=["key", "size", "version", "source"]),
            "superseded": pd.DataFrame({"unit": pd.Series([], dtype=object)}),
        },
        summary,
    )
    layout.set_latest("catalog", ingest_id)


def measure(cmd: list[str], env: dict, cwd: Path = REPO) -> dict:
    """Run `cmd` in `cwd`; its wall time, CPU time and peak RSS (the whole process tree, and
    the command's own process: `driver_peak_rss_mb`, sampled)."""
    import psutil

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    peak, driver, done = 0, 0, threading.Event()

    def sample():
        nonlocal peak, driver
        root = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                tree = [root, *root.children(recursive=True)]
                rss = [p.memory_info().rss for p in tree]
                peak, driver = max(peak, sum(rss)), max(driver, rss[0])
            except psutil.Error:
                pass
            time.sleep(0.05)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    out, err = proc.communicate()
    done.set()
    t.join()
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-4000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "peak_rss_mb": round(peak / 2**20),
        "driver_peak_rss_mb": round(driver / 2**20),
        "output": out,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prefect_server(work: Path) -> tuple[subprocess.Popen, dict]:
    import urllib.request

    port = _free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(work / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
    }
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "prefect"),
            "server",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(240):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2)
            return proc, env
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the Prefect server did not start")


def _config(work: Path, root: Path, dask: str | None) -> Path:
    text = (REPO / "configs" / "tiny.yaml").read_text()
    path = work / ("dask.yaml" if dask else "local.yaml")
    extra = f"\nexecution:\n  dask_address: {dask}\n" if dask else ""
    path.write_text(text + extra)
    return path


def machine() -> dict:
    """The machine a benchmark ran on: core count, platform, Python."""
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def _fit(rows: list[int], values: list[float]) -> float | None:
    if len(set(rows)) < 2:
        return None
    return round(float(np.polyfit(np.log(rows), np.log(values), 1)[0]), 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", default="100000,1000000,3000000")
    ap.add_argument("--dask-sizes", default="", help="Sizes also run on a Dask LocalCluster.")
    ap.add_argument("--work", default=None, help="Scratch folder (default: a temporary one).")
    ap.add_argument(
        "--steps",
        default="validate,validate_incremental,shard_plan,ingest_append",
        help="Steps to run (comma-separated).",
    )
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",") if x]
    dask_sizes = {int(x) for x in args.dask_sizes.split(",") if x}
    work = Path(args.work or tempfile.mkdtemp(prefix="kiln-catalog-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    kiln = [sys.executable, "-m", "kiln_cli"]  # this checkout's CLI, whatever is installed
    server, env = _prefect_server(work)
    cluster = None
    runs = []
    try:
        if dask_sizes:
            from distributed import LocalCluster

            cluster = LocalCluster(
                n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
            )
        from kiln_demo.data import write_demo_dataset

        extra_src = work / "new-images"
        if not extra_src.is_dir():
            write_demo_dataset(extra_src, n=20, seed=7)
        for n in sizes:
            root = work / f"root-{n}"
            shutil.rmtree(root, ignore_errors=True)
            write_ingest(root, "ing-bench-base", chunks(n, 1, 0, 1, "ing-bench-base"), 1, None, n)
            write_ingest(
                root,
                "ing-bench-more",
                chunks(10_000, 2, n, 2, "ing-bench-more"),
                2,
                "ing-bench-base",
                n + 10_000,
            )
            engines = ["local"] + (["dask"] if n in dask_sizes else [])
            for engine in engines:
                cfg = _config(work, root, cluster.scheduler_address if engine == "dask" else None)
                base = [*kiln, "--debug"]
                steps = [
                    (
                        "validate",
                        [
                            *base,
                            "validate",
                            "--config",
                            str(cfg),
                            "--root",
                            str(root),
                            "--ingest-id",
                            "ing-bench-base",
                        ],
                    ),
                    (
                        "validate_incremental",
                        [
                            *base,
                            "validate",
                            "--config",
                            str(cfg),
                            "--root",
                            str(root),
                            "--ingest-id",
                            "ing-bench-more",
                        ],
                    ),
                    (
                        "shard_plan",
                        [
                            *base,
                            "shard",
                            "--config",
                            str(cfg),
                            "--root",
                            str(root),
                            "--ingest-id",
                            "ing-bench-more",
                            "--dry-run",
                        ],
                    ),
                ]
                if engine == "local":
                    steps.append(
                        (
                            "ingest_append",
                            [
                                *base,
                                "ingest",
                                "--config",
                                str(cfg),
                                "--root",
                                str(root),
                                "--source",
                                str(extra_src),
                            ],
                        )
                    )
                for step, cmd in [s for s in steps if s[0] in args.steps.split(",")]:
                    if step == "validate":  # every row checked: no earlier verdict to start from
                        for v in (root / "catalog").glob("*/verdict.json"):
                            v.unlink()
                    before = {f for f in (root / "catalog").rglob("*") if f.is_file()}
                    got = measure(cmd, env)
                    got.pop("output")
                    run = {"step": step, "engine": engine, "rows": n, **got}
                    if step == "ingest_append":
                        files = [
                            f
                            for f in (root / "catalog").rglob("*")
                            if f.is_file() and f not in before
                        ]
                        run["written_bytes"] = sum(f.stat().st_size for f in files)
                        accepted = root / "catalog" / "tables" / "accepted"
                        run["catalog_bytes"] = sum(
                            f.stat().st_size for f in accepted.rglob("*.parquet")
                        )
                    print(json.dumps(run), flush=True)
                    runs.append(run)
            shutil.rmtree(root, ignore_errors=True)
    finally:
        if cluster is not None:
            cluster.close()
        server.terminate()
        server.wait(30)
    exponents, per_million = {}, {}
    for step in sorted({r["step"] for r in runs}):
        for engine in ("local", "dask"):
            mine = sorted(
                (r for r in runs if r["step"] == step and r["engine"] == engine),
                key=lambda r: r["rows"],
            )
            if len(mine) < 2:
                continue
            name = step if engine == "local" else f"{step}@dask"
            rows = [r["rows"] for r in mine]
            exponents[name] = {
                "time": _fit(rows, [r["wall_s"] for r in mine]),
                "rss": _fit(rows, [r["peak_rss_mb"] for r in mine]),
            }
            lo, hi = mine[0], mine[-1]
            per_million[name] = round(
                (hi["cpu_s"] - lo["cpu_s"]) / (hi["rows"] - lo["rows"]) * 1e6, 2
            )
    out = {
        "machine": machine(),
        "sizes": sizes,
        "runs": runs,
        "exponents": exponents,
        "per_million": per_million,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps({"exponents": exponents, "per_million": per_million}, indent=2))


if __name__ == "__main__":
    main()
