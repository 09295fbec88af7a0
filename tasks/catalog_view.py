"""The catalog view: every accepted and quarantined row of every source ingested into a root.

Each ingest writes the whole view after it (`view_accepted.parquet`, `view_quarantine.parquet`)
next to its own rows, into a folder that is renamed into place only when complete.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd

from tasks.layout import Layout
from tasks.sources import CATALOG_COLUMNS

__all__ = [
    "ACCEPTED_COLUMNS",
    "QUARANTINE_COLUMNS",
    "frame_rows",
    "merge_view",
    "read_view",
    "write_catalog_dir",
]

ACCEPTED_COLUMNS = CATALOG_COLUMNS
QUARANTINE_COLUMNS = [
    "key", "source", "reason", "detail", "step", "unit", "unit_version", "ingest_id",
]  # fmt: skip


def read_view(layout: Layout, ingest_id: str | None) -> tuple[pd.DataFrame, pd.DataFrame, int]:
    """(accepted, quarantine, ingest_seq) of the view after `ingest_id`; empty when None."""
    if ingest_id is None:
        return (
            pd.DataFrame(columns=ACCEPTED_COLUMNS),
            pd.DataFrame(columns=QUARANTINE_COLUMNS),
            0,
        )
    cat = layout.catalog(ingest_id)
    summary = json.loads((cat / "summary.json").read_text())
    return (
        pd.read_parquet(cat / "view_accepted.parquet"),
        pd.read_parquet(cat / "view_quarantine.parquet"),
        int(summary.get("ingest_seq", 0)),
    )


def merge_view(
    view_acc: pd.DataFrame,
    view_q: pd.DataFrame,
    src: str,
    stale: set[str],
    acc_df: pd.DataFrame,
    q_df: pd.DataFrame,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(accepted, quarantine) of the new view: other sources untouched; the `stale` units of
    `src` (changed or removed) and its manifest problems replaced by this run's rows."""
    keep_acc = view_acc[~((view_acc["source"] == src) & view_acc["unit"].isin(stale))]
    keep_q = view_q[
        ~(
            (view_q["source"] == src)
            & (view_q["unit"].isin(stale) | view_q["step"].eq("ingest-manifest"))
        )
    ]
    return _concat(keep_acc, acc_df), _concat(keep_q, q_df)


def frame_rows(rows: list[dict], columns: list[str]) -> pd.DataFrame:
    """Rows as a frame with `columns` first (absent ones null), sorted by key."""
    df = pd.DataFrame(rows)
    for c in columns:
        if c not in df.columns:
            df[c] = None
    extra = [c for c in df.columns if c not in columns]
    df = df[columns + extra]
    return df.sort_values("key", kind="stable").reset_index(drop=True) if len(df) else df


def write_catalog_dir(out: Path, tables: dict[str, pd.DataFrame], summary: dict) -> None:
    """`<name>.parquet` per table plus `summary.json`, in a folder renamed into place: a crash
    leaves no half catalog."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, df in tables.items():
        df.to_parquet(tmp / f"{name}.parquet", index=False)
    (tmp / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def _concat(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    frames = [f for f in (a, b) if len(f)]
    if not frames:
        return b if len(b.columns) >= len(a.columns) else a
    out = pd.concat(frames, ignore_index=True)
    return out.sort_values(["source", "key"], kind="stable").reset_index(drop=True)
