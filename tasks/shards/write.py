"""Shard: write one MDS dataset per training stage from the clean catalog, in partitions.

`<root>/shards/<dataset_version>/<resolution>/` holds the images whose short side is at least
`resolution * shards.min_side_factor`, resized (Lanczos) and centre-cropped to a square, as
JPEG bytes plus caption (and, given the model's tokenizer, the caption's token ids, so that
the loader does not tokenize). A stage with aspect-ratio buckets (`shards.aspect_buckets`)
instead holds one MDS dataset per bucket, `<resolution>/<width>x<height>/`, listed in
`<resolution>/buckets.json`: each image goes to the bucket nearest its aspect ratio and is
resized to cover it and centre-cropped, and it qualifies when that needs an upscale of at most
`1 / min_side_factor`. The dataset version hashes the clean catalog and the shard settings:
the same input gives the same version, and an existing version is reused. Each resolution is
written to a temporary folder and renamed into place only when complete, so a reader never
sees a partial dataset.

Conversion runs in partitions of `partition_size` images, as Prefect tasks (threads feeding
one process pool locally, or a Dask cluster). Each partition decodes an image once and writes
one MDS part per stage under `.partial/<resolution>/part-NNNNN/`; a part is finished when its
`index.json` exists, so a crashed conversion redoes only unfinished partitions. When every
partition is done, the parts of a stage are merged into one `index.json` with streaming's
`merge_index`, read back and checked, and the folder is renamed into place.

Held-out validation split: an image is held out when the sha256 of its key, read as a number
in [0, 1), is below `shards.val_fraction`; when more than `shards.val_max` are, the ones with
the smallest hashes are kept. The choice is made by key over the whole clean catalog, before
any stage's size filter, so the same images are held out at every stage (each stage's split
is the held-out images that stage accepts) and adding images never moves an old one between
the splits. A held-out image is in no training shard. Each stage's split is its own dataset,
`<resolution>-val/`, with the same columns, rendering and layout as the stage: a bucketed
stage's split is bucketed the same way (`<resolution>-val/<width>x<height>/` and its
`buckets.json`), so whatever reads a stage reads its split; a stage that accepts no held-out
image gets no folder. The split is written by the same partitions and published just before
its stage, so a published stage always has its split in place. Both settings are part of the
dataset version.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import multiprocessing as mp
import os
import re
import shutil
import threading
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
from prefect import task
from prefect.cache_policies import NO_CACHE

from data_quality.verdict import REJECTS_FILE, gate_for_sharding
from kiln_config import CATALOG_COLUMNS, TokenizerConfig
from kiln_config.errors import InputError, MissingInput
from tasks.catalog.clean import read_clean, scan_clean
from tasks.catalog.view import accepted_columns, view_versions
from tasks.ingest.render import aspect_buckets, nearest_buckets, render_for_stages
from tasks.runtime.logs import task_logger
from tasks.runtime.progress import Progress
from tasks.runtime.runners import partition_runner
from tasks.storage.layout import Layout, is_published

if TYPE_CHECKING:  # the schema's home; annotations only, nothing imported at run time
    from kiln_config import ShardsConfig

__all__ = [
    "MDS_COLUMNS",
    "ShardResult",
    "dataset_version",
    "held_out",
    "token_ids_column",
    "write_shards",
]


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


def token_ids_column(max_length: int) -> dict:
    """The column of stored token ids: int32 with its length in the encoding, so every sample
    has the same fixed-size field and no per-sample array header."""
    return {"input_ids": f"ndarray:int32:{max_length}"}


_TOKENIZER_LOCK = threading.Lock()


def _caption_tokenizer(spec: str):
    """The loader's tokenizer (`models.components.factory.caption_tokenizer`) for a TokenizerConfig
    as JSON; built once per process, whichever partition thread asks first."""
    with _TOKENIZER_LOCK:
        return _build_caption_tokenizer(spec)


@functools.lru_cache(maxsize=2)
def _build_caption_tokenizer(spec: str):
    # transformers and torch load here, in the process that tokenizes: the shard flow's own
    # process and the conversion workers of shards without token ids never need them.
    from models.components.factory import caption_tokenizer

    return caption_tokenizer(TokenizerConfig.model_validate_json(spec))


@dataclass
class ShardResult:
    dataset_version: str
    ingest_id: str
    # resolution -> samples, bytes, shards (training split), val_samples (held-out split)
    stages: dict[int, dict] = field(default_factory=dict)
    reused: bool = False
    quality_gate: dict = field(default_factory=dict)  # the catalog's verdict, and any override
    dry_run: bool = False  # planned only: `stages` has the counts, nothing was written
    # The catalog's Delta table versions it was cut from: time travel reads its rows back.
    catalog_versions: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _meta_columns(clean: pd.DataFrame) -> list[str]:
    """The catalog's pass-through metadata columns, stored in each sample's `meta`."""
    derived = ("short_side", "near_duplicate_of")  # added by validate and shard, not stored
    return [c for c in clean.columns if c not in CATALOG_COLUMNS and c not in derived]


def _row_meta(rec: dict, meta_cols: list[str]) -> dict:
    """A row's `meta` as stored: plain Python values, absent (null) values left out."""
    return {
        c: getattr(rec[c], "item", lambda v=rec[c]: v)() for c in meta_cols if not _isnull(rec[c])
    }


