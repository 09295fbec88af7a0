"""Validate: run the Great Expectations suite on a catalog and quarantine the failing rows.

Writes `<root>/catalog/<ingest_id>/clean.parquet`, adds the rejected rows (step `validate`) to
`quarantine.parquet`, and writes `<root>/quality/<ingest_id>/summary.json`. The quarantine is
written before the gate is checked, so a failing gate still leaves every reason on disk.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd
from prefect import task
from prefect.cache_policies import NO_CACHE

from data_quality.suite import REASONS, run_suite
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
    expectations: list[dict] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.reject_fraction <= self.max_reject_fraction

    def to_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def reasons_table(result: ValidateResult) -> str:
    """A markdown table of quarantine reasons with counts."""
    lines = ["| reason | files | meaning |", "|---|---:|---|"]
    for reason, n in sorted(result.reasons.items(), key=lambda kv: -kv[1]):
        lines.append(f"| `{reason}` | {n} | {REASONS.get(reason, '')} |")
    return "\n".join(lines)


def _write_parquet(df: pd.DataFrame, path: Path) -> None:
    tmp = path.with_suffix(".parquet.tmp")
    df.to_parquet(tmp, index=False)
    tmp.replace(path)


@task(name="validate-catalog", cache_policy=NO_CACHE)
def validate_catalog(
    root: str, ingest_id: str, *, min_side: int, max_reject_fraction: float
) -> ValidateResult:
    """Run the suite on `ingest_id`'s accepted rows; raise QualityGateError past the threshold."""
    layout = Layout(Path(root))
    cat = layout.catalog(ingest_id)
    summary = json.loads((cat / "summary.json").read_text())
    accepted = pd.read_parquet(cat / "accepted.parquet")
    verdict = run_suite(accepted, min_side=min_side)

    quarantine = pd.read_parquet(cat / "quarantine.parquet")
    quarantine = quarantine[quarantine["step"] != "validate"]  # re-runs replace, never append twice
    new = verdict.rejected.assign(step="validate")
    quarantine = pd.concat([quarantine, new], ignore_index=True).sort_values("key")
    _write_parquet(quarantine, cat / "quarantine.parquet")
    _write_parquet(verdict.clean, cat / "clean.parquet")

    files_q = quarantine[~quarantine["step"].eq("ingest-manifest")]
    listed = summary["listed"]
    result = ValidateResult(
        ingest_id=ingest_id,
        listed=listed,
        clean=len(verdict.clean),
        rejected_ingest=summary["quarantined"],
        rejected_validate=len(new),
        reject_fraction=round(len(files_q) / listed, 4) if listed else 0.0,
        max_reject_fraction=max_reject_fraction,
        reasons=files_q["reason"].value_counts().to_dict(),
        expectations=verdict.expectations,
    )
    assert result.clean + len(files_q) == listed, "clean + quarantined must equal files listed"
    qdir = layout.quality(ingest_id)
    qdir.mkdir(parents=True, exist_ok=True)
    (qdir / "summary.json").write_text(json.dumps(result.to_dict(), indent=2))
    if not result.passed:
        raise QualityGateError(
            f"quality gate failed for {ingest_id}: rejected {len(files_q)}/{listed} files "
            f"({result.reject_fraction:.1%}) > quality.max_reject_fraction "
            f"({max_reject_fraction:.1%})\n{reasons_table(result)}\n"
            f"quarantine: {cat / 'quarantine.parquet'}"
        )
    task_logger(__name__).info(
        "validated %s: %d clean, %d quarantined", ingest_id, result.clean, len(files_q)
    )
    return result
