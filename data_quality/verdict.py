"""The quality gate's face: the verdict a validate writes beside its catalog, the one pass
rule, and what the shard step, the catalog's admin, the registry and the reports read of it.

A validate writes, in the ingest's catalog folder (`catalog/<ingest_id>/`), `verdict.json`
(`write_verdict`: passed, reject fraction, limit, reasons and what the next validate reuses)
last, after its rows (`rejects.parquet`, `near_duplicates.parquet`, `docs_sample.parquet`), so
an old verdict never vouches for new rows. The gate passes when the rejected share of the
listed files is at most `quality.max_reject_fraction` (`passes`); withdrawn and expired rows
(the licensing terms) leave the data but are not counted, as they say nothing of its quality.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd

from data_quality.suite import INGEST_REASONS, REASONS, TERMS_REASONS
from kiln_config import KilnError, QualityConfig

__all__ = [
    "FLAGS_FILE",
    "OVERRIDE_FLAG",
    "REJECTS_FILE",
    "SAMPLE_FILE",
    "VERDICT_FILE",
    "QualityGateError",
    "ValidateResult",
    "gate_for_sharding",
    "passes",
    "read_verdict",
    "reasons_table",
    "result_from_quarantine",
    "write_verdict",
]

VERDICT_FILE = "verdict.json"  # in catalog/<ingest_id>/, beside the three files below
REJECTS_FILE = "rejects.parquet"  # the view's rows the validate step quarantined
FLAGS_FILE = "near_duplicates.parquet"  # near-duplicates kept (not dropped): near_duplicate_of
SAMPLE_FILE = "docs_sample.parquet"  # the failing rows the Data Docs show (bounded)
OVERRIDE_FLAG = "--allow-failed-gate"

log = logging.getLogger("kiln.quality")


class QualityGateError(KilnError, RuntimeError):
    """Too large a fraction of the input was rejected."""


def passes(reject_fraction: float, max_reject_fraction: float) -> bool:
    """The gate's rule: the rejected share of the listed files is within the limit."""
    return reject_fraction <= max_reject_fraction


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
    checked_rows: int = 0  # rows the row-local rules ran on in this run
    incremental_from: str | None = None  # the verdict whose checked rows this run kept
    takedowns: int = 0  # rows quarantined as on the takedown list
    license_expired: int = 0  # rows quarantined as their license had ended (or had no date)

    @property
    def passed(self) -> bool:
        return passes(self.reject_fraction, self.max_reject_fraction)

    @classmethod
    def from_dict(cls, summary: dict) -> ValidateResult:
        """The result a `to_dict` wrote (`summary.json`), its derived `passed` dropped."""
        return cls(**{k: v for k, v in summary.items() if k != "passed"})

    def to_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}

    def failure(self, quarantine: Path) -> str:
        """Why the gate failed, with its reasons and where the quarantine is."""
        return (
            f"quality gate failed for {self.ingest_id}: rejected {self.listed - self.clean}/"
            f"{self.listed} files ({self.reject_fraction:.1%}) > quality.max_reject_fraction "
            f"({self.max_reject_fraction:.1%})\n{reasons_table(self.reasons)}\n"
            f"quarantine: {quarantine}"
        )


def reasons_table(reasons: dict[str, int]) -> str:
    """A markdown table of quarantine reasons ({reason: files}) with counts."""
    lines = ["| reason | files | meaning |", "|---|---:|---|"]
    for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
        meaning = {**INGEST_REASONS, **TERMS_REASONS, **REASONS}.get(reason, "")
        lines.append(f"| `{reason}` | {n} | {meaning} |")
    return "\n".join(lines)


