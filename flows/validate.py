"""Validate flow: the Great Expectations quality gate over the newest (or a given) catalog."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from flows.config import load_config
from tasks.layout import Layout
from tasks.quality import ValidateResult, reasons_table, validate_catalog

__all__ = ["validate_flow"]


def _report(summary: dict) -> str:
    result = ValidateResult(**{k: v for k, v in summary.items() if k != "passed"})
    rows = "\n".join(
        f"| `{e['expectation']}` | `{e['column']}` | {'pass' if e['success'] else 'FAIL'} "
        f"| {e['unexpected']} |"
        for e in result.expectations
    )
    verdict = "passed" if result.passed else "FAILED"
    docs = (
        f"Data Docs: [{result.data_docs}](file://{result.data_docs})\n\n"
        if result.data_docs
        else ""
    )
    return (
        f"## Quality gate {verdict} for `{result.ingest_id}`\n\n{docs}"
        f"{result.listed} files listed: **{result.clean} clean**, "
        f"{result.rejected_ingest} quarantined at ingest, {result.rejected_validate} by the "
        f"suite. Rejected fraction {result.reject_fraction:.1%} (limit "
        f"{result.max_reject_fraction:.1%}). Near-duplicates flagged: "
        f"{result.near_duplicates}. Manifest problems: {result.manifest_problems}.\n\n"
        f"### Quarantine reasons\n{reasons_table(result)}\n\n"
        f"### Expectations\n| expectation | column | result | rows |\n|---|---|---|---:|\n{rows}\n"
    )


@flow(name="kiln-validate", log_prints=True)
def validate_flow(config_path: str, root: str | None = None, ingest_id: str | None = None) -> dict:
    """Run the catalog suite; quarantine failing rows; fail past quality.max_reject_fraction.

    Args:
        config_path: Pipeline YAML.
        root: Overrides `storage.root`.
        ingest_id: Catalog to validate; default the newest ingest.
    """
    cfg = load_config(config_path, root=root)
    layout = Layout(Path(cfg.storage.root))
    ingest_id = ingest_id or layout.latest("catalog", "validate")
    try:
        result = validate_catalog(cfg.storage.root, ingest_id, cfg.quality)
        return result.to_dict()
    finally:
        summary = layout.quality(ingest_id) / "summary.json"
        if summary.is_file():
            create_markdown_artifact(
                key="quality-gate",
                description=f"Quality gate for {ingest_id}",
                markdown=_report(json.loads(summary.read_text())),
            )
