"""Exact and near-duplicate search over a whole catalog, one hash-prefix partition at a time.

The search of `data_quality/suite.py` (`cross_catalog`) holds every row's hashes at once. Here
the same answers come from partitions that each hold a share of the rows, so that a process
(the driver, or a Dask worker) needs memory for one partition, whatever the catalog's size:

1. Hash files. Each partition of the catalog's rows writes its hashes (sha256 as two 64-bit
   halves, pHash as uint64) to a Parquet file, sorted by the exact partition (a prefix of the
   sha256 hash), one row group per partition, so that a filtered read skips the others.
2. Exact duplicates. Equal sha256 values share their prefix, so each exact partition finds
   the first row of each sha256 on its own. The same pass counts the distinct pHashes of a
   partition by pHash, whose sum picks the multi-index hashing design (`near_tables`) that
   `near_dup.near_duplicates` would pick for the whole catalog.
3. Table files. Every table of that design keys its buckets on some of the pHash's bits, so
   the rows of one bucket share their key. Each hash file is split again, once per table, by
   the same 32-bit hash of the key that the table sorts by (so a partition holds whole
   buckets). Splitting by table, not by a block that several tables share, keeps a skewed
   block (a fifth of the rows with one 16-bit value, say) from filling one partition: a key
   spans more bits, and only rows with the same whole key (one bucket) must meet.
4. Near duplicates. A partition (table, prefix) runs that table over its rows: the buckets,
   their re-indexing and their hot-row caps are those of the whole search, so each row's
   answer there is the one `near_duplicates` folds from that table. A row's answer is the
   smallest over its partitions (`merge_hits`).

A row's position is its place in the catalog's priority order (`offset` of its file plus its
index in the file). Only rows at `first` or later are targets, so an incremental validate asks
about its new rows only, while every row is a candidate. Results are sparse (position, the
position it duplicates), so the driver holds the hits, not the catalog.

The answers equal `cross_catalog`'s over the same rows in priority order, hot buckets
included: the tables, buckets and priority order are the same. One difference cannot
change an answer outside hot buckets: a 32-bit key hash that collides only merges buckets
within a partition, never across two, and a merged bucket only adds pairs that are then
checked by distance.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from data_quality.near_dup import (
    HOT_BUCKET_CAP,
    _choose_blocks,
    _hash32,
    _near_within,
    _table_masks,
)

__all__ = [
    "count_distinct",
    "exact_duplicates",
    "merge_hits",
    "near_duplicates_in",
    "near_tables",
    "split_by_table",
    "write_hash_file",
]

_ALL_BITS = np.uint64(0xFFFFFFFFFFFFFFFF)
Files = list[tuple[str, int]]  # (hash file, position of its first row in the catalog)


def _check_parts(parts) -> int:
    if isinstance(parts, bool) or not isinstance(parts, int | np.integer) or parts < 1:
        raise ValueError(f"parts: expected a positive int, got {parts!r}")
    return int(parts)


def _part_of(top32: np.ndarray, parts: int) -> np.ndarray:
    """Partition of each uint32 value: its range of `parts` equal ranges (a prefix)."""
    return ((top32.astype(np.uint64) * np.uint64(parts)) >> np.uint64(32)).astype(np.int32)


def _write_sorted(path: Path, table: pa.Table, column: str, parts: int) -> None:
    """`table` (sorted by `column`) with one row group per value, written atomically."""
    counts = np.bincount(table.column(column).to_numpy(), minlength=parts)
    tmp = path.with_name(path.name + ".tmp")
    with pq.ParquetWriter(tmp, table.schema) as writer:
        start = 0
        for n in counts[counts > 0]:
            writer.write_table(table.slice(start, int(n)), row_group_size=int(n))
            start += int(n)
        if table.num_rows == 0:
            writer.write_table(table)
    tmp.replace(path)


def write_hash_file(path: str | Path, hashes, parts: int) -> int:
    """Write one partition's hashes for the partitioned search; return its row count.

    Args:
        path: the Parquet file to write (its folder must exist).
        hashes: (sha_hi, sha_lo, phash) uint64 arrays in priority order
            (`data_quality.suite.hash_columns`).
        parts: how many hash-prefix partitions the search uses.
    """
    parts = _check_parts(parts)
    hi, lo, ph = (np.asarray(h, dtype=np.uint64) for h in hashes)
    xp = _part_of(hi >> np.uint64(32), parts)
    order = np.argsort(xp, kind="stable")
    table = pa.table(
        {
            "xp": xp[order],
            "pp": _part_of(_hash32(ph, _ALL_BITS), parts)[order],
            "idx": order.astype(np.int64),
            "hi": hi[order],
            "lo": lo[order],
            "ph": ph[order],
        }
    )
    _write_sorted(Path(path), table, "xp", parts)
    return len(hi)


def _read(files: Files, column: str, part: int, names: list[str]) -> dict[str, np.ndarray]:
    """Columns `names` of the rows of partition `part` (by `column`), with their catalog
    positions in `pos`, in priority order (files come in position order)."""
    got = {n: [] for n in [*names, "pos"]}
    for path, offset in files:
        t = pq.read_table(path, columns=["idx", *names], filters=[(column, "=", part)])
        got["pos"].append(t.column("idx").to_numpy() + np.int64(offset))
        for n in names:
            got[n].append(t.column(n).to_numpy())
    empty = {"pos": np.int64, "ph": np.uint64, "hi": np.uint64, "lo": np.uint64}
    return {n: np.concatenate(v) if v else np.zeros(0, empty[n]) for n, v in got.items()}


def exact_duplicates(files: Files, part: int, first: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Rows of exact partition `part` whose sha256 an earlier row has.

    Args:
        files: the hash files, (path, position of its first row), in position order.
        part: the exact partition (0 to parts - 1).
        first: the first position that is a target; earlier rows are only candidates.

    Returns:
        (positions, duplicate_of): int64 arrays, the target rows with a duplicate and the
        position of the first row with their sha256.
    """
    r = _read(files, "xp", part, ["hi", "lo"])
    pos, hi, lo = r["pos"], r["hi"], r["lo"]
    n = len(pos)
    order = np.lexsort((pos, lo, hi))
    same = np.r_[False, (hi[order][1:] == hi[order][:-1]) & (lo[order][1:] == lo[order][:-1])]
    head = order[np.maximum.accumulate(np.where(~same, np.arange(n), 0))]
    hit = (head != order) & (pos[order] >= first)
    return pos[order][hit], pos[head][hit]


