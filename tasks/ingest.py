"""Ingest: list a source, read its manifest, decode every image in a process pool, write a catalog.

Writes `<root>/catalog/<ingest_id>/{accepted,quarantine}.parquet` and `summary.json`.
Every listed file ends up in exactly one of the two tables. The ingest id is a hash of the
listing (keys, sizes, ETags or mtimes) and the manifest, so an unchanged source maps to the
same id and a re-run reuses the catalog instead of decoding again.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import shutil
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

import pandas as pd
from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.decode import inspect_image
from tasks.layout import Layout
from tasks.logs import task_logger
from tasks.storage import Storage

__all__ = ["IngestResult", "ingest_source", "read_manifest"]


ACCEPTED_COLUMNS = ["key", "sha256", "width", "height", "caption", "format", "mode", "bytes"]
QUARANTINE_COLUMNS = ["key", "reason", "detail", "step"]


@dataclass
class IngestResult:
    ingest_id: str
    source: str
    listed: int
    accepted: int
    quarantined: int
    reasons: dict[str, int] = field(default_factory=dict)
    manifest_problems: int = 0
    reused: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def read_manifest(
    store: Storage, metadata_file: str, caption_column: str
) -> tuple[dict[str, str | None], list[dict]]:
    """Captions by key from an imagefolder `metadata.jsonl`, plus rows that could not be used."""
    captions: dict[str, str | None] = {}
    problems: list[dict] = []
    if not store.exists(metadata_file):
        task_logger(__name__).warning(
            "no %s in %s: every image will lack a caption", metadata_file, store.url()
        )
        return captions, problems
    for n, line in enumerate(store.read_bytes(metadata_file).splitlines(), start=1):
        where = f"{metadata_file}:{n}"
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            problems.append({"key": where, "reason": "manifest_bad_json", "detail": str(e)})
            continue
        if not isinstance(row, dict) or not isinstance(row.get("file_name"), str):
            problems.append(
                {
                    "key": where,
                    "reason": "manifest_no_file_name",
                    "detail": line[:200].decode("utf-8", "replace"),
                }
            )
            continue
        cap = row.get(caption_column)
        captions[row["file_name"]] = None if cap is None else str(cap)
    return captions, problems


def _ingest_id(source: str, listing: list, manifest_digest: str) -> str:
    h = hashlib.sha256(source.encode())
    for o in listing:
        h.update(f"\0{o.key}\0{o.size}\0{o.version}".encode())
    h.update(manifest_digest.encode())
    return "ing-" + h.hexdigest()[:12]


def _is_unsafe(key: str) -> bool:
    p = PurePosixPath(key)
    return p.is_absolute() or ".." in p.parts


@task(name="ingest-source", retries=1, retry_delay_seconds=5, cache_policy=NO_CACHE)
def ingest_source(
    source: str,
    root: str,
    *,
    metadata_file: str = "metadata.jsonl",
    caption_column: str = "text",
    image_extensions: tuple[str, ...] = (".jpg", ".jpeg", ".png", ".webp"),
    max_pixels: int = 89_478_485,
    workers: int = 0,
    endpoint_url: str | None = None,
) -> IngestResult:
    """Catalog every file under `source` into `<root>/catalog/<ingest_id>/`.

    Idempotent: an unchanged source gives the same ingest id, and its catalog is reused.
    """
    store = Storage(source, endpoint_url)
    layout = Layout(Path(root))
    listing = store.list()
    if not listing and not store.is_s3 and not store.path.is_dir():
        raise FileNotFoundError(f"ingest source {source!r} does not exist")
    manifest_obj = next((o for o in listing if o.key == metadata_file), None)
    files = [o for o in listing if o.key != metadata_file]
    ingest_id = _ingest_id(store.url(), files, manifest_obj.version if manifest_obj else "-")
    out = layout.catalog(ingest_id)
    if (out / "summary.json").is_file():
        result = IngestResult(**json.loads((out / "summary.json").read_text()))
        result.reused = True
        task_logger(__name__).info("source unchanged since %s: reusing its catalog", ingest_id)
        layout.set_latest("catalog", ingest_id)
        return result

    captions, manifest_problems = read_manifest(store, metadata_file, caption_column)
    exts = {e.lower() for e in image_extensions}
    quarantine: list[dict] = []
    jobs = []
    for o in files:
        if _is_unsafe(o.key):
            quarantine.append(
                {"key": o.key, "reason": "unsafe_key", "detail": "path escapes the source"}
            )
        elif PurePosixPath(o.key).suffix.lower() not in exts:
            quarantine.append({"key": o.key, "reason": "unsupported_extension", "detail": o.key})
        else:
            jobs.append((store.url(), endpoint_url, o.key, max_pixels))

    n_workers = workers or os.cpu_count() or 1
    task_logger(__name__).info(
        "ingest %s: %d files listed, decoding %d in %d processes",
        ingest_id,
        len(files),
        len(jobs),
        n_workers,
    )
    # spawn, not fork: the parent runs Prefect's threads, and forking those can deadlock.
    with ProcessPoolExecutor(n_workers, mp_context=mp.get_context("spawn")) as pool:
        records = list(
            pool.map(inspect_image, jobs, chunksize=max(1, len(jobs) // (n_workers * 8)))
        )
    accepted = []
    for rec in records:
        if "reason" in rec:
            quarantine.append({"key": rec["key"], "reason": rec["reason"], "detail": rec["detail"]})
        else:
            accepted.append({**rec, "caption": captions.get(rec["key"])})
    listed_keys = {o.key for o in files}
    for key in sorted(set(captions) - listed_keys):
        manifest_problems.append(
            {
                "key": key,
                "reason": "manifest_missing_file",
                "detail": "listed in manifest, not in source",
            }
        )
    for q in quarantine:
        q["step"] = "ingest"
    for q in manifest_problems:
        q["step"] = "ingest-manifest"

    acc_df = pd.DataFrame(accepted, columns=ACCEPTED_COLUMNS).sort_values("key")
    q_df = pd.DataFrame(quarantine + manifest_problems, columns=QUARANTINE_COLUMNS).sort_values(
        "key"
    )
    assert len(acc_df) + len(quarantine) == len(files), (
        "every listed file is accepted or quarantined"
    )
    result = IngestResult(
        ingest_id=ingest_id,
        source=store.url(),
        listed=len(files),
        accepted=len(acc_df),
        quarantined=len(quarantine),
        reasons=dict(Counter(q["reason"] for q in quarantine)),
        manifest_problems=len(manifest_problems),
    )
    # Write into a temporary folder and rename it into place: a crash leaves no half catalog.
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    acc_df.to_parquet(tmp / "accepted.parquet", index=False)
    q_df.to_parquet(tmp / "quarantine.parquet", index=False)
    (tmp / "summary.json").write_text(json.dumps(result.to_dict(), indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    layout.set_latest("catalog", ingest_id)
    return result