def dataset_version(clean: pd.DataFrame, settings: dict) -> str:
    """Content hash of the clean catalog (keys, bytes, captions, stored metadata) and the
    shard settings: anything a sample stores changes the version. Rows are hashed by columns
    and combined by addition (`rows_digest`), so the catalog needs no sort and partitions of
    it combine."""
    return _version(settings, rows_digest(clean))


def _version(settings: dict, digest: np.ndarray) -> str:
    h = hashlib.sha256(json.dumps({**settings, "format": FORMAT_VERSION}, sort_keys=True).encode())
    h.update(digest.astype(np.uint64).tobytes())
    return "ds-" + h.hexdigest()[:12]


def rows_digest(frame: pd.DataFrame) -> np.ndarray:
    """Two 64-bit sums, over rows, of two keyed hashes of each row's source, key, sha256,
    caption and stored metadata: independent of row order, and additive over partitions."""
    cols = ["source", "key", "sha256", "caption", *_meta_columns(frame)]
    text = pd.DataFrame(
        {c: frame[c].astype(object).where(frame[c].notna(), "").astype(str) for c in cols}
    )
    return np.array(
        [
            pd.util.hash_pandas_object(text, index=False, hash_key=k)
            .to_numpy(np.uint64)
            .sum(dtype=np.uint64)
            for k in ("kiln-dataset-v-0", "kiln-dataset-v-1")
        ],
        dtype=np.uint64,
    )


def key_units(keys) -> np.ndarray:
    """Each key's place in [0, 1): the top 53 bits of its sha256, exact as a float."""
    digests = b"".join(hashlib.sha256(str(k).encode()).digest()[:8] for k in keys)
    return (np.frombuffer(digests, ">u8") >> np.uint64(11)) / 2**53


def _key_unit(key: str) -> float:
    return float(key_units([key])[0])


def held_out_mask(sources, keys, fraction: float, cap: int) -> np.ndarray:
    """Which rows are in the validation split: those whose key hashes below `fraction`, at
    most `cap` of them, the smallest hashes first (ties by key, then source).

    Hashing the key alone (not the bytes or the caption) keeps an image on its side of the
    split when its caption is fixed or its source moves.
    """
    keys = np.asarray(keys, dtype=object)
    out = np.zeros(len(keys), bool)
    if fraction <= 0 or cap <= 0 or not len(keys):
        return out
    u = key_units(keys)
    cand = np.flatnonzero(u < fraction)
    src = np.asarray(sources, dtype=object)[cand]
    order = np.lexsort((src.astype(str), keys[cand].astype(str), u[cand]))[:cap]
    out[cand[order]] = True
    return out


def held_out(uids, fraction: float, cap: int) -> set[tuple[str, str]]:
    """The (source, key) pairs of the validation split (see `held_out_mask`)."""
    uids = list(uids)
    if not uids:
        return set()
    src, key = (np.array(c, dtype=object) for c in zip(*uids, strict=True))
    mask = held_out_mask(src, key, fraction, cap)
    return set(zip(src[mask], key[mask], strict=True))


def _split_stats(path: Path) -> dict:
    return _stage_stats(path) if is_published(path) else {"samples": 0}