def count_distinct(files: Files, part: int) -> int:
    """Distinct pHash values among the rows of pHash partition `part`."""
    return len(np.unique(_read(files, "pp", part, ["ph"])["ph"]))


def near_tables(max_distance: int, distinct: int) -> tuple[int, int, list[int]]:
    """The design `near_dup.near_duplicates` picks for `distinct` pHash values: `(m, j)` and
    the key masks of its tables, in table order."""
    m, j = _choose_blocks(max_distance, distinct, 0)
    return m, j, [int(t[1]) for t in _table_masks(max_distance, m, j)]


def split_by_table(path: str | Path, out: list[str | Path], keys: list[int], parts: int) -> None:
    """Split one hash file once per table: `out[i]` gets its rows sorted by the partition of
    the 32-bit hash of their key under mask `keys[i]` (column `np`, one row group each)."""
    parts = _check_parts(parts)
    if len(out) != len(keys):
        raise ValueError(f"out: expected one file per table ({len(keys)}), got {len(out)}")
    t = pq.read_table(path, columns=["idx", "hi", "ph"])
    idx, hi, ph = (t.column(c).to_numpy() for c in ("idx", "hi", "ph"))
    back = np.argsort(idx, kind="stable")  # the file's own order, so each part keeps it
    idx, hi, ph = idx[back], hi[back], ph[back]
    for dest, mask in zip(out, keys, strict=True):
        key = _part_of(_hash32(ph, np.uint64(mask)), parts)
        order = np.argsort(key, kind="stable")
        table = pa.table({"np": key[order], "idx": idx[order], "hi": hi[order], "ph": ph[order]})
        _write_sorted(Path(dest), table, "np", parts)


def _near_local(ph, hi, d: int, m: int, j: int, table: int, cap: int) -> np.ndarray:
    """`near_dup.near_duplicates` over these rows with one table (key mask) only."""
    if len(ph) < 2:
        return np.full(len(ph), -1, dtype=np.int64)
    return _near_within(ph, hi, d, cap, (m, j), table=np.uint64(table))


def near_duplicates_in(
    table_files: list[Files],
    part: int,
    max_distance: int,
    design: tuple[int, int, list[int]],
    first: int = 0,
    hot_bucket_cap: int = HOT_BUCKET_CAP,
) -> tuple[np.ndarray, np.ndarray]:
    """Near duplicates found in partition `part` of every table.

    Args:
        table_files: per table of `design`, its files (path, offset) in position order.
        part: the partition (0 to parts - 1) of each table's split.
        max_distance: largest Hamming distance that counts as a match.
        design: `near_tables(max_distance, distinct)` for the whole catalog.
        first: the first position that is a target.
        hot_bucket_cap: as in `near_dup.near_duplicates`.

    Returns:
        (positions, near_duplicate_of): int64 arrays, sorted by position, one row each: the
        smallest earlier position within `max_distance` (of another sha256) found here.
    """
    m, j, keys = design
    if len(table_files) != len(keys):
        raise ValueError(f"table_files: expected {len(keys)} lists, got {len(table_files)}")
    found_pos, found_of = [], []
    for files, key in zip(table_files, keys, strict=True):
        r = _read(files, "np", part, ["hi", "ph"])
        ans = _near_local(r["ph"], r["hi"], max_distance, m, j, key, hot_bucket_cap)
        hit = (ans >= 0) & (r["pos"] >= first)
        found_pos.append(r["pos"][hit])
        found_of.append(r["pos"][ans[hit]])
    return merge_hits(found_pos, found_of)


def merge_hits(positions: list[np.ndarray], of: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per position, the smallest of its hits: (positions, of), sorted by position."""
    if not positions:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    s = pd.Series(np.concatenate(of), index=np.concatenate(positions), dtype=np.int64)
    best = s.groupby(level=0, sort=True).min()
    return best.index.to_numpy(np.int64), best.to_numpy(np.int64)
