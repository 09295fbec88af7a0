"""Validate: run the Great Expectations suite on a catalog and quarantine the failing rows.

The suite runs on the current catalog view (every source ingested into the root), so exact
and near duplicates are caught across runs. Outputs are listed in `validate_catalog`; the
quarantine is written before the gate is checked, so a failing gate still leaves every reason
on disk. The gate's verdict is written with the catalog (`catalog/<ingest_id>/verdict.json`),
and the shard step refuses a catalog whose verdict is missing or failed unless told otherwise
(`gate_for_sharding`): `clean.parquet` existing says nothing about whether it passed.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd
from prefect import task
from prefect.cache_policies import NO_CACHE

from data_quality.rules import QualityConfig
from data_quality.suite import INGEST_REASONS, REASONS, run_suite
from tasks.layout import Layout
from tasks.logs import task_logger

__all__ = [
    "VERDICT_FILE", "QualityGateError", "ValidateResult", "gate_for_sharding", "read_verdict",
    "reasons_table", "validate_catalog",
]  # fmt: skip

VERDICT_FILE = "verdict.json"  # in catalog/<ingest_id>/, beside clean.parquet
OVERRIDE_FLAG = "--allow-failed-gate"


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


def reasons_table(reasons: dict[str, int]) -> str:
    """A markdown table of quarantine reasons ({reason: files}) with counts."""
    lines = ["| reason | files | meaning |", "|---|---:|---|"]
    for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
        meaning = REASONS.get(reason) or INGEST_REASONS.get(reason, "")
        lines.append(f"| `{reason}` | {n} | {meaning} |")
    return "\n".join(lines)


def _write_parquet(df: pd.DataFrame, path: Path) -> None:
    tmp = path.with_suffix(".parquet.tmp")
    df.to_parquet(tmp, index=False)
    tmp.replace(path)


def _write_verdict(path: Path, result: ValidateResult) -> None:
    """The gate's verdict, written atomically (a reader sees the old file or the new one)."""
    verdict = {
        "ingest_id": result.ingest_id,
        "passed": result.passed,
        "reject_fraction": result.reject_fraction,
        "max_reject_fraction": result.max_reject_fraction,
        "listed": result.listed,
        "clean": result.clean,
        "reasons": result.reasons,
        "validated_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(verdict, indent=2))
    tmp.replace(path)


def read_verdict(root: str, ingest_id: str) -> dict | None:
    """The quality verdict recorded with a catalog, or None when it was never validated."""
    path = Layout(Path(root)).catalog(ingest_id) / VERDICT_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def gate_for_sharding(root: str, ingest_id: str, *, allow_failed_gate: bool = False) -> dict:
    """Check the catalog's recorded verdict before it is sharded; return its lineage record.

    The record (`passed`, `overridden`, reject fraction, limit and reasons) goes into the
    dataset version's `shards.json`.

    Raises:
        QualityGateError: the verdict failed or is missing, and `allow_failed_gate` is false.
    """
    log = task_logger(__name__)
    path = Layout(Path(root)).catalog(ingest_id) / VERDICT_FILE
    verdict = read_verdict(root, ingest_id)
    if verdict is None:
        if not allow_failed_gate:
            raise QualityGateError(
                f"catalog {ingest_id} has no quality verdict ({path} missing): run "
                f"`kiln validate` first, or pass {OVERRIDE_FLAG} (allow_failed_gate) to shard "
                "it unchecked"
            )
        log.warning("sharding %s without a quality verdict (%s)", ingest_id, OVERRIDE_FLAG)
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
    log.warning("%s; sharding it anyway (%s)", summary, OVERRIDE_FLAG)
    return {**record, "overridden": True}


@task(name="validate-catalog", cache_policy=NO_CACHE)
def validate_catalog(
    root: str, ingest_id: str, rules: QualityConfig, *, allow_failed_gate: bool = False
) -> ValidateResult:
    """Run the suite on the view after `ingest_id`; raise QualityGateError past the threshold.

    Writes `catalog/<ingest_id>/clean.parquet` and then `catalog/<ingest_id>/verdict.json`
    (passed, reject fraction, limit, reasons) and, in `quality/<ingest_id>/`, the Data Docs
    site, `quarantine.parquet` (every quarantined row of the view, ingest and validate steps)
    and `summary.json`. All of it is written before the gate is checked. With
    `allow_failed_gate` a failed gate is logged instead of raised (the verdict still says
    failed, and the shard step needs the same override).
    """
    layout = Layout(Path(root))
    cat = layout.catalog(ingest_id)
    if not (cat / "view_accepted.parquet").is_file():
        raise FileNotFoundError(
            f"no catalog view for ingest {ingest_id} under {root}: run `kiln ingest` first"
        )
    # An old verdict must never vouch for the clean.parquet this run is about to write.
    (cat / VERDICT_FILE).unlink(missing_ok=True)
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
    _write_verdict(cat / VERDICT_FILE, result)
    if not result.passed:
        msg = (
            f"quality gate failed for {ingest_id}: rejected {len(files_q)}/{listed} files "
            f"({result.reject_fraction:.1%}) > quality.max_reject_fraction "
            f"({rules.max_reject_fraction:.1%})\n{reasons_table(result.reasons)}\n"
            f"quarantine: {qdir / 'quarantine.parquet'}"
        )
        if not allow_failed_gate:
            raise QualityGateError(msg)
        task_logger(__name__).warning("%s\ncontinuing: %s was given", msg, OVERRIDE_FLAG)
        return result
    task_logger(__name__).info(
        "validated %s: %d clean, %d quarantined", ingest_id, result.clean, len(files_q)
    )
    return result
