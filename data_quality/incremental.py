"""Which of an earlier verdict's work a validate keeps: the rows it checked, and the quarantine
file it built.

A catalog grows by ingests, each a link of the chain (`tasks.catalog.view.chain`). When an
earlier link's verdict was reached under the same suite (`data_quality.suite.suite_key`) and no
accepted row has left the view since, the rows it checked need no second check: only the rows
ingested after it are checked, and compared with the others for duplicates
(`reusable_verdict`). Its quarantine file is merged with the new rows rather than rebuilt when
the view's quarantine rows up to it are the ones it was built from and the licensing terms
quarantine the same rows as then (`mergeable_quarantine`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import pandas as pd
import pyarrow.parquet as pq

from data_quality.suite import TERMS_REASONS
from data_quality.verdict import FLAGS_FILE, REJECTS_FILE, SAMPLE_FILE, read_verdict
from data_quality.verdict_rows import REJECT_SCHEMA

__all__ = ["DataFile", "mergeable_quarantine", "quarantine_record", "reusable_verdict"]


class DataFile(Protocol):
    """One data file of a catalog table (`tasks.catalog.view.ViewPart`): the rows of one
    ingest, `seq`."""

    path: Path
    seq: int


def reusable_verdict(links: Sequence[tuple[dict, Path]], suite: str) -> dict | None:
    """The newest verdict in the chain reached under the suite `suite`, when no accepted row
    left the view after it: its rows need no second check.

    Args:
        links: The chain's links, oldest first, each with its catalog folder.
        suite: The suite key this validate runs under.

    Returns:
        That verdict with its link's `id` and `seq`, the paths of its `rejects` and `flags`,
        and its Data Docs `sample`; None when every row must be checked.
    """
    for link, folder in reversed(links):
        verdict = read_verdict(folder)
        if verdict and verdict.get("suite") == suite and (folder / REJECTS_FILE).is_file():
            return {
                **verdict,
                "id": link["id"],
                "seq": int(link["ingest_seq"]),
                "rejects": folder / REJECTS_FILE,
                "flags": folder / FLAGS_FILE,
                "sample": pd.read_parquet(folder / SAMPLE_FILE),
            }
        if link.get("superseded_accepted", 1):  # older catalogs do not say: assume some left
            return None
    return None


def quarantine_record(table: Path, parts: Sequence[DataFile], rows: int) -> dict:
    """What a verdict's quarantine file was built from: the quarantine table's data files
    (under `table`; Delta never rewrites one in place) and its row count."""
    return {"parts": [[p.seq, p.path.relative_to(table).as_posix()] for p in parts], "rows": rows}


def mergeable_quarantine(
    base: dict | None, path: Path, table: Path, parts: Sequence[DataFile], terms: Path
) -> Path | None:
    """The earlier verdict's quarantine file, when this run's can be merged from it and the
    rows after it (`tasks.quality.verdict_tables.write_quarantine`); None: rebuild it.

    Args:
        base: The verdict kept (`reusable_verdict`), or None.
        path: Its quarantine file (`quality/<its ingest>/quarantine.parquet`).
        table: The quarantine table's folder.
        parts: The view's quarantine data files now.
        terms: The rows the licensing terms quarantine in this run.
    """
    if base is None or "quarantine" not in base:
        return None
    record = base["quarantine"]
    old = [p for p in parts if p.seq <= base["seq"]]
    if not path.is_file() or quarantine_record(table, old, record["rows"]) != record:
        return None
    if pq.ParquetFile(path).metadata.num_rows != record["rows"]:
        return None
    cols = REJECT_SCHEMA.names
    then = pq.read_table(
        base["rejects"], columns=cols, filters=[("reason", "in", sorted(TERMS_REASONS))]
    )
    now = pq.read_table(terms, columns=cols)
    order = [(c, "ascending") for c in cols]
    if not then.cast(REJECT_SCHEMA).sort_by(order).equals(now.cast(REJECT_SCHEMA).sort_by(order)):
        return None
    return path
