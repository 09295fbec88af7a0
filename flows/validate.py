"""Validate flow: the Great Expectations quality gate over the newest (or a given) catalog.

Pass or fail, the step's Data Docs go to an MLflow run of their own, so that the quality-gate
artifact links them over http; when that fails, the artifact shows their path on disk.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from kiln_config import PipelineConfig
from tasks.quality.validate import validate_catalog
from tasks.registry.tracking import log_data_docs
from tasks.reports import quality_report
from tasks.storage.layout import Layout

__all__ = ["validate_flow"]


@flow(name="kiln-validate", log_prints=True)
def validate_flow(
    config: PipelineConfig,
    ingest_id: str | None = None,
    allow_failed_gate: bool = False,
) -> dict:
    """Run the catalog suite; quarantine failing rows; fail past quality.max_reject_fraction.

    Args:
        config: The loaded config.
        ingest_id: Catalog to validate; default the newest ingest.
        allow_failed_gate: Log a failed gate instead of failing (the verdict still records
            the failure; the pipeline passes this when it is told to shard regardless).
    """
    layout = Layout(Path(config.storage.root))
    ingest_id = ingest_id or layout.latest("catalog", "validate")
    try:
        result = validate_catalog(
            config.storage.root,
            ingest_id,
            config.quality,
            allow_failed_gate=allow_failed_gate,
            dask_address=config.execution.dask_address,
            launch=config.launch,
            endpoint_url=config.storage.endpoint_url,
        )
        return result.to_dict()
    finally:
        qdir = layout.quality(ingest_id)
        if (qdir / "summary.json").is_file():
            summary = json.loads((qdir / "summary.json").read_text())
            docs_url = log_data_docs(
                config.tracking_uri,
                config.registry.experiment,
                ingest_id,
                str(qdir),
                summary,
                artifact_root=str(layout.mlflow_artifacts()),
            )
            create_markdown_artifact(
                key="quality-gate",
                description=f"Quality gate for {ingest_id}",
                markdown=quality_report(summary, docs_url=docs_url),
            )
