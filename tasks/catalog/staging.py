"""One ingest's rows of one catalog table, staged on disk as its partitions finish.

An ingest decodes in partitions; each partition's rows go to a Parquet file of their own in a
staging folder as soon as the partition is done, so the driver holds one partition's rows at a
time, however many items the ingest decodes. The commit (`commit_staged`) then streams the
staged files into the Delta table, a row group at a time, in the one commit that also removes
the rows they replace (`tasks.catalog.view.commit_ingest`).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tasks.catalog.view import (
    ROW_GROUP,
    SEQ,
    commit_ingest,
    conform,
    frame_rows,
    open_table,
    target_schema,
    untyped_nulls,
)
from tasks.storage.layout import Layout

__all__ = ["StagedRows", "commit_staged"]


class StagedRows:
    """Rows of one table, added a partition at a time to Parquet files under `folder`.

    Args:
        folder: The staging folder (created; `discard` removes it).
        columns: The columns every staged frame starts with (absent ones null).
    """

    def __init__(self, folder: Path, columns: list[str]) -> None:
        self.folder, self.columns = folder, columns
        self.rows = 0
        self._files: list[Path] = []
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)

    def add(self, records: list[dict]) -> None:
        """Stage `records` (dicts of column values) as one file, sorted by key."""
        if not records:
            return
        df = frame_rows(records, self.columns)
        t = untyped_nulls(pa.Table.from_pandas(df, preserve_index=False))
        path = self.folder / f"part-{len(self._files):06d}.parquet"
        pq.write_table(t, path, row_group_size=ROW_GROUP)
        self._files.append(path)
        self.rows += t.num_rows

    def reader(self, schema: pa.Schema, seq: int) -> pa.RecordBatchReader:
        """The staged rows in the order they were added, of `schema`, with `ingest_seq` = `seq`."""

        def batches() -> Iterator[pa.RecordBatch]:
            for path in self._files:
                f = pq.ParquetFile(path)
                for g in range(f.num_row_groups):
                    t = f.read_row_group(g)
                    if SEQ not in t.column_names:
                        t = t.append_column(SEQ, pa.array([seq] * t.num_rows, pa.int64()))
                    yield from conform(t, schema).to_batches()

        return pa.RecordBatchReader.from_batches(schema, batches())

    def schemas(self, seq_type: pa.DataType = pa.int64()) -> list[pa.Schema]:
        """Each staged file's schema, with `ingest_seq` added where absent."""
        out = []
        for path in self._files:
            sch = pq.read_schema(path)
            out.append(sch if SEQ in sch.names else sch.append(pa.field(SEQ, seq_type)))
        return out

    def discard(self) -> None:
        """Remove the staging folder."""
        shutil.rmtree(self.folder, ignore_errors=True)


def commit_staged(
    layout: Layout, table: str, staged: StagedRows, source: str, seq: int, replaced: str
) -> int | None:
    """Commit the staged rows of `source` to `table` as one ingest (`ingest_seq` = `seq`); the
    source's rows matching the SQL condition `replaced` leave in the same commit. Returns the
    table's version after it (None: the table is still empty)."""
    data = None
    if staged.rows:
        data = staged.reader(target_schema(staged.schemas(), open_table(layout, table)), seq)
    return commit_ingest(layout, table, data, source, seq, replaced)
