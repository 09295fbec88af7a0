"""Ingest flow: catalog a source folder or bucket into `<root>/catalog/<ingest_id>/`."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from kiln_config import PipelineConfig
from tasks.ingest.run import ingest_source
from tasks.inputs import as_config
from tasks.registry.new_data import emit_ingest_completed, new_data, root_resource_id
from tasks.reports import ingest_report, new_data_report

__all__ = ["ingest_flow", "root_resource_id"]  # the event's resource id, for serve.py


@flow(name="kiln-ingest", log_prints=True)
def ingest_flow(
    config: PipelineConfig | str,
    root: str | None = None,
    source: str | None = None,
    standalone: bool = True,
) -> dict:
    """List the source, decode every image, write accepted and quarantine tables, and emit
    `kiln.ingest.completed` (tasks/registry/new_data.py), which starts a retrain when enough new
    images arrived since the last training.

    Args:
        config: The loaded config (checked by the caller), or a pipeline YAML path.
        root: With a path: overrides `storage.root`.
        source: With a path: overrides `ingest.source` (a local folder or s3://bucket/prefix).
        standalone: False when a pipeline runs this ingest as its first step: its event then
            never makes a retrain due (the pipeline is the training).
    """
    cfg = as_config(config, ("ingest",), root=root, source=source)
    result = ingest_source(
        cfg.ingest,
        cfg.storage.root,
        endpoint_url=cfg.storage.endpoint_url,
        dask_address=cfg.execution.dask_address,
    )
    fresh = new_data(cfg.storage.root, result.ingest_id, result.decoded_accepted,
                     cfg.retrain.min_new_images, standalone)  # fmt: skip
    emit_ingest_completed(cfg.storage.root, fresh)
    create_markdown_artifact(
        key="ingest-summary",
        description=f"Ingest {result.ingest_id}",
        markdown=ingest_report(result) + new_data_report(fresh),
    )
    return {**result.to_dict(), "new_data": fresh.to_dict()}
