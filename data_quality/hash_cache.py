"""The accepted rows' duplicate-check hashes kept on disk, one file per Parquet row group.

An incremental validate compares its new rows with every old row for exact and near
duplicates; parsing the old rows' sha256 and pHash strings again would be most of its work
on a large catalog. The row checks already compute each row's hashes
(`data_quality.suite.hash_columns`: sha_hi, sha_lo, phash as uint64), so they keep them in
`<root>/catalog/hash-cache-v<VERSION>/<partition folder>/<file stem>-<file size>/<group>.npy`
(a 3 x n uint64 array), and the duplicate search reads those instead.

An entry is named after its data file: Delta Lake never rewrites a data file in place (an
ingest that replaces rows, or a compaction, writes new files), so an entry is either the
hashes of the rows it is named after, or never looked up again. One whose row count differs
from its row group's is not used, and the rows are read and parsed as without a cache; one
that is not a whole array is removed, so that the next save writes it again.
`prune` removes the entries of data files no longer on disk (vacuumed).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path

import numpy as np

__all__ = ["VERSION", "cache_folder", "load", "prune", "save"]

VERSION = 1  # bump when hash_columns changes: older entries are then never read


def cache_folder(catalog: Path) -> Path:
    """The hash cache's folder in the root's `catalog` folder."""
    return Path(catalog) / f"hash-cache-v{VERSION}"


def _folder(cache: Path, data_file: Path) -> Path:
    data_file = Path(data_file)
    size = data_file.stat().st_size
    return Path(cache) / data_file.parent.name / f"{data_file.stem}-{size}"


def load(cache: Path, data_file: Path, group: int, rows: int) -> tuple | None:
    """The cached (sha_hi, sha_lo, phash) of row group `group` of `data_file`, or None when
    there is no entry of `rows` rows for it."""
    try:
        entry = _folder(cache, data_file) / f"{group:06d}.npy"
        got = np.load(entry)
    except OSError:  # none
        return None
    except (ValueError, EOFError):  # not a whole entry: dropped, so that a save writes it again
        with contextlib.suppress(OSError):  # a cache only saves time: a read-only one is read
            entry.unlink(missing_ok=True)
        return None
    if got.dtype != np.uint64 or got.shape != (3, rows):
        return None
    return got[0], got[1], got[2]


def save(
    cache: Path, data_file: Path, groups: list[int], group_rows: list[int], hashes: tuple
) -> None:
    """Keep the hashes of row groups `groups` of `data_file` (`group_rows` rows each; `hashes`
    in their order). Each entry is written whole (a temporary file renamed) and an existing
    one is kept, so concurrent writers and retries are safe."""
    if sum(group_rows) != len(hashes[0]):
        raise ValueError(f"hashes: expected {sum(group_rows)} rows, got {len(hashes[0])}")
    folder = _folder(cache, data_file)
    folder.mkdir(parents=True, exist_ok=True)
    stacked = np.stack([np.asarray(h, dtype=np.uint64) for h in hashes])
    start = 0
    for g, n in zip(groups, group_rows, strict=True):
        path = folder / f"{g:06d}.npy"
        if not path.is_file():
            tmp = folder / f".{g:06d}.{uuid.uuid4().hex}.tmp.npy"
            with open(tmp, "wb") as f:
                np.save(f, np.ascontiguousarray(stacked[:, start : start + n]))
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(path)
        start += n


def prune(cache: Path, table: Path) -> int:
    """Remove the entries whose data file (under the Delta table folder `table`) is gone;
    return how many were removed."""
    removed = 0
    if not Path(cache).is_dir():
        return removed
    for part in Path(cache).iterdir():
        for entry in part.iterdir() if part.is_dir() else ():
            stem, _, size = entry.name.rpartition("-")
            data_file = Path(table) / part.name / f"{stem}.parquet"
            if not (data_file.is_file() and str(data_file.stat().st_size) == size):
                shutil.rmtree(entry, ignore_errors=True)
                removed += 1
            else:  # a writer's temporary file that a crash left
                for tmp in entry.glob(".*.tmp.npy"):
                    tmp.unlink(missing_ok=True)
    return removed
