"""Ingest flow: catalog a source folder or bucket into `<root>/catalog/<ingest_id>/`."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from kiln_config import PipelineConfig
from tasks.ingest.run import ingest_source
from tasks.registry.new_data import emit_ingest_completed, new_data, root_resource_id
from tasks.reports import ingest_report, new_data_report

__all__ = ["ingest_flow", "root_resource_id"]  # the event's resource id, for serve.py


@flow(name="kiln-ingest", log_prints=True)
def ingest_flow(
    config: PipelineConfig,
    standalone: bool = True,
) -> dict:
    """List the source, decode every image, write accepted and quarantine tables, and emit
    `kiln.ingest.completed` (tasks/registry/new_data.py), which starts a retrain when enough new
    images arrived since the last training.

    Args:
        config: The loaded config, its `ingest` inputs checked by the caller.
        standalone: False when a pipeline runs this ingest as its first step: its event then
            never makes a retrain due (the pipeline is the training).
    """
    result = ingest_source(
        config.ingest,
        config.storage.root,
        endpoint_url=config.storage.endpoint_url,
        dask_address=config.execution.dask_address,
    )
    fresh = new_data(config.storage.root, result.ingest_id, result.decoded_accepted,
                     config.retrain.min_new_images, standalone)  # fmt: skip
    emit_ingest_completed(config.storage.root, fresh)
    create_markdown_artifact(
        key="ingest-summary",
        description=f"Ingest {result.ingest_id}",
        markdown=ingest_report(result) + new_data_report(fresh),
    )
    return {**result.to_dict(), "new_data": fresh.to_dict()}
