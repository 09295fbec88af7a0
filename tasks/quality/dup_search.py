"""The cross-catalog duplicate checks as partition tasks, on local threads or a Dask cluster.

The validate step's row checks write each partition's hashes (`check_partition` with a
`hash_path`); rows an earlier verdict already checked get theirs from `hash_rows`, from the
hash cache (data_quality/hash_cache.py) when it has them. Then
(data_quality/dup_partitions.py) each exact partition finds its sha256 copies and counts its
distinct pHashes, each hash file is split by table, and each near partition runs its
share of the multi-index hashing tables. Every task reads its own rows from the hash files
with a filter and returns only its hits, so the driver holds the hits and the list of files,
never the catalog's hashes. On Dask the root (and its hash folder) must be mounted at the
same path on every worker, as for the row checks.
"""

from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
from prefect import task
from prefect.cache_policies import NO_CACHE

from data_quality import hash_cache
from data_quality.dup_partitions import (
    Files,
    count_distinct,
    exact_duplicates,
    merge_hits,
    near_duplicates_in,
    near_tables,
    split_by_table,
    write_hash_file,
)
from data_quality.near_dup import phash_to_uint64
from data_quality.suite import CrossCheck, hash_columns
from tasks.catalog.view import ViewPart, read_part
from tasks.runtime.logs import task_logger
from tasks.runtime.runners import partition_runner

__all__ = [
    "DUP_PARTITION_ROWS",
    "dup_partitions_for",
    "hash_rows",
    "old_hash_batches",
    "partitioned_cross",
]

DUP_PARTITION_ROWS = 1 << 19  # rows per hash-prefix partition (about 130 MB of search)


