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
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from kiln_config import CATALOG_COLUMNS, SOURCE_FORMATS
from tasks.storage.objects import ObjectInfo, Storage

__all__ = [
    "CATALOG_COLUMNS",
    "MANIFEST_NAMES",
    "SOURCE_FORMATS",
    "Item",
    "Manifest",
    "detect_source_format",
    "is_unsafe_key",
    "plan_items",
    "read_manifest",
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


@dataclass
class Manifest:
    """An imagefolder manifest: rows by file name, plus rows that could not be used."""

    name: str | None = None
    version: str = "-"
    rows: dict[str, dict] = field(default_factory=dict)
    problems: list[dict] = field(default_factory=list)


def detect_source_format(listing: list[ObjectInfo], image_exts: set[str]) -> str:
    """Guess the source's format: tars mean webdataset, a top-level manifest imagefolder, `.txt`
    sidecars img2dataset; anything else is treated as an imagefolder without a manifest."""
    keys = {o.key for o in listing}
    if any(k.lower().endswith(".tar") for k in keys):
        return "webdataset"
    if any(k in keys for k in MANIFEST_NAMES):
        return "imagefolder"
    for k in keys:
        stem, ext = _split_ext(k)
        if ext in image_exts and f"{stem}.txt" in keys:
            return "img2dataset"
    return "imagefolder"


def _split_ext(key: str) -> tuple[str, str]:
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


def _accept_row(
    m: Manifest, where: str, row: object, caption_column: str, metadata_columns: list[str]
) -> None:
    if not isinstance(row, dict) or not isinstance(row.get("file_name"), str):
        m.problems.append(_problem(where, "manifest_no_file_name", repr(row)[:200]))
        return
    name = row["file_name"]
    if is_unsafe_key(name):
        m.problems.append(_problem(name, "manifest_unsafe_key", f"{where}: path escapes source"))
        return
    if name in m.rows:
        m.problems.append(_problem(where, "manifest_duplicate_row", f"second row for {name}"))
        return
    cap = _clean_value(row.get(caption_column))
    m.rows[name] = {
        "caption": None if cap is None else str(cap),
        "meta": {c: _clean_value(row.get(c)) for c in metadata_columns},
    }


def read_manifest(
    store: Storage,
    obj: ObjectInfo | None,
    caption_column: str,
    metadata_columns: list[str],
) -> Manifest:
    """Parse an imagefolder manifest (`.jsonl`, `.csv` or `.parquet`) line by line.

    A line that is not valid JSON or UTF-8, a row without `file_name`, an unsafe file name
    and a repeated file name each become a problem row with a reason code.
    """
    m = Manifest()
    if obj is None:
        return m
    m.name, m.version = obj.key, obj.version
    data = store.read_bytes(obj.key)
    if obj.key.endswith(".jsonl"):
        for n, line in enumerate(data.splitlines(), start=1):
            where = f"{obj.key}:{n}"
            if not line.strip():
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                m.problems.append(_problem(where, "manifest_not_utf8", str(e)))
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                m.problems.append(_problem(where, "manifest_bad_json", str(e)))
                continue
            _accept_row(m, where, row, caption_column, metadata_columns)
    elif obj.key.endswith(".csv"):
        text = data.decode("utf-8", "surrogateescape")
        reader = csv.DictReader(io.StringIO(text, newline=""))
        for n, row in enumerate(reader, start=2):  # line 1 is the header
            where = f"{obj.key}:{n}"
            if None in row or any(v is None for v in row.values()):
                m.problems.append(_problem(where, "manifest_bad_row", "wrong number of fields"))
                continue
            try:
                "".join(row.values()).encode("utf-8")
            except UnicodeEncodeError as e:
                m.problems.append(_problem(where, "manifest_not_utf8", str(e)))
                continue
            _accept_row(m, where, row, caption_column, metadata_columns)
    else:
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(io.BytesIO(data))
        except Exception as e:  # noqa: BLE001 - a broken manifest is a reason, not a crash
            m.problems.append(_problem(obj.key, "manifest_unreadable", f"{type(e).__name__}: {e}"))
            return m
        for n, row in enumerate(table.to_pylist(), start=1):
            _accept_row(m, f"{obj.key}:row{n}", row, caption_column, metadata_columns)
    return m


def _version(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def plan_items(
    listing: list[ObjectInfo],
    source_format: str,
    manifest: Manifest,
    image_exts: set[str],
) -> tuple[list[Item], list[dict]]:
    """Items to decode, plus files that are quarantined from the listing alone.

    Returns (items, rejected), where each rejected row is {key, reason, detail, version}:
    unsafe keys and files that belong to no item (stray extensions). Sidecars and the
    manifest are consumed by items, so they are neither.
    """
    by_key = {o.key: o for o in listing}
    items: list[Item] = []
    rejected: list[dict] = []
    consumed: set[str] = set()
    if manifest.name:
        consumed.add(manifest.name)
    if source_format == "img2dataset":
        for o in listing:
            stem, ext = _split_ext(o.key)
            if ext in image_exts and not is_unsafe_key(o.key):
                for side in SIDECAR_EXTS:
                    if f"{stem}{side}" in by_key:
                        consumed.add(f"{stem}{side}")

    for o in listing:
        if o.key in consumed:
            continue
        stem, ext = _split_ext(o.key)
        if is_unsafe_key(o.key):
            rejected.append(
                {**_problem(o.key, "unsafe_key", "path escapes the source"), "version": o.version}
            )
        elif source_format == "webdataset" and ext == ".tar":
            items.append(Item(key=o.key, kind="tar", version=_version(o.size, o.version)))
        elif ext not in image_exts:
            rejected.append(
                {**_problem(o.key, "unsupported_extension", o.key), "version": o.version}
            )
        elif source_format == "img2dataset":
            txt, js = by_key.get(f"{stem}.txt"), by_key.get(f"{stem}.json")
            items.append(
                Item(
                    key=o.key,
                    kind="file",
                    version=_version(o.size, o.version, txt and txt.version, js and js.version),
                    txt=txt.key if txt else None,
                    json=js.key if js else None,
                )
            )
        else:
            row = manifest.rows.get(o.key)
            items.append(
                Item(
                    key=o.key,
                    kind="file",
                    version=_version(o.size, o.version, row),
                    caption=row["caption"] if row else None,
                    meta=row["meta"] if row else {},
                )
            )
    listed = {o.key for o in listing}
    for name in sorted(set(manifest.rows) - listed):
        manifest.problems.append(
            _problem(name, "manifest_missing_file", "listed in the manifest, not in the source")
        )
    return items, rejected
