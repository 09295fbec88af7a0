"""Shard: write one MDS dataset per training stage from the clean catalog, in partitions.

`<root>/shards/<dataset_version>/<resolution>/` holds the images whose short side is at least
`resolution * shards.min_side_factor`, resized (Lanczos) and centre-cropped to a square, as
JPEG bytes plus caption. The dataset version hashes the clean catalog and the shard settings:
the same input gives the same version, and an existing version is reused. Each resolution is
written to a temporary folder and renamed into place only when complete, so a reader never
sees a partial dataset.

Conversion runs in partitions of `partition_size` images, as Prefect tasks (threads feeding
one process pool locally, or a Dask cluster). Each partition decodes an image once and writes
one MDS part per stage under `.partial/<resolution>/part-NNNNN/`; a part is finished when its
`index.json` exists, so a crashed conversion redoes only unfinished partitions. When every
partition is done, the parts of a stage are merged into one `index.json` with streaming's
`merge_index`, read back and checked, and the folder is renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import shutil
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd
from prefect import task
from prefect.cache_policies import NO_CACHE
from streaming import MDSWriter
from streaming.base.util import merge_index

from tasks.decode import render_for_stages
from tasks.layout import Layout
from tasks.logs import task_logger
from tasks.runners import partition_runner
from tasks.sources import CATALOG_COLUMNS

__all__ = ["MDS_COLUMNS", "ShardResult", "dataset_version", "write_shards"]


# MosaicML's diffusion shards store JPEG bytes too; a plain StreamingDataset reads them back.
MDS_COLUMNS = {
    "image": "bytes",
    "caption": "str",
    "key": "str",
    "orig_width": "int32",
    "orig_height": "int32",
    "crop_top": "int32",
    "crop_left": "int32",
    "meta": "json",  # pass-through metadata columns of the catalog (license, ...)
}
FORMAT_VERSION = 3


@dataclass
class ShardResult:
    dataset_version: str
    ingest_id: str
    stages: dict[int, dict] = field(default_factory=dict)  # resolution -> samples, bytes, shards
    reused: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def dataset_version(clean: pd.DataFrame, settings: dict) -> str:
    """Content hash of the clean catalog (keys, bytes, captions) and the shard settings."""
    h = hashlib.sha256(json.dumps({**settings, "format": FORMAT_VERSION}, sort_keys=True).encode())
    rows = clean.sort_values(["source", "key"])[["source", "key", "sha256", "caption"]]
    for src, key, sha, cap in rows.itertuples(index=False):
        h.update(f"\0{src}\0{key}\0{sha}\0{cap}".encode())
    return "ds-" + h.hexdigest()[:12]


def _stage_stats(path: Path) -> dict:
    index = json.loads((path / "index.json").read_text())
    shards = index["shards"]
    return {
        "samples": sum(s["samples"] for s in shards),
        "shards": len(shards),
        "bytes": sum(s["raw_data"]["bytes"] for s in shards),
    }


@task(name="shard-partition", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def write_partition(
    partial: str, index: int, jobs: list[tuple], rows: dict, size_limit: int, pool=None
) -> dict:
    """Render one partition's images and write one MDS part per stage; skip finished parts."""
    base = Path(partial)
    stages = sorted({r for job in jobs for r in job[6]})
    parts = {r: base / str(r) / f"part-{index:05d}" for r in stages}
    todo = [r for r in stages if not (parts[r] / "index.json").is_file()]
    if not todo:
        return {"index": index, "skipped": True}
    jobs = [(*j[:6], [r for r in j[6] if r in todo], *j[7:]) for j in jobs]
    jobs = [j for j in jobs if j[6]]
    done = pool.map(render_for_stages, jobs, chunksize=8) if pool else map(render_for_stages, jobs)
    rendered = {}
    for job, d in zip(jobs, done, strict=True):
        if "error" in d:
            # Ingest decoded these already: a failure means the source changed under us.
            raise RuntimeError(f"{job[0]}/{d['key']}: failed to re-read during sharding: "
                               f"{d['error']}")  # fmt: skip
        rendered[(job[0], d["key"])] = d["images"]
    for r in todo:
        shutil.rmtree(parts[r], ignore_errors=True)  # a part left half-written by a crash
        with MDSWriter(out=str(parts[r]), columns=MDS_COLUMNS, size_limit=size_limit) as w:
            for uid in sorted(u for u in rendered if r in rendered[u]):
                img, top, left = rendered[uid][r]
                row = rows[uid]
                w.write({"image": img, "caption": row["caption"], "key": uid[1],
                         "orig_width": int(row["width"]), "orig_height": int(row["height"]),
                         "crop_top": top, "crop_left": left, "meta": row["meta"]})  # fmt: skip
    return {"index": index, "skipped": False}


