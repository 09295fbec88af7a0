"""Shard: write one MDS dataset per training stage from the clean catalog.

`<root>/shards/<dataset_version>/<resolution>/` holds the images whose short side is at least
`resolution * shards.min_side_factor`, resized (Lanczos) and centre-cropped to a square, as
JPEG bytes plus caption. The dataset version hashes the clean catalog and the shard settings:
the same input gives the same version, and an existing version is reused. Each resolution is
written to a temporary folder and renamed into place only when complete, so a reader never
sees a partial dataset.
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

from tasks.decode import render_for_stages
from tasks.layout import Layout
from tasks.logs import task_logger

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
}
FORMAT_VERSION = 2


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


@task(name="write-shards", cache_policy=NO_CACHE)
def write_shards(
    root: str,
    ingest_id: str,
    resolutions: list[int],
    *,
    min_side_factor: float = 1.0,
    jpeg_quality: int = 90,
    size_limit: int = 1 << 26,
    workers: int = 0,
    endpoint_url: str | None = None,
) -> ShardResult:
    """Write (or reuse) the MDS datasets for every stage resolution of `ingest_id`'s clean rows."""
    layout = Layout(Path(root))
    clean = pd.read_parquet(layout.catalog(ingest_id) / "clean.parquet")
    settings = {
        "resolutions": sorted(resolutions),
        "min_side_factor": min_side_factor,
        "jpeg_quality": jpeg_quality,
        "size_limit": size_limit,
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

    if todo:
        stage_keys = {
            r: set(zip(eligible[r]["source"], eligible[r]["key"], strict=True)) for r in todo
        }
        keys = sorted(set().union(*stage_keys.values()))
        by_uid = {(row.source, row.key): row for row in clean.itertuples(index=False)}
        jobs = []
        for src, key in keys:
            row = by_uid[(src, key)]
            stages = [r for r in todo if (src, key) in stage_keys[r]]
            jobs.append(
                (src, endpoint_url, key, row.object, int(row.offset), int(row.length), stages,
                 jpeg_quality)
            )  # fmt: skip
        n_workers = workers or os.cpu_count() or 1
        task_logger(__name__).info(
            "sharding %d images into %s for %s px with %d processes",
            len(keys),
            version,
            todo,
            n_workers,
        )
        with ProcessPoolExecutor(n_workers, mp_context=mp.get_context("spawn")) as pool:
            done = pool.map(render_for_stages, jobs, chunksize=max(1, len(jobs) // (n_workers * 8)))
            rendered = {(job[0], d["key"]): d for job, d in zip(jobs, done, strict=True)}
        failed = {k: d["error"] for k, d in rendered.items() if "error" in d}
        if failed:
            # Ingest decoded these already, so a failure here means the source changed under us.
            raise RuntimeError(
                f"{len(failed)} images failed to re-read during sharding: "
                f"{dict(list(failed.items())[:5])}"
            )
        for r in todo:
            tmp = base / f".{r}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            with MDSWriter(out=str(tmp), columns=MDS_COLUMNS, size_limit=size_limit) as writer:
                for uid in sorted(stage_keys[r]):
                    jpeg, top, left = rendered[uid]["images"][r]
                    row, key = by_uid[uid], uid[1]
                    writer.write(
                        {
                            "image": jpeg,
                            "caption": row.caption,
                            "key": key,
                            "orig_width": int(row.width),
                            "orig_height": int(row.height),
                            "crop_top": top,
                            "crop_left": left,
                        }
                    )
            dest = base / str(r)
            shutil.rmtree(dest, ignore_errors=True)
            tmp.rename(dest)  # publish: the folder appears complete, index.json included
    else:
        result.reused = True
        task_logger(__name__).info(
            "dataset %s already exists for %s px: reusing it", version, sorted(resolutions)
        )
    for r in sorted(resolutions):
        result.stages[r] = _stage_stats(base / str(r))
    (base / "shards.json").write_text(
        json.dumps({**result.to_dict(), "settings": settings}, indent=2)
    )
    layout.set_latest("shards", version)
    return result
