"""A stable sort of Arrow tables larger than memory, by string columns: sorted runs on disk,
then a block merge.

Rows come in as tables of one schema; every `RUN_ROWS` of them are sorted in memory and
written as a run; the runs are then merged `MERGE_ROWS` rows of each at a time: every row at
or below the smallest of the runs' current last rows is emitted, in order, and the rest wait.
Ties keep the order the rows came in, and a null sorts after every value, as pandas'
`sort_values(kind="stable")` does. Memory is a run while sorting and a block a run while
merging, whatever the row count.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

__all__ = ["MERGE_ROWS", "RUN_ROWS", "sorted_tables"]

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
    keys = _key_names(by)
    order = [(k, "ascending") for k in keys]
    runs = _runs(tables, by, folder)
    readers = [pq.ParquetFile(r).iter_batches(batch_size=MERGE_ROWS) for r in runs]
    blocks = [next(r, None) for r in readers]
    blocks = [None if b is None else pa.Table.from_batches([b]) for b in blocks]
    while any(b is not None for b in blocks):
        live = [i for i, b in enumerate(blocks) if b is not None]
        bound = min(tuple(blocks[i][k][-1].as_py() for k in keys) for i in live)
        taken = []
        for i in live:
            n = _at_most(blocks[i], keys, bound)
            taken.append(blocks[i].slice(0, n))
            blocks[i] = blocks[i].slice(n)
            if not blocks[i].num_rows:
                nxt = next(readers[i], None)
                blocks[i] = None if nxt is None else pa.Table.from_batches([nxt])
        yield pa.concat_tables(taken).sort_by(order).drop_columns(keys)
