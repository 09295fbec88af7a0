"""Ingest memory against the number of items it decodes: `kiln ingest` of N small images.

For each size N, a folder of N distinct 64-px JPEGs with a `metadata.csv` of captions (made
once, cached in --work) is ingested into a fresh root by the real `kiln ingest` command, in a
process of its own (two decode processes, the default partitions of 1,000 items). Measured:
wall time, CPU time, the peak RSS of the command's process tree and of the command's own
process (the driver, which lists the source, compares it with the view and commits the rows;
the decode processes hold one partition's items each). Each size is ingested twice: `first`
into the fresh root, and `unchanged`, the same command again, which lists the source, compares
it with the view and decodes nothing.

`--baseline PATH` runs the same commands from another checkout of Kiln (for example
`git worktree add /tmp/kiln-base <commit>`) in the same run, so the two can be compared on
one machine at one load. `exponents` are least-squares slopes of log(peak RSS) over
log(items) per code.

    python benchmarks/ingest_memory.py --out benchmarks/results/ingest_memory.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from catalog_scale import REPO, _fit, _prefect_server, machine, measure  # noqa: E402

CAPTION = "a photo of a {} {} on a wooden table, soft window light, shallow depth of field"


def _write_images(job: tuple[str, int, int]) -> None:
    """Images `lo`..`hi`-1 of the source, each its own noise (so no two share a hash)."""
    from PIL import Image

    folder, lo, hi = job
    rng = np.random.default_rng(lo)
    for i in range(lo, hi):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(buf, "JPEG")
        Path(folder, f"{i:08d}.jpg").write_bytes(buf.getvalue())


def make_source(folder: Path, n: int) -> None:
    """N images and their `metadata.csv`, once: a complete folder is reused."""
    if (folder / "metadata.csv").is_file():
        return
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    step = 2000
    with ProcessPoolExecutor(os.cpu_count() or 1) as pool:
        list(
            pool.map(
                _write_images, [(str(folder), lo, min(n, lo + step)) for lo in range(0, n, step)]
            )
        )
    colours, things = ["red", "blue", "green", "old"], ["cup", "chair", "lamp", "book", "vase"]
    rows = ["file_name,text"] + [
        f"{i:08d}.jpg,{CAPTION.format(colours[i % 4], things[i % 5])}" for i in range(n)
    ]
    tmp = folder / "metadata.csv.tmp"
    tmp.write_text("\n".join(rows) + "\n")
    tmp.rename(folder / "metadata.csv")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", default="10000,30000,100000")
    ap.add_argument("--work", default=None, help="Scratch folder (default: a temporary one).")
    ap.add_argument("--baseline", default=None, help="Another checkout of Kiln to compare with.")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",") if x]
    work = Path(args.work or tempfile.mkdtemp(prefix="kiln-ingest-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    cfg = work / "ingest.yaml"
    cfg.write_text((REPO / "configs" / "tiny.yaml").read_text())
    codes = {"this": REPO}
    if args.baseline:
        codes["baseline"] = Path(args.baseline).resolve()
    server, env = _prefect_server(work)
    runs = []
    try:
        for n in sizes:
            src = work / f"source-{n}"
            make_source(src, n)
            for code, checkout in codes.items():
                root = work / f"root-{n}-{code}"
                shutil.rmtree(root, ignore_errors=True)
                cmd = [
                    sys.executable,
                    "-m",
                    "kiln_cli",
                    "ingest",
                    "--config",
                    str(cfg),
                    "--root",
                    str(root),
                    "--source",
                    str(src),
                ]
                for step in ("first", "unchanged"):
                    got = measure(cmd, {**env, "PYTHONPATH": str(checkout)}, cwd=checkout)
                    got.pop("output")
                    run = {"code": code, "step": step, "items": n, **got}
                    print(json.dumps(run), flush=True)
                    runs.append(run)
                shutil.rmtree(root, ignore_errors=True)
    finally:
        server.terminate()
        server.wait(30)
    exponents = {}
    for code in codes:
        for step in ("first", "unchanged"):
            mine = sorted(
                (r for r in runs if (r["code"], r["step"]) == (code, step)),
                key=lambda r: r["items"],
            )
            items = [r["items"] for r in mine]
            exponents[f"{code}/{step}"] = {
                "rss": _fit(items, [r["peak_rss_mb"] for r in mine]),
                "driver_rss": _fit(items, [r["driver_peak_rss_mb"] for r in mine]),
                "time": _fit(items, [r["wall_s"] for r in mine]),
            }
    out = {
        "machine": machine(),
        "sizes": sizes,
        "runs": runs,
        "exponents": exponents,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps({"exponents": exponents}, indent=2))


if __name__ == "__main__":
    main()