def result_from_quarantine(
    ingest_id: str,
    rows: int,
    rejected: int,
    quarantine: pd.DataFrame,
    rules: QualityConfig,
    **extra,
) -> ValidateResult:
    """The gate's result from the view's rows, the validate step's rejects among them, and
    the quarantine's counts (`step`, `reason`, `n`: the ingest's rows, its manifest's problems
    and the validate step's)."""
    step = quarantine["step"]
    files_q = quarantine[~step.eq("ingest-manifest")]
    listed = rows + int(quarantine.loc[step.eq("ingest"), "n"].sum())
    reasons = files_q.dropna(subset=["reason"]).groupby("reason", sort=False)["n"].sum()
    reasons = reasons.sort_values(ascending=False, kind="stable")
    # Withdrawn and expired rows leave the data, but say nothing of its quality: the gate's
    # fraction counts the other reasons only.
    why = files_q["reason"]
    terms = int(files_q.loc[why.isin(list(TERMS_REASONS)), "n"].sum())
    quarantined = int(files_q["n"].sum())
    result = ValidateResult(
        ingest_id=ingest_id,
        listed=listed,
        clean=rows - rejected,
        rejected_ingest=listed - rows,
        rejected_validate=rejected,
        reject_fraction=round((quarantined - terms) / listed, 4) if listed else 0.0,
        max_reject_fraction=rules.max_reject_fraction,
        reasons={str(r): int(c) for r, c in reasons.items()},
        manifest_problems=int(quarantine.loc[step.eq("ingest-manifest"), "n"].sum()),
        takedowns=int(files_q.loc[why.eq("takedown"), "n"].sum()),
        license_expired=int(
            files_q.loc[why.isin(["license_expired", "license_end_invalid"]), "n"].sum()
        ),
        **extra,
    )
    assert result.clean + quarantined == listed, "clean + quarantined must equal files listed"
    return result


def write_verdict(catalog: Path, result: ValidateResult, **extra) -> None:
    """The gate's verdict in the ingest's catalog folder, written atomically (a reader sees the
    old file or the new one); `extra` is what a later validate reuses."""
    verdict = {
        "ingest_id": result.ingest_id,
        "passed": result.passed,
        "reject_fraction": result.reject_fraction,
        "max_reject_fraction": result.max_reject_fraction,
        "listed": result.listed,
        "clean": result.clean,
        "reasons": result.reasons,
        "validated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        **extra,
    }
    path = Path(catalog) / VERDICT_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(verdict, indent=2))
    tmp.replace(path)


def read_verdict(catalog: Path) -> dict | None:
    """The quality verdict recorded in an ingest's catalog folder, or None when it was never
    validated."""
    path = Path(catalog) / VERDICT_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def gate_for_sharding(
    catalog: Path,
    ingest_id: str,
    *,
    allow_failed_gate: bool = False,
    logger: logging.Logger | logging.LoggerAdapter = log,
) -> dict:
    """Check a catalog's recorded verdict before it is sharded; return its lineage record.

    The record (`passed`, `overridden`, reject fraction, limit and reasons) goes into the
    dataset version's `shards.json`.

    Args:
        catalog: The ingest's catalog folder.
        ingest_id: The ingest, for the messages.
        allow_failed_gate: Shard a failed or unvalidated catalog, with a warning.
        logger: Where that warning goes.

    Raises:
        QualityGateError: the verdict failed or is missing, and `allow_failed_gate` is false.
    """
    path = Path(catalog) / VERDICT_FILE
    verdict = read_verdict(catalog)
    if verdict is None:
        if not allow_failed_gate:
            raise QualityGateError(
                f"catalog {ingest_id} has no quality verdict ({path} missing): run "
                f"`kiln validate` first, or pass {OVERRIDE_FLAG} (allow_failed_gate) to shard "
                "it unchecked"
            )
        logger.warning("sharding %s without a quality verdict (%s)", ingest_id, OVERRIDE_FLAG)
        return {"passed": None, "overridden": True, "verdict": None, "reasons": {}}
    record = {
        "passed": bool(verdict["passed"]),
        "overridden": False,
        "verdict": str(path),
        "reject_fraction": verdict["reject_fraction"],
        "max_reject_fraction": verdict["max_reject_fraction"],
        "reasons": verdict["reasons"],
    }
    if record["passed"]:
        return record
    summary = (
        f"catalog {ingest_id} failed the quality gate: rejected "
        f"{verdict['reject_fraction']:.1%} of {verdict['listed']} files > "
        f"quality.max_reject_fraction ({verdict['max_reject_fraction']:.1%})"
    )
    if not allow_failed_gate:
        raise QualityGateError(
            f"{summary}; refusing to shard it.\n{reasons_table(verdict['reasons'])}\n"
            f"Fix the source or the quality settings and run `kiln validate` again, or pass "
            f"{OVERRIDE_FLAG} (allow_failed_gate) to shard it anyway; the override is recorded "
            "in the dataset's shards.json."
        )
    logger.warning("%s; sharding it anyway (%s)", summary, OVERRIDE_FLAG)
    return {**record, "overridden": True}