def _check_readback(path: Path, resolution: int, expected: int, sample: int = 32) -> None:
    """Open the merged dataset with StreamingDataset and check count, decode, size, caption."""
    import io

    from PIL import Image
    from streaming import StreamingDataset

    ds = StreamingDataset(local=str(path), batch_size=1, shuffle=False)
    if ds.num_samples != expected:
        raise RuntimeError(f"{path}: {ds.num_samples} samples read back, {expected} written")
    step = max(1, ds.num_samples // sample)
    for i in range(0, ds.num_samples, step):
        s = ds.get_item(i)
        size = Image.open(io.BytesIO(s["image"])).size
        if size != (resolution, resolution) or not s["caption"].strip():
            raise RuntimeError(f"{path}: sample {i} ({s['key']}) read back as {size}, "
                               f"caption {s['caption']!r}")  # fmt: skip


@task(name="write-shards", cache_policy=NO_CACHE)
def write_shards(
    root: str,
    ingest_id: str,
    resolutions: list[int],
    *,
    min_side_factor: float = 1.0,
    jpeg_quality: int = 90,
    image_format: str = "jpeg",
    size_limit: int = 1 << 26,
    workers: int = 0,
    partition_size: int = 2000,
    endpoint_url: str | None = None,
    dask_address: str | None = None,
) -> ShardResult:
    """Write (or reuse, or finish) the MDS datasets for every stage of `ingest_id`'s clean rows."""

    log = task_logger(__name__)
    layout = Layout(Path(root))
    clean = pd.read_parquet(layout.catalog(ingest_id) / "clean.parquet")
    settings = {
        "resolutions": sorted(resolutions),
        "min_side_factor": min_side_factor,
        "jpeg_quality": jpeg_quality,
        "image_format": image_format,
        "size_limit": size_limit,
        "partition_size": partition_size,
    }
    version = dataset_version(clean, settings)
    result = ShardResult(dataset_version=version, ingest_id=ingest_id)
    base = layout.shards(version)
    todo = [r for r in sorted(resolutions) if not (base / str(r) / "index.json").is_file()]
    clean = clean.assign(short_side=clean[["width", "height"]].min(axis=1))
    eligible = {r: clean[clean["short_side"] >= r * min_side_factor] for r in sorted(resolutions)}
    for r, rows in eligible.items():
        if rows.empty:
            raise ValueError(
                f"stage {r}px has no images: none of {len(clean)} clean images has a short side "
                f">= {r * min_side_factor:g}px (resolution x shards.min_side_factor "
                f"{min_side_factor})"
            )
    if not todo:
        result.reused = True
        log.info("dataset %s already exists for %s px: reusing it", version, sorted(resolutions))
    else:
        _convert(base, todo, eligible, clean, settings, workers, endpoint_url, dask_address)
    for r in sorted(resolutions):
        result.stages[r] = _stage_stats(base / str(r))
    (base / "shards.json").write_text(
        json.dumps({**result.to_dict(), "settings": settings}, indent=2)
    )
    layout.set_latest("shards", version)
    return result


def _convert(base, todo, eligible, clean, settings, workers, endpoint_url, dask_address):
    from contextlib import ExitStack

    log = task_logger(__name__)
    stage_keys = {r: set(zip(eligible[r]["source"], eligible[r]["key"], strict=True)) for r in todo}
    keys = sorted(set().union(*stage_keys.values()))
    meta_cols = [c for c in clean.columns if c not in CATALOG_COLUMNS
                 and c not in ("short_side", "near_duplicate_of")]  # fmt: skip
    rows = {}
    for rec in clean.to_dict("records"):
        uid = (rec["source"], rec["key"])
        meta = {c: getattr(rec[c], "item", lambda v=rec[c]: v)() for c in meta_cols
                if not _isnull(rec[c])}  # fmt: skip
        rows[uid] = {"caption": rec["caption"], "width": rec["width"], "height": rec["height"],
                     "meta": meta, "object": rec["object"], "offset": rec["offset"],
                     "length": rec["length"]}  # fmt: skip
    jobs = [
        (src, endpoint_url, key, rows[(src, key)]["object"], int(rows[(src, key)]["offset"]),
         int(rows[(src, key)]["length"]), [r for r in todo if (src, key) in stage_keys[r]],
         settings["jpeg_quality"], settings["image_format"])
        for src, key in keys
    ]  # fmt: skip
    size = settings["partition_size"]
    parts = [jobs[i : i + size] for i in range(0, len(jobs), size)]
    partial = base / ".partial"
    n_workers = workers or os.cpu_count() or 1
    log.info("sharding %d images into %s for %s px: %d partitions on %s", len(keys), base.name,
             todo, len(parts), "Dask" if dask_address else f"{n_workers} processes")  # fmt: skip
    with ExitStack() as stack:
        runner = stack.enter_context(partition_runner(n_workers, dask_address))
        pool = None
        if not dask_address:
            pool = stack.enter_context(
                ProcessPoolExecutor(n_workers, mp_context=mp.get_context("spawn"))
            )
        futures = []
        for i, p in enumerate(parts):
            part_rows = {(j[0], j[2]): rows[(j[0], j[2])] for j in p}
            futures.append(runner.submit(write_partition, {
                "partial": str(partial), "index": i, "jobs": p, "rows": part_rows,
                "size_limit": settings["size_limit"], "pool": pool}))  # fmt: skip
        errors, skipped = [], 0
        for f in futures:
            try:
                skipped += f.result()["skipped"]
            except Exception as e:  # noqa: BLE001 - finish the other partitions, then fail
                errors.append(str(e))
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(parts)} shard partitions failed (finished "
                           f"ones are kept for the next run): {errors[:3]}")  # fmt: skip
    if skipped:
        log.info("%d of %d partitions were already finished by an earlier run", skipped,
                 len(parts))  # fmt: skip
    for r in todo:
        stage_dir = partial / str(r)
        indexes = sorted(str(p / "index.json") for p in stage_dir.glob("part-*")
                         if (p / "index.json").is_file())  # fmt: skip
        merge_index(indexes, str(stage_dir), keep_local=True, download_timeout=60)
        _check_readback(stage_dir, r, len(stage_keys[r]))
        dest = base / str(r)
        shutil.rmtree(dest, ignore_errors=True)
        stage_dir.rename(dest)  # publish: the folder appears complete, index.json included
    shutil.rmtree(partial, ignore_errors=True)


def _isnull(v) -> bool:
    try:
        return bool(pd.isna(v))
    except (TypeError, ValueError):
        return False
