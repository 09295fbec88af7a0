"""Validate: run the Great Expectations suite on a catalog and quarantine the failing rows.

The suite runs on the current catalog view (every source ingested into the root), so exact
and near duplicates are caught across runs. Outputs are listed in `validate_catalog`; the
quarantine is written before the gate is checked, so a failing gate still leaves every reason
on disk.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd
from prefect import task
from prefect.cache_policies import NO_CACHE

from data_quality.rules import QualityConfig
from data_quality.suite import INGEST_REASONS, REASONS, run_suite
from tasks.layout import Layout
from tasks.logs import task_logger

__all__ = ["QualityGateError", "ValidateResult", "validate_catalog", "reasons_table"]


class QualityGateError(RuntimeError):
    """Too large a fraction of the input was rejected."""


@dataclass
class ValidateResult:
    ingest_id: str
    listed: int
    clean: int
    rejected_ingest: int
    rejected_validate: int
    reject_fraction: float
    max_reject_fraction: float
    reasons: dict[str, int] = field(default_factory=dict)
    manifest_problems: int = 0
    near_duplicates: int = 0
    expectations: list[dict] = field(default_factory=list)
    data_docs: str | None = None

    @property
    def passed(self) -> bool:
        return self.reject_fraction <= self.max_reject_fraction

    def to_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def reasons_table(result: ValidateResult) -> str:
    """A markdown table of quarantine reasons with counts."""
    lines = ["| reason | files | meaning |", "|---|---:|---|"]
    for reason, n in sorted(result.reasons.items(), key=lambda kv: -kv[1]):
        meaning = REASONS.get(reason) or INGEST_REASONS.get(reason, "")
        lines.append(f"| `{reason}` | {n} | {meaning} |")
    return "\n".join(lines)


def _write_parquet(df: pd.DataFrame, path: Path) -> None:
    tmp = path.with_suffix(".parquet.tmp")
    df.to_parquet(tmp, index=False)
    tmp.replace(path)


@task(name="validate-catalog", cache_policy=NO_CACHE)
def validate_catalog(root: str, ingest_id: str, rules: QualityConfig) -> ValidateResult:
    """Run the suite on the view after `ingest_id`; raise QualityGateError past the threshold.

    Writes `catalog/<ingest_id>/clean.parquet` and, in `quality/<ingest_id>/`, the Data Docs
    site, `quarantine.parquet` (every quarantined row of the view, ingest and validate steps)
    and `summary.json`. All of it is written before the gate is checked.
    """
    layout = Layout(Path(root))
    cat = layout.catalog(ingest_id)
    if not (cat / "view_accepted.parquet").is_file():
        raise FileNotFoundError(
            f"no catalog view for ingest {ingest_id} under {root}: run `kiln ingest` first"
        )
    accepted = pd.read_parquet(cat / "view_accepted.parquet")
    ingest_q = pd.read_parquet(cat / "view_quarantine.parquet")
    qdir = layout.quality(ingest_id)
    shutil.rmtree(qdir, ignore_errors=True)  # a re-run rebuilds the docs, never appends
    qdir.mkdir(parents=True)
    verdict = run_suite(accepted, rules, docs_dir=qdir)

    new = verdict.rejected.assign(step="validate", ingest_id=ingest_id)
    quarantine = pd.concat([f for f in (ingest_q, new) if len(f)] or [new], ignore_index=True)
    quarantine = quarantine.sort_values(["source", "key"], kind="stable").reset_index(drop=True)
    _write_parquet(quarantine, qdir / "quarantine.parquet")
    _write_parquet(verdict.clean, cat / "clean.parquet")

    files_q = quarantine[~quarantine["step"].eq("ingest-manifest")]
    listed = len(accepted) + int(ingest_q["step"].eq("ingest").sum())
    result = ValidateResult(
        ingest_id=ingest_id,
        listed=listed,
        clean=len(verdict.clean),
        rejected_ingest=listed - len(accepted),
        rejected_validate=len(new),
        reject_fraction=round(len(files_q) / listed, 4) if listed else 0.0,
        max_reject_fraction=rules.max_reject_fraction,
        reasons=files_q["reason"].value_counts().to_dict(),
        manifest_problems=int(quarantine["step"].eq("ingest-manifest").sum()),
        near_duplicates=verdict.near_duplicates,
        expectations=verdict.expectations,
        data_docs=verdict.docs_index,
    )
    assert result.clean + len(files_q) == listed, "clean + quarantined must equal files listed"
    (qdir / "summary.json").write_text(json.dumps(result.to_dict(), indent=2))
    if not result.passed:
        raise QualityGateError(
            f"quality gate failed for {ingest_id}: rejected {len(files_q)}/{listed} files "
            f"({result.reject_fraction:.1%}) > quality.max_reject_fraction "
            f"({rules.max_reject_fraction:.1%})\n{reasons_table(result)}\n"
            f"quarantine: {qdir / 'quarantine.parquet'}"
        )
    task_logger(__name__).info(
        "validated %s: %d clean, %d quarantined", ingest_id, result.clean, len(files_q)
    )
    return result
