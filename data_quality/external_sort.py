"""A stable sort of Arrow tables larger than memory, by string columns: sorted runs on disk,
then a block merge.

Rows come in as tables of one schema; every `RUN_ROWS` of them are sorted in memory and
written as a run; the runs are then merged `MERGE_ROWS` rows of each at a time: every row at
or below the smallest of the runs' current last rows is emitted, in order, and the rest wait.
Ties keep the order the rows came in, and a null sorts after every value, as pandas'
`sort_values(kind="stable")` does. Memory is a run while sorting and a block a run while
merging, whatever the row count. `merged_tables` merges streams that are sorted already (an
earlier sorted file and a few new rows) the same way, with no runs to write.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

__all__ = ["MERGE_ROWS", "RUN_ROWS", "merged_tables", "sorted_tables"]

RUN_ROWS = 262_144  # rows sorted in memory at once
MERGE_ROWS = 8_192  # rows of each run held while merging
_ORD = "__order"


def _with_keys(t: pa.Table, by: list[str], first: int) -> pa.Table:
    """`t` with the columns its sort compares: per column of `by`, a null flag and the value
    (nulls as ""), and the rows' arrival order."""
    for i, c in enumerate(by):
        t = t.append_column(f"__null{i}", pc.is_null(t[c]).cast(pa.int8()))
        t = t.append_column(f"__value{i}", pc.fill_null(t[c].cast(pa.string()), ""))
    return t.append_column(_ORD, pa.array(range(first, first + t.num_rows), pa.int64()))


def _key_names(by: list[str]) -> list[str]:
    return [n for i in range(len(by)) for n in (f"__null{i}", f"__value{i}")] + [_ORD]


def _runs(tables: Iterable[pa.Table], by: list[str], folder: Path) -> list[Path]:
    runs, held, n, seen = [], [], 0, 0
    order = [(k, "ascending") for k in _key_names(by)]

    def spill() -> None:
        nonlocal held, n
        path = folder / f"run-{len(runs):05d}.parquet"
        pq.write_table(pa.concat_tables(held).sort_by(order), path, row_group_size=MERGE_ROWS)
        runs.append(path)
        held, n = [], 0

    for t in tables:
        if t.num_rows:
            held.append(_with_keys(t, by, seen))
            n, seen = n + t.num_rows, seen + t.num_rows
            if n >= RUN_ROWS:
                spill()
    if held:
        spill()
    return runs


def _at_most(t: pa.Table, keys: list[str], bound: tuple) -> int:
    """How many rows of the sorted `t` are at most `bound` (a prefix of it)."""
    le = eq = None
    for k, v in zip(keys, bound, strict=True):
        value = pa.scalar(v, t.schema.field(k).type)
        lt, same = pc.less(t[k], value), pc.equal(t[k], value)
        le = lt if le is None else pc.or_(le, pc.and_(eq, lt))
        eq = same if eq is None else pc.and_(eq, same)
    return int(pc.sum(pc.or_(le, eq)).as_py() or 0)


def sorted_tables(tables: Iterable[pa.Table], by: list[str], folder: Path) -> Iterator[pa.Table]:
    """`tables` (one schema) as sorted tables, stably by the columns `by`; the runs are
    written under `folder` (created; the caller removes it)."""
    folder.mkdir(parents=True, exist_ok=True)
    runs = _runs(tables, by, folder)
    yield from _merge([_blocks(r) for r in runs], _key_names(by))


def _blocks(run: Path) -> Iterator[pa.Table]:
    for b in pq.ParquetFile(run).iter_batches(batch_size=MERGE_ROWS):
        yield pa.Table.from_batches([b])


def _merge(streams: list[Iterator[pa.Table]], keys: list[str]) -> Iterator[pa.Table]:
    """Streams of tables, each sorted by the columns `keys` (no two rows of different streams
    equal on all of them), as one sorted stream without those columns: every row at or below
    the smallest of the streams' current last rows is emitted, the rest wait."""
    order = [(k, "ascending") for k in keys]
    blocks = [next(s, None) for s in streams]
    while any(b is not None for b in blocks):
        live = [i for i, b in enumerate(blocks) if b is not None]
        bound = min(tuple(blocks[i][k][-1].as_py() for k in keys) for i in live)
        taken = []
        for i in live:
            n = _at_most(blocks[i], keys, bound)
            taken.append(blocks[i].slice(0, n))
            blocks[i] = blocks[i].slice(n)
            while blocks[i] is not None and not blocks[i].num_rows:
                blocks[i] = next(streams[i], None)
        yield pa.concat_tables(taken).sort_by(order).drop_columns(keys)


def merged_tables(
    streams: list[Iterable[pa.Table]], by: list[str], rank: str
) -> Iterator[pa.Table]:
    """Streams of tables (one schema), each already sorted stably by the columns `by`, as one
    sorted stream: rows equal on `by` come by the int column `rank` (dropped; within a
    stream, it must not decrease among such rows), then by stream, then as they came. Nulls
    sort as in `sorted_tables`. Memory is a block of each stream, whatever the row count."""

    def keyed(i: int, tables: Iterable[pa.Table]) -> Iterator[pa.Table]:
        seen = 0
        for t in tables:
            if not t.num_rows:
                continue
            tie = (t[rank].to_numpy().astype(np.int64) << 48) | (i << 40)
            t = _with_keys(t.drop_columns([rank]), by, seen)
            at = t.schema.get_field_index(_ORD)
            t = t.set_column(at, _ORD, pa.array(tie + t[_ORD].to_numpy(), pa.int64()))
            seen += t.num_rows
            yield t

    yield from _merge([keyed(i, s) for i, s in enumerate(streams)], _key_names(by))
