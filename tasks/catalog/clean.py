"""The clean rows of a validated catalog: the view after an ingest less the rows its verdict
quarantined, with the near-duplicates it kept marked (`near_duplicate_of`).

Nothing view-sized is written for them: the verdict's rows (`rejects.parquet`,
`near_duplicates.parquet`, `data_quality.verdict`) are looked up by a 128-bit hash of their
source and key while the view is scanned a row group at a time, so memory holds 16 bytes a
quarantined or flagged row, not their strings.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from data_quality.suite import hash128
from data_quality.verdict import FLAGS_FILE, REJECTS_FILE
from kiln_config.errors import MissingInput
from tasks.catalog.view import accepted_columns, scan_view
from tasks.storage.layout import Layout

__all__ = ["read_clean", "scan_clean"]


def _pair_strings(source, key) -> np.ndarray:
    """`source` and `key` (columns, arrays or lists) joined per row, as Python strings."""
    return (
        pd.Series(source, dtype=object).astype(str).to_numpy(object)
        + "\0"
        + pd.Series(key, dtype=object).astype(str).to_numpy(object)
    )


def _pair_hashes(pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two independent 64-bit hashes of each joined (source, key)."""
    return hash128(pairs, "kiln-pairs-hi-01", "kiln-pairs-lo-02")


class _Pairs:
    """The (source, key) pairs of a verdict file, as 128 bits each, sorted, with one column's
    values beside them: `find` looks a batch of rows up without holding the pairs' strings
    (16 bytes a pair, and the values' own)."""

    def __init__(self, path: Path, value: str | None = None) -> None:
        hi, lo, vals = [], [], []
        f = pq.ParquetFile(path)
        for b in f.iter_batches(columns=["source", "key", *([value] if value else [])]):
            h, g = _pair_hashes(
                _pair_strings(b.column("source").to_pylist(), b.column("key").to_pylist())
            )
            hi.append(h)
            lo.append(g)
            if value:
                vals.append(b.column(value))
        self.hi = np.concatenate(hi) if hi else np.zeros(0, np.uint64)
        self.lo = np.concatenate(lo) if lo else np.zeros(0, np.uint64)
        order = np.lexsort((self.lo, self.hi))
        self.hi, self.lo = self.hi[order], self.lo[order]
        self.values = pa.concat_arrays(vals).take(pa.array(order)) if vals else None

    def __len__(self) -> int:
        return len(self.hi)

    def find(self, source, key) -> np.ndarray:
        """Each row's position among the pairs (as sorted), -1 where it is not one."""
        hi, lo = _pair_hashes(_pair_strings(source, key))
        start = np.searchsorted(self.hi, hi, "left")
        stop = np.searchsorted(self.hi, hi, "right")
        out = np.full(len(hi), -1, np.int64)
        one = (stop - start) == 1
        first = np.minimum(start, max(len(self.hi) - 1, 0))
        hit = one & (self.lo[first] == lo) if len(self.hi) else one
        out[hit] = start[hit]
        for i in np.flatnonzero((stop - start) > 1):  # the high hash shared: rare
            same = np.flatnonzero(self.lo[start[i] : stop[i]] == lo[i])
            if len(same):
                out[i] = start[i] + same[0]
        return out


def scan_clean(
    root: str, ingest_id: str, columns: list[str] | None = None
) -> Iterator[pd.DataFrame]:
    """The clean rows of a validated catalog, a row group at a time: the view after
    `ingest_id` less the rows its verdict quarantined (only `columns`, when given). The
    verdict's rows are looked up by a 128-bit hash of their source and key (`_Pairs`), so
    memory holds 16 bytes a quarantined or flagged row, not their strings."""
    layout = Layout(Path(root))
    cat = layout.catalog(ingest_id)
    gone = _Pairs(cat / REJECTS_FILE)
    need = None if columns is None else list(dict.fromkeys([*columns, "source", "key"]))
    if need is not None and "near_duplicate_of" in need:
        need.remove("near_duplicate_of")
    flags = None
    if columns is None or "near_duplicate_of" in columns:
        flags = _Pairs(cat / FLAGS_FILE, "near_duplicate_of")
    for batch in scan_view(layout, ingest_id, "accepted", need):
        if len(gone) and len(batch):
            batch = batch[gone.find(batch["source"], batch["key"]) < 0]
        if flags is not None:
            near = np.full(len(batch), np.nan, object)
            if len(flags) and len(batch):
                at = flags.find(batch["source"], batch["key"])
                hit = at >= 0
                near[hit] = flags.values.take(pa.array(at[hit])).to_numpy(zero_copy_only=False)
            batch = batch.assign(near_duplicate_of=near)
        yield batch if columns is None else batch[columns]


def read_clean(root: str, ingest_id: str, columns: list[str] | None = None) -> pd.DataFrame:
    """The clean rows of a validated catalog as one frame (see `scan_clean`)."""
    layout = Layout(Path(root))
    if not (layout.catalog(ingest_id) / REJECTS_FILE).is_file():
        raise MissingInput(
            f"catalog {ingest_id} has not been validated "
            f"({layout.catalog(ingest_id) / REJECTS_FILE} missing): run `kiln validate` first"
        )
    got = [b for b in scan_clean(root, ingest_id, columns) if len(b)]
    if got:
        return pd.concat(got, ignore_index=True)
    return pd.DataFrame(columns=columns or accepted_columns(layout, ingest_id))
