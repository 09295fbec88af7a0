"""Source formats: turn a listing into the items that ingest decodes.

Three formats of a source's files, detected from the listing or set with `ingest.layout`:

* **imagefolder** (Hugging Face): image files plus one manifest at the top level,
  `metadata.jsonl`, `.csv` or `.parquet`, with a `file_name` column and a caption column.
* **img2dataset** files: `00000/000000001.jpg` with a same-stem `.txt` caption and an optional
  `.json` (url, license, width, ...).
* **webdataset**: tar shards whose members are grouped by key (`0001.jpg`, `0001.txt`,
  `0001.json`). One tar is one unit of work; its samples are read in the decode worker.

An `Item` is the unit that ingest versions and decodes: one image file (with its sidecars or
manifest row), or one tar shard. Its `version` changes when any byte it depends on changes,
which is what makes re-runs incremental. Manifest rows that cannot be used become problem rows
with a reason code, never silent drops.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import pickle
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from kiln_config import SOURCE_FORMATS

__all__ = [
    "MANIFEST_NAMES",
    "SOURCE_FORMATS",
    "Item",
    "Manifest",
    "is_unsafe_key",
    "item_from_row",
    "iter_manifest",
    "plan_object",
    "split_ext",
]

# Columns of an accepted catalog row; pass-through metadata columns come after these.
MANIFEST_NAMES = ("metadata.jsonl", "metadata.csv", "metadata.parquet")
SIDECAR_EXTS = (".txt", ".json")


def is_unsafe_key(key: str) -> bool:
    """True for keys that would escape a folder if written: absolute, or with a `..` part."""
    p = PurePosixPath(key)
    return key.startswith(("/", "\\")) or p.is_absolute() or ".." in p.parts or "\\" in key


@dataclass(frozen=True)
class Item:
    """One unit of decode work (see the module docstring)."""

    key: str  # catalog key (for a tar: the tar's key)
    kind: str  # "file" or "tar"
    version: str  # changes whenever any byte the item depends on changes
    caption: str | None = None  # from an imagefolder manifest
    meta: dict = field(default_factory=dict)  # pass-through columns from the manifest
    txt: str | None = None  # img2dataset caption sidecar
    json: str | None = None  # img2dataset metadata sidecar


@dataclass(frozen=True)
class Manifest:
    """The imagefolder manifest a run reads (none: `name` None)."""

    name: str | None = None
    version: str = "-"


def split_ext(key: str) -> tuple[str, str]:
    p = PurePosixPath(key)
    return key[: len(key) - len(p.suffix)], p.suffix.lower()


def _problem(key: str, reason: str, detail: str) -> dict:
    return {"key": key, "reason": reason, "detail": detail[:500]}


def _clean_value(v):
    # Parquet needs one type per column; NaN from CSV/parquet readers means "absent".
    if isinstance(v, float) and math.isnan(v):
        return None
    if isinstance(v, (dict, list)):
        return json.dumps(v, sort_keys=True)
    return v


def _manifest_row(
    n: int, where: str, row: object, caption_column: str, metadata_columns: list[str]
) -> dict:
    """One manifest row as staged: its file name, caption and pass-through values, or the
    reason it cannot be used (the check for a second row of one file name comes later, over
    the whole manifest)."""
    if not isinstance(row, dict) or not isinstance(row.get("file_name"), str):
        return {"line": n, **_problem(where, "manifest_no_file_name", repr(row)[:200])}
    name = row["file_name"]
    if is_unsafe_key(name):
        return {"line": n, **_problem(name, "manifest_unsafe_key", f"{where}: path escapes source")}
    cap = _clean_value(row.get(caption_column))
    meta = {c: _clean_value(row.get(c)) for c in metadata_columns}
    return {
        "line": n,
        "key": where,
        "file_name": name,
        "caption": None if cap is None else str(cap),
        "meta": pickle.dumps(meta),
    }


def iter_manifest(
    path: Path, name: str, caption_column: str, metadata_columns: list[str]
) -> Iterator[dict]:
    """The rows of an imagefolder manifest (`.jsonl`, `.csv` or `.parquet`, a local copy at
    `path` of the object `name`), one at a time, in file order.

    A row is {line, key, file_name, caption, meta} (`meta`: the pass-through values,
    pickled), or {line, key, reason, detail} for a row that cannot be used: a line that is not
    valid JSON or UTF-8, a row without `file_name`, an unsafe file name.
    """
    if name.endswith(".jsonl"):
        with open(path, "rb") as f:
            for n, line in enumerate(f, start=1):
                where = f"{name}:{n}"
                if not line.strip():
                    continue
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield {"line": n, **_problem(where, "manifest_not_utf8", str(e))}
                    continue
                try:
                    row = json.loads(text)
                except json.JSONDecodeError as e:
                    yield {"line": n, **_problem(where, "manifest_bad_json", str(e))}
                    continue
                yield _manifest_row(n, where, row, caption_column, metadata_columns)
    elif name.endswith(".csv"):
        with open(path, encoding="utf-8", errors="surrogateescape", newline="") as f:
            for n, row in enumerate(csv.DictReader(f), start=2):  # line 1 is the header
                where = f"{name}:{n}"
                if None in row or any(v is None for v in row.values()):
                    bad = _problem(where, "manifest_bad_row", "wrong number of fields")
                    yield {"line": n, **bad}
                    continue
                try:
                    "".join(row.values()).encode("utf-8")
                except UnicodeEncodeError as e:
                    yield {"line": n, **_problem(where, "manifest_not_utf8", str(e))}
                    continue
                yield _manifest_row(n, where, row, caption_column, metadata_columns)
    else:
        import pyarrow.parquet as pq

        try:
            batches = pq.ParquetFile(path).iter_batches(batch_size=10_000)
            n = 0
            for batch in batches:
                for row in batch.to_pylist():
                    n += 1
                    yield _manifest_row(n, f"{name}:row{n}", row, caption_column, metadata_columns)
        except Exception as e:  # noqa: BLE001 - a broken manifest is a reason, not a crash
            yield {"line": 0, **_problem(name, "manifest_unreadable", f"{type(e).__name__}: {e}")}


def _version(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def plan_object(row: dict, source_format: str, image_exts: set[str]) -> dict:
    """What one listed object (not a sidecar or the manifest) becomes, as a row of the run's
    items: a tar shard or an image file with its version, or a file quarantined from the
    listing alone (an unsafe key, an extension that belongs to no item).

    `row` has the object's `key`, `size`, `version`, `ext` and `unsafe`, and, where the format
    has them, its sidecars (`txt`, `txt_version`, `json`, `json_version`) or its manifest row
    (`caption`, `meta`, `has_row`). The item's `version` changes when any byte it depends on
    changes: the object's, its sidecars' or its manifest row's.
    """
    key, size, over, ext = row["key"], row["size"], row["version"], row["ext"]
    out = {"key": key, "kind": "reject", "version": over}
    if row["unsafe"]:
        return {**out, **_problem(key, "unsafe_key", "path escapes the source")}
    if source_format == "webdataset" and ext == ".tar":
        return {**out, "kind": "tar", "version": _version(size, over)}
    if ext not in image_exts:
        return {**out, **_problem(key, "unsupported_extension", key)}
    if source_format == "img2dataset":
        version = _version(size, over, row.get("txt_version"), row.get("json_version"))
        return {
            **out,
            "kind": "file",
            "version": version,
            "txt": row.get("txt"),
            "json": row.get("json"),
        }
    manifest_row = None
    if row.get("has_row"):
        manifest_row = {"caption": row["caption"], "meta": pickle.loads(row["meta"])}
    return {
        **out,
        "kind": "file",
        "version": _version(size, over, manifest_row),
        "caption": row.get("caption"),
        "meta": row.get("meta"),
    }


def item_from_row(row: dict) -> Item:
    """The decode work of one staged item row (of `plan_object`)."""
    meta = pickle.loads(row["meta"]) if row.get("meta") is not None else {}
    return Item(
        key=row["key"],
        kind=row["kind"],
        version=row["version"],
        caption=row.get("caption"),
        meta=meta,
        txt=row.get("txt"),
        json=row.get("json"),
    )