def dup_partitions_for(rows: int, new_rows: int, partition_rows: int) -> int:
    """Hash-prefix partitions for a validate: 0 (the driver compares the new rows' hashes
    with the old rows', a row group at a time) when the new rows fit in one check partition,
    else one per `DUP_PARTITION_ROWS` rows of the catalog."""
    if new_rows <= partition_rows:
        return 0
    return max(2, -(-rows // DUP_PARTITION_ROWS))


@task(name="hash-rows", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def hash_rows(
    part: ViewPart, row_groups: list[int], path: str, parts: int, cache: str | None = None
) -> int:
    """Write the hashes of some row groups of one part (rows checked by an earlier verdict)
    to a hash file, from the hash `cache` when it has every group; return their count.
    Idempotent: a retry rewrites the file."""
    hashes = _cached(cache, part.path, row_groups) if cache else None
    if hashes is None:
        hashes = hash_columns(read_part(part, ["sha256", "phash"], row_groups))
        if cache:  # a file compaction wrote, say: the next validate finds its hashes
            _refill(cache, part.path, row_groups, hashes)
    return write_hash_file(path, hashes, parts)


def _refill(cache: str, path, row_groups: list[int], hashes: tuple) -> None:
    """Keep `hashes` (of `row_groups` of the data file `path`) in the hash cache; a failure
    only warns, as the row checks' own saving does."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    try:
        hash_cache.save(
            Path(cache), path, row_groups, [meta.row_group(g).num_rows for g in row_groups], hashes
        )
    except OSError as e:
        task_logger(__name__).warning("hash cache not written (%s): %s", cache, e)


def _cached(cache: str, path, row_groups: list[int]) -> tuple | None:
    """The cached hashes of `row_groups` of the data file `path`, or None unless all are."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    got = [hash_cache.load(Path(cache), path, g, meta.row_group(g).num_rows) for g in row_groups]
    if any(g is None for g in got):
        return None
    return tuple(
        np.concatenate([g[i] for g in got]) if got else np.zeros(0, np.uint64) for i in range(3)
    )


@task(name="exact-duplicates", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def exact_partition(files: Files, part: int, first: int) -> tuple[np.ndarray, np.ndarray, int]:
    """One exact partition's copies (positions, duplicate_of) and its distinct pHashes."""
    pos, of = exact_duplicates(files, part, first)
    return pos, of, count_distinct(files, part)


@task(name="split-by-table", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def split_files(files: Files, keys: list[int], parts: int) -> None:
    """Split hash files by table (`<file>.table<i>` beside each)."""
    for path, _ in files:
        split_by_table(path, [f"{path}.table{i}" for i in range(len(keys))], keys, parts)


@task(name="near-duplicates", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def near_partition(
    table_files: list[Files], part: int, d: int, design: tuple, first: int
) -> tuple[np.ndarray, np.ndarray]:
    """One near partition's hits (positions, near_duplicate_of)."""
    return near_duplicates_in(table_files, part, d, design, first)


def old_hash_batches(old: list[ViewPart], new: list[ViewPart], cache: str | None = None) -> list:
    """The old rows' hashes for the driver search, one reader per row group (a function that
    returns that group's (hi, lo, phash), so that the search's threads read in parallel):
    from the hash `cache` when it has the group; else, with a cache, every row's hashes,
    which are kept there for the next validate (a file compaction wrote is hashed once);
    without one, hashing only what the new rows can match.

    Without a cache entry, an old row's sha256 matters only when a new row has it: the
    others all get one label (sha_hi, sha_lo) that no new row has, which keeps every
    comparison the search makes ("the same sha256 as this new row?", and a near duplicate
    is never an exact one) and skips hashing the old sha256 strings. pHashes are parsed as
    they are. A cached group has every row's own hashes, which answer the same.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    shas = pd.concat([read_part(p, ["sha256"]) for p in new] or [pd.DataFrame({"sha256": []})])
    new_sha = pa.array(shas["sha256"].astype(str).tolist(), pa.string())
    mine = set(hash_columns(shas.assign(phash="0" * 16))[0].tolist())
    label = next(v for v in range(len(mine) + 1) if v not in mine)  # no new row's sha_hi
    out = []
    for p in old:
        meta = pq.ParquetFile(p.path).metadata if cache else None
        out += [
            partial(
                _old_group,
                p.path,
                g,
                new_sha,
                label,
                cache,
                meta.row_group(g).num_rows if meta else 0,
            )
            for g in range(p.row_groups)
        ]
    return out


def _old_group(path, group: int, new_sha, label: int, cache: str | None = None, rows: int = 0):
    """One row group's (hi, lo, phash) for `old_hash_batches`."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    got = hash_cache.load(Path(cache), path, group, rows) if cache else None
    if got is not None:
        return got
    t = pq.ParquetFile(path).read_row_group(group, columns=["sha256", "phash"])
    if cache:  # not cached (a file compaction wrote, say): hash every row once, and keep it
        got = hash_columns(t.to_pandas())
        _refill(cache, path, [group], got)
        return got
    sha = t.column("sha256").cast(pa.string())
    hit = pc.is_in(sha, value_set=new_sha).to_numpy(zero_copy_only=False)
    hi = np.full(len(t), label, np.uint64)
    lo = np.zeros(len(t), np.uint64)
    if hit.any():
        df = t.filter(pa.array(hit)).to_pandas()
        hi[hit], lo[hit], _ = hash_columns(df)
    return hi, lo, phash_to_uint64(t.column("phash").to_numpy(zero_copy_only=False))


def _map(fn, calls: list[dict], workers: int, dask_address: str | None) -> list:
    """`fn` over `calls`, results in order; at most `workers` in flight locally."""
    out, window = [], []
    with partition_runner(workers, dask_address) as runner:
        limit = len(calls) if dask_address else workers
        for args in calls:
            window.append(runner.submit(fn, args))
            if len(window) >= limit:
                out.append(window.pop(0).result())
        out.extend(f.result() for f in window)
    return out


def partitioned_cross(
    hash_dir: Path,
    new_files: list[tuple[str, int]],
    old: list[tuple[ViewPart, list[int]]],
    max_distance: int,
    parts: int,
    *,
    workers: int = 2,
    dask_address: str | None = None,
    cache: str | None = None,
) -> CrossCheck:
    """Exact and near duplicates of the new rows against the whole catalog, in partitions.

    Args:
        hash_dir: the folder of the new rows' hash files (the old rows' go there too); it
            is removed at the end.
        new_files: the new rows' hash files and their row counts, in priority order.
        old: (part, row groups) of the rows before them, in priority order.
        max_distance: `quality.near_duplicate_distance`.
        parts: hash-prefix partitions.
        workers: local partitions at once.
        dask_address: run the partitions on this Dask scheduler.
        cache: the hash cache (data_quality/hash_cache.py) the old rows' hashes are read
            from where it has them.

    Returns:
        A sparse CrossCheck: `positions` (catalog positions of new rows with a hit) and, for
        each, the position it duplicates exactly or nearly (-1 for neither).
    """
    log = task_logger(__name__)
    try:
        calls = [
            {
                "part": p,
                "row_groups": g,
                "path": str(hash_dir / f"old-{i:06d}.parquet"),
                "parts": parts,
                "cache": cache,
            }
            for i, (p, g) in enumerate(old)
        ]
        counts = _map(hash_rows, calls, workers, dask_address)
        files, start = [], 0
        for path, n in [(c["path"], k) for c, k in zip(calls, counts, strict=True)] + new_files:
            files.append((path, start))
            start += n
        first = sum(counts)
        exact = _map(
            exact_partition,
            [{"files": files, "part": k, "first": first} for k in range(parts)],
            workers,
            dask_address,
        )
        design = near_tables(max_distance, sum(e[2] for e in exact))
        groups = [files[i::parts] for i in range(min(parts, len(files)))]
        _map(
            split_files,
            [{"files": g, "keys": design[2], "parts": parts} for g in groups],
            workers,
            dask_address,
        )
        table_files = [[(f"{p}.table{i}", o) for p, o in files] for i in range(len(design[2]))]
        near = _map(
            near_partition,
            [
                {
                    "table_files": table_files,
                    "part": k,
                    "d": max_distance,
                    "design": design,
                    "first": first,
                }
                for k in range(parts)
            ],
            workers,
            dask_address,
        )
    finally:
        shutil.rmtree(hash_dir, ignore_errors=True)
    dup_pos, dup_of = merge_hits([e[0] for e in exact], [e[1] for e in exact])
    near_pos, near_of = merge_hits([x[0] for x in near], [x[1] for x in near])
    pos = np.union1d(dup_pos, near_pos)
    dup = np.full(len(pos), -1, np.int64)
    dup[np.searchsorted(pos, dup_pos)] = dup_of
    nd = np.full(len(pos), -1, np.int64)
    nd[np.searchsorted(pos, near_pos)] = near_of
    log.info(
        "duplicate search: %d rows in %d hash partitions (%d blocks, keys of %d, %d "
        "tables): %d exact, %d near",
        start,
        parts,
        design[0],
        design[1],
        len(design[2]),
        len(dup_pos),
        len(near_pos),
    )
    return CrossCheck(duplicate_of=dup, near_duplicate_of=nd, positions=pos)