def _stage_stats(path: Path) -> dict:
    if (path / "buckets.json").is_file():
        buckets = json.loads((path / "buckets.json").read_text())["buckets"]
        parts = [(b, _stage_stats(path / b["name"])) for b in buckets]
        return {
            "samples": sum(st["samples"] for _, st in parts),
            "shards": sum(st["shards"] for _, st in parts),
            "bytes": sum(st["bytes"] for _, st in parts),
            "buckets": {b["name"]: st["samples"] for b, st in parts},
        }
    index = json.loads((path / "index.json").read_text())
    shards = index["shards"]
    return {
        "samples": sum(s["samples"] for s in shards),
        "shards": len(shards),
        "bytes": sum(s["raw_data"]["bytes"] for s in shards),
    }


# streaming's notices on every part it writes and every index it merges: routine, nothing a
# user acts on, and they filled a run's log. Only these two are dropped; its other records pass.
_STREAMING_NOTICES = re.compile(
    r"Directory .* exists and not empty\. But continue to mkdir"
    r"|A temporary folder .* is created to store index files"
)


class _DropStreamingNotices(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _STREAMING_NOTICES.match(record.getMessage())


@contextmanager
def _quiet_streaming() -> Iterator[None]:
    """Drop `_STREAMING_NOTICES` while streaming writes or merges. A logger's filter sees only
    its own records, so it goes on streaming's uploader logger and on the root logger, which
    `merge_index` logs its temporary folder to (`logging.warning`)."""
    loggers = [logging.getLogger("streaming.base.storage.upload"), logging.getLogger()]
    drop = _DropStreamingNotices()
    for lg in loggers:
        lg.addFilter(drop)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(drop)


def _stage_of(target) -> int:
    return target if isinstance(target, int) else int(target[0])


def _write_part(
    out: Path,
    uids: list,
    rendered: dict,
    rows: dict,
    r: int,
    size_limit: int,
    tokenizer: str | None = None,
):
    shutil.rmtree(out, ignore_errors=True)  # a part left half-written by a crash
    columns, ids = dict(MDS_COLUMNS), None
    if tokenizer is not None and uids:
        tokenize = _caption_tokenizer(tokenizer)
        columns.update(token_ids_column(tokenize.max_length))
        ids = tokenize([rows[u]["caption"] for u in uids]).numpy().astype(np.int32)
    from streaming import MDSWriter  # here, not at import: `import streaming` takes seconds

    with _quiet_streaming(), MDSWriter(out=str(out), columns=columns, size_limit=size_limit) as w:
        for i, uid in enumerate(uids):
            img, top, left = rendered[uid][r]
            row = rows[uid]
            sample = {
                "image": img,
                "caption": row["caption"],
                "key": uid[1],
                "orig_width": int(row["width"]),
                "orig_height": int(row["height"]),
                "crop_top": top,
                "crop_left": left,
                "meta": row["meta"],
            }
            if ids is not None:
                sample["input_ids"] = ids[i]
            w.write(sample)


@task(name="shard-partition", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def write_partition(
    partial: str,
    index: int,
    jobs: list[tuple],
    rows: dict,
    size_limit: int,
    pool=None,
    tokenizer: str | None = None,
    held: list[tuple] | None = None,
) -> dict:
    """Render one partition's images and write one MDS part per stage; skip finished parts.

    With `tokenizer` (a TokenizerConfig as JSON), each part also stores the captions' ids.
    The images in `held` ((source, key) pairs) go to each stage's validation split instead,
    `<resolution>-val/`; that part is written before the stage's, whose marker covers both.

    A job's targets are stage resolutions (square stages) or (resolution, width, height) for
    a bucketed stage, whose part is one MDS part per bucket plus a `part-NNNNN.done` marker.
    """
    base = Path(partial)
    stages = sorted({_stage_of(t) for job in jobs for t in job[6]})
    bucketed = {int(t[0]) for job in jobs for t in job[6] if not isinstance(t, int)}
    name = f"part-{index:05d}"
    done = {
        r: base / str(r) / (f"{name}.done" if r in bucketed else f"{name}/index.json")
        for r in stages
    }
    todo = [r for r in stages if not done[r].is_file()]
    if not todo:
        return {"index": index, "skipped": True}
    jobs = [(*j[:6], [t for t in j[6] if _stage_of(t) in todo], *j[7:]) for j in jobs]
    jobs = [j for j in jobs if j[6]]
    bucket_of = {
        ((j[0], j[2]), int(t[0])): (int(t[1]), int(t[2]))
        for j in jobs
        for t in j[6]
        if not isinstance(t, int)
    }
    done_map = (
        pool.map(render_for_stages, jobs, chunksize=8) if pool else map(render_for_stages, jobs)
    )
    rendered = {}
    for job, d in zip(jobs, done_map, strict=True):
        if "error" in d:
            # Ingest decoded these already: a failure means the source changed under us.
            raise RuntimeError(
                f"{job[0]}/{d['key']}: failed to re-read during sharding: {d['error']}"
            )
        rendered[(job[0], d["key"])] = d["images"]
    held = {tuple(u) for u in held or []}
    for r in todo:
        uids = sorted(u for u in rendered if r in rendered[u])
        val = [u for u in uids if u in held]
        train = [u for u in uids if u not in held]

        def write(folder: Path, members: list, r: int = r) -> dict:
            buckets = {u: bucket_of[(u, r)] for u in members} if r in bucketed else None
            return _write_split(
                folder, members, buckets, name, rendered, rows, r, size_limit, tokenizer
            )

        if val:  # first: the stage's own part (or marker) below marks both as done
            write(base / f"{r}-val", val)
        # A square stage's part is written even when empty: its index.json is the marker.
        groups = write(base / str(r), train)
        if r in bucketed:
            done[r].parent.mkdir(parents=True, exist_ok=True)
            done[r].write_text(json.dumps(groups))
    return {"index": index, "skipped": False}


def _write_split(
    folder: Path,
    uids: list,
    buckets: dict | None,
    name: str,
    rendered: dict,
    rows: dict,
    r: int,
    size_limit: int,
    tokenizer: str | None,
) -> dict:
    """Write one partition's part of a split (a stage or its validation split): one MDS part,
    or one per aspect bucket when `buckets` maps each uid to its (width, height).

    Returns the samples per bucket name ({} for a square split)."""
    if buckets is None:
        _write_part(folder / name, uids, rendered, rows, r, size_limit, tokenizer)
        return {}
    for stale in folder.glob(f"*/{name}"):  # buckets of a crashed attempt
        shutil.rmtree(stale)
    groups: dict[tuple, list] = {}
    for uid in uids:
        groups.setdefault(buckets[uid], []).append(uid)
    for (bw, bh), members in sorted(groups.items()):
        _write_part(folder / f"{bw}x{bh}" / name, members, rendered, rows, r, size_limit, tokenizer)
    return {f"{w}x{h}": len(v) for (w, h), v in groups.items()}


def _check_readback(
    path: Path, size: tuple[int, int], expected: int, ids_len: int | None = None, sample: int = 32
) -> None:
    """Open the merged index with streaming's shard readers (what StreamingDataset reads a
    local dataset with) and check count, decode, size and caption of a spread of samples,
    and their token ids when `ids_len` is given.

    Not a StreamingDataset itself: each one a process opens keeps shared-memory handles until
    the process exits (streaming registers them with atexit), and the flow process is long-lived.
    """
    import io

    from PIL import Image
    from streaming.base.format import reader_from_json

    index = json.loads((path / "index.json").read_text())
    shards = [reader_from_json(str(path), None, s) for s in index["shards"]]
    lookup = [(sh, j) for sh in shards for j in range(sh.samples)]
    if len(lookup) != expected:
        raise RuntimeError(f"{path}: {len(lookup)} samples read back, {expected} written")
    step = max(1, len(lookup) // sample)
    for i in range(0, len(lookup), step):
        sh, j = lookup[i]
        s = sh.get_item(j)
        got = Image.open(io.BytesIO(s["image"])).size
        if got != tuple(size) or not s["caption"].strip():
            raise RuntimeError(
                f"{path}: sample {i} ({s['key']}) read back as {got}, expected "
                f"{size}, caption {s['caption']!r}"
            )
        ids = s.get("input_ids")
        shape = None if ids is None else ids.shape
        if ids_len is not None and shape != (ids_len,):
            raise RuntimeError(
                f"{path}: sample {i} ({s['key']}) has token ids of shape "
                f"{shape}, expected ({ids_len},)"
            )


@task(name="write-shards", cache_policy=NO_CACHE)
def write_shards(
    cfg: ShardsConfig,
    root: str,
    ingest_id: str,
    resolutions: list[int],
    *,
    endpoint_url: str | None = None,
    dask_address: str | None = None,
    bucket_stages: list[int] | None = None,
    tokenizer: dict | None = None,
    allow_failed_gate: bool = False,
    dry_run: bool = False,
) -> ShardResult:
    """Write (or reuse, or finish) the MDS datasets for every stage of `ingest_id`'s clean rows.

    The catalog must have passed the quality gate (its `verdict.json`); `allow_failed_gate`
    shards a failed or unvalidated one anyway, and `shards.json` records the override.

    Each stage also gets its held-out validation split, `<resolution>-val/` (see the module
    docstring), whose size is `stages[r]["val_samples"]` (0: no folder).

    Args:
        cfg: The `shards` config section (encoding, size limits, partitions, bucket shape,
            validation split).
        root: The storage root.
        ingest_id: The validated catalog to shard.
        resolutions: The stage resolutions, one dataset each.
        endpoint_url: S3-compatible endpoint for an s3:// source.
        dask_address: Run the conversion partitions on this Dask scheduler.
        bucket_stages: Stage resolutions written as aspect-ratio buckets
            (`tasks.ingest.render.aspect_buckets(resolution, cfg.bucket_step,
            cfg.bucket_max_aspect)`) instead of squares.
        tokenizer: The model's `TokenizerConfig` as a dict: every sample also stores its
            caption's token ids (`shards.token_ids`); the tokenizer is part of the version.
        allow_failed_gate: Shard a catalog whose verdict failed or is missing.
        dry_run: Plan only: the version and each stage's training and held-out image
            counts, from the catalog's columns; nothing is decoded or written.

    Raises:
        FileNotFoundError: the catalog has not been validated.
        QualityGateError: its verdict failed or is missing, without `allow_failed_gate`.
        ValueError: a stage has no training images (none qualify, or all are held out).
    """

    log = task_logger(__name__)
    layout = Layout(Path(root))
    rejects = layout.catalog(ingest_id) / REJECTS_FILE
    if not rejects.is_file():
        raise MissingInput(
            f"catalog {ingest_id} has not been validated ({rejects} missing): "
            "run `kiln validate` first"
        )
    gate = gate_for_sharding(
        layout.catalog(ingest_id), ingest_id, allow_failed_gate=allow_failed_gate, logger=log
    )
    settings, buckets = _version_settings(cfg, resolutions, bucket_stages, tokenizer)
    if dry_run:
        result = _plan(root, ingest_id, layout, settings, buckets, cfg)
        result.quality_gate = gate
        log.info(
            "dataset %s for %s px (dry run): %s",
            result.dataset_version,
            sorted(resolutions),
            result.stages,
        )
        return result
    clean = read_clean(root, ingest_id)
    version = dataset_version(clean, settings)
    result = ShardResult(
        dataset_version=version,
        ingest_id=ingest_id,
        quality_gate=gate,
        catalog_versions=view_versions(layout, ingest_id),
    )
    base = layout.shards(version)
    todo = [r for r in sorted(resolutions) if not is_published(base / str(r))]
    eligible, val = _split_stages(clean, resolutions, buckets, cfg)
    if not todo:
        result.reused = True
        log.info("dataset %s already exists for %s px: reusing it", version, sorted(resolutions))
    else:
        _convert(
            base, todo, eligible, val, clean, settings, cfg.workers, endpoint_url, dask_address
        )
    for r in sorted(resolutions):
        result.stages[r] = _stage_stats(base / str(r))
        result.stages[r]["val_samples"] = _split_stats(layout.val_shards(version, r))["samples"]
    (base / "shards.json").write_text(
        json.dumps({**result.to_dict(), "settings": settings}, indent=2)
    )
    layout.set_latest("shards", version)
    return result


def _version_settings(
    cfg: ShardsConfig,
    resolutions: list[int],
    bucket_stages: list[int] | None,
    tokenizer: dict | None,
) -> tuple[dict, dict[int, list]]:
    """(the settings that, with the clean rows, make the dataset version; each bucketed
    stage's aspect buckets)."""
    settings = {
        "resolutions": sorted(resolutions),
        "min_side_factor": cfg.min_side_factor,
        "jpeg_quality": cfg.jpeg_quality,
        "image_format": cfg.image_format,
        "size_limit": cfg.size_limit,
        "partition_size": cfg.partition_size,
    }
    unknown = sorted(set(bucket_stages or []) - set(resolutions))
    if unknown:
        raise InputError(f"bucket stages {unknown} are not stage resolutions {sorted(resolutions)}")
    buckets = {
        r: aspect_buckets(r, cfg.bucket_step, cfg.bucket_max_aspect) for r in bucket_stages or []
    }
    if buckets:  # only then: versions written without buckets keep their hash
        settings["buckets"] = {str(r): b for r, b in sorted(buckets.items())}
    if tokenizer is not None:
        settings["tokenizer"] = tokenizer
    if cfg.val_fraction > 0 and cfg.val_max > 0:  # only then: versions without a split keep
        settings["val"] = {"fraction": cfg.val_fraction, "max": cfg.val_max}  # their hash
    return settings, buckets


def _split_stages(
    clean: pd.DataFrame, resolutions: list[int], buckets: dict[int, list], cfg: ShardsConfig
) -> tuple[dict[int, pd.DataFrame], dict[int, pd.DataFrame]]:
    """(each stage's training rows, each stage's held-out rows): the clean rows that qualify
    for the stage (with their aspect bucket when it is bucketed), split by the held-out mask,
    which is the same for every stage."""
    eligible, val = {}, {}
    held = pd.Series(
        held_out_mask(clean["source"], clean["key"], cfg.val_fraction, cfg.val_max),
        index=clean.index,
    )
    for r in sorted(resolutions):
        ok, target = _eligible(clean, r, buckets.get(r), cfg.min_side_factor)
        rows = clean[ok] if target is None else clean.assign(bucket=target)[ok]
        _check_stage(r, int(ok.sum()), len(clean), r in buckets, cfg.min_side_factor)
        is_val = held.loc[rows.index].to_numpy()
        val[r], eligible[r] = rows[is_val], rows[~is_val]
    for r in sorted(resolutions):
        _check_split(r, len(eligible[r]), len(val[r]), cfg)
    return eligible, val


def _eligible(frame: pd.DataFrame, r: int, buckets: list | None, factor: float):
    """(which rows qualify for stage `r`, their aspect bucket or None when not bucketed)."""
    w, h = frame["width"].to_numpy(), frame["height"].to_numpy()
    if buckets is None:
        return np.minimum(w, h) >= r * factor, None
    target = nearest_buckets(frame["width"], frame["height"], buckets)
    bw, bh = (np.array([b[i] for b in target], float).reshape(-1) for i in (0, 1))
    return np.maximum(bw / w, bh / h) <= 1 / factor + 1e-9, target


def _check_stage(r: int, n: int, total: int, bucketed: bool, factor: float) -> None:
    if not n:
        need = (
            f"covers its aspect bucket of {r}px with an upscale <= {1 / factor:g}"
            if bucketed
            else f"has a short side >= {r * factor:g}px"
        )
        raise InputError(
            f"stage {r}px has no images: none of {total} clean images {need} "
            f"(resolution and shards.min_side_factor {factor})"
        )


def _check_split(r: int, train: int, val: int, cfg: ShardsConfig) -> None:
    if not train:
        raise InputError(
            f"stage {r}px has no training images: all {val} of its images are held out for "
            f"validation (lower shards.val_fraction {cfg.val_fraction} or shards.val_max "
            f"{cfg.val_max})"
        )


def _plan(
    root: str, ingest_id: str, layout: Layout, settings: dict, buckets: dict, cfg: ShardsConfig
) -> ShardResult:
    """The dataset version and each stage's counts, a row group of the clean rows at a time:
    memory holds a row group and the `val_max` held-out candidates that come first so far
    (`held_out_mask`'s order), never every key hashing below `val_fraction`."""
    digest, total = np.zeros(2, np.uint64), 0
    stages = settings["resolutions"]
    eligible = dict.fromkeys(stages, 0)
    candidates = pd.DataFrame()
    for batch in scan_clean(root, ingest_id, _plan_columns(layout, ingest_id)):
        digest += rows_digest(batch)
        total += len(batch)
        ok = {r: _eligible(batch, r, buckets.get(r), cfg.min_side_factor)[0] for r in stages}
        for r in stages:
            eligible[r] += int(ok[r].sum())
        if cfg.val_fraction > 0 and cfg.val_max > 0:
            u = key_units(batch["key"])
            near = u < cfg.val_fraction
            got = pd.DataFrame(
                {
                    "u": u[near],
                    "source": batch["source"].to_numpy(object)[near],
                    "key": batch["key"].to_numpy(object)[near],
                    **{str(r): ok[r][near] for r in stages},
                }
            )
            both = pd.concat([candidates, got], ignore_index=True) if len(candidates) else got
            order = np.lexsort(
                (
                    both["source"].astype(str).to_numpy(),
                    both["key"].astype(str).to_numpy(),
                    both["u"].to_numpy(),
                )
            )
            candidates = both.iloc[order[: cfg.val_max]].reset_index(drop=True)
    for r in stages:
        _check_stage(r, eligible[r], total, r in buckets, cfg.min_side_factor)
    result = ShardResult(
        dataset_version=_version(settings, digest), ingest_id=ingest_id, dry_run=True
    )
    # The kept candidates are the validation split: at most `val_max`, in its order.
    for r in stages:
        val = int(candidates[str(r)].sum()) if len(candidates) else 0
        _check_split(r, eligible[r] - val, val, cfg)
        result.stages[r] = {"samples": eligible[r] - val, "val_samples": val}
    return result


def _plan_columns(layout: Layout, ingest_id: str) -> list[str]:
    """The columns a shard plan reads: identity, size, caption and stored metadata."""
    columns = accepted_columns(layout, ingest_id)
    own = ["source", "key", "sha256", "caption", "width", "height"]
    return own + [c for c in columns if c not in CATALOG_COLUMNS and c != "near_duplicate_of"]


def _uids(frame: pd.DataFrame) -> list[tuple[str, str]]:
    return list(zip(frame["source"], frame["key"], strict=True))


def _convert(base, todo, eligible, val, clean, settings, workers, endpoint_url, dask_address):
    """Render and write the `todo` stages' training (`eligible`) and validation (`val`)
    images in partitions, then publish each stage's split and then the stage."""
    train_keys = {r: set(_uids(eligible[r])) for r in todo}
    val_keys = {r: set(_uids(val[r])) for r in todo}
    bucket_of = {
        r: dict(zip(_uids(frame), frame["bucket"], strict=True))
        for r in todo
        if "bucket" in eligible[r]
        for frame in [pd.concat([eligible[r], val[r]])]
    }
    rows, jobs = _render_jobs(clean, todo, train_keys, val_keys, bucket_of, settings, endpoint_url)
    partial = base / ".partial"
    held = set().union(*val_keys.values())
    _write_partitions(base, partial, rows, jobs, held, settings, todo, workers, dask_address)
    spec = _spec(settings.get("tokenizer"))
    ids_len = _caption_tokenizer(spec).max_length if spec else None
    for r in todo:
        for name, split in ((f"{r}-val", val_keys[r]), (str(r), train_keys[r])):
            # The split first: a published stage always has its split (a crash in between
            # leaves the stage to do again, and its split already in place).
            if split and not is_published(base / name):
                buckets = (
                    {u: b for u, b in bucket_of[r].items() if u in split}
                    if r in bucket_of
                    else None
                )
                _publish_stage(base, partial / name, r, buckets, len(split), ids_len, name)
    shutil.rmtree(partial, ignore_errors=True)


def _render_jobs(clean, todo, train_keys, val_keys, bucket_of, settings, endpoint_url):
    """(each image's row by (source, key), one render job per image that a `todo` stage
    takes, in key order): where to read it, and each stage's target (a side, or a side and
    its aspect bucket) it is rendered to."""
    stage_keys = {r: train_keys[r] | val_keys[r] for r in todo}
    keys = sorted(set().union(*stage_keys.values()))
    meta_cols = _meta_columns(clean)
    rows = {}
    for rec in clean.to_dict("records"):
        rows[(rec["source"], rec["key"])] = {
            "caption": rec["caption"],
            "width": rec["width"],
            "height": rec["height"],
            "meta": _row_meta(rec, meta_cols),
            "object": rec["object"],
            "offset": rec["offset"],
            "length": rec["length"],
        }

    def target(r: int, uid: tuple):
        return (r, *bucket_of[r][uid]) if r in bucket_of else r

    jobs = [
        (
            src,
            endpoint_url,
            key,
            rows[(src, key)]["object"],
            int(rows[(src, key)]["offset"]),
            int(rows[(src, key)]["length"]),
            [target(r, (src, key)) for r in todo if (src, key) in stage_keys[r]],
            settings["jpeg_quality"],
            settings["image_format"],
        )
        for src, key in keys
    ]
    return rows, jobs


def _write_partitions(base, partial, rows, jobs, held, settings, todo, workers, dask_address):
    """`write_partition` for each `partition_size` run of `jobs` into `partial`, in spawned
    processes or on Dask; a partition an earlier run finished is kept. Every partition runs
    before a failure is raised."""
    log = task_logger(__name__)
    size = settings["partition_size"]
    parts = [jobs[i : i + size] for i in range(0, len(jobs), size)]
    n_workers = workers or os.cpu_count() or 1
    log.info(
        "sharding %d images into %s for %s px: %d partitions on %s",
        len(jobs),
        base.name,
        todo,
        len(parts),
        "Dask" if dask_address else f"{n_workers} processes",
    )
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
            futures.append(
                runner.submit(
                    write_partition,
                    {
                        "partial": str(partial),
                        "index": i,
                        "jobs": p,
                        "rows": part_rows,
                        "size_limit": settings["size_limit"],
                        "pool": pool,
                        "tokenizer": _spec(settings.get("tokenizer")),
                        "held": sorted(u for u in part_rows if u in held),
                    },
                )
            )
        errors, skipped = [], 0
        progress = Progress("shard", len(jobs), "images")
        for f, p in zip(futures, parts, strict=True):
            try:
                skipped += f.result()["skipped"]
            except Exception as e:  # noqa: BLE001 - finish the other partitions, then fail
                errors.append(str(e))
            progress.advance(len(p))
        progress.finish()
    if errors:
        raise RuntimeError(
            f"{len(errors)} of {len(parts)} shard partitions failed (finished "
            f"ones are kept for the next run): {errors[:3]}"
        )
    if skipped:
        log.info("%d of %d partitions were already finished by an earlier run", skipped, len(parts))


def _spec(tokenizer: dict | None) -> str | None:
    return None if tokenizer is None else json.dumps(tokenizer, sort_keys=True)


def _publish_stage(
    base: Path,
    stage_dir: Path,
    r: int,
    buckets: dict | None,
    expected: int,
    ids_len: int | None,
    name: str,
):
    """Merge a stage's (or its split's) parts, per bucket, check them read back, and rename
    the folder into place as `base / name`."""
    if buckets is None:
        _merge_and_check(stage_dir, (r, r), expected, ids_len)
    else:
        counts: dict[tuple, int] = {}
        for b in buckets.values():
            counts[tuple(b)] = counts.get(tuple(b), 0) + 1
        listed = []
        for (bw, bh), n in sorted(counts.items(), key=lambda kv: kv[0][0] / kv[0][1]):
            _merge_and_check(stage_dir / f"{bw}x{bh}", (bw, bh), n, ids_len)
            listed.append({"name": f"{bw}x{bh}", "width": bw, "height": bh, "samples": n})
        for marker in stage_dir.glob("part-*.done"):
            marker.unlink()
        (stage_dir / "buckets.json").write_text(  # last: it marks the stage complete
            json.dumps({"resolution": r, "buckets": listed}, indent=2)
        )
    dest = base / name
    shutil.rmtree(dest, ignore_errors=True)
    stage_dir.rename(dest)  # publish: the folder appears complete, its index included


def _merge_and_check(
    folder: Path, size: tuple[int, int], expected: int, ids_len: int | None
) -> None:
    """Merge a folder's finished parts into one index.json, then read it back and check it."""
    indexes = sorted(
        str(p / "index.json") for p in folder.glob("part-*") if (p / "index.json").is_file()
    )
    from streaming.base.util import merge_index

    with _quiet_streaming():
        merge_index(indexes, str(folder), keep_local=True, download_timeout=60)
    _check_readback(folder, size, expected, ids_len)


def _isnull(v) -> bool:
    try:
        return bool(pd.isna(v))
    except (TypeError, ValueError):
        return False
