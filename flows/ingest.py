"""Ingest flow: catalog a source folder or bucket into `<root>/catalog/<ingest_id>/`."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from kiln_config import PipelineConfig
from tasks.catalog.upkeep import compact_after_ingest
from tasks.ingest.run import ingest_source
from tasks.registry.new_data import emit_ingest_completed, new_data, root_resource_id
from tasks.reports import compaction_report, ingest_report, new_data_report

__all__ = ["ingest_flow", "root_resource_id"]  # the event's resource id, for serve.py


@flow(name="kiln-ingest", log_prints=True)
def ingest_flow(
    config: PipelineConfig,
    standalone: bool = True,
) -> dict:
    """List the source, decode every image, write accepted and quarantine tables, compact
    them after every `ingest.compact_every`-th ingest (tasks/catalog/upkeep.py; a failed
    compaction is a warning, never a failed ingest), and emit `kiln.ingest.completed`
    (tasks/registry/new_data.py), which starts a retrain when enough new images arrived since
    the last training.

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
    compaction = compact_after_ingest(
        config.storage.root,
        result.ingest_id,
        result.reused,
        every=config.ingest.compact_every,
        retain_hours=config.ingest.compact_retain_hours,
        tracking_uri=config.tracking_uri,
        model_name=config.registry.model_name,
    )
    fresh = new_data(
        config.storage.root,
        result.ingest_id,
        result.decoded_accepted,
        config.retrain.min_new_images,
        standalone,
    )
    emit_ingest_completed(config.storage.root, fresh)
    create_markdown_artifact(
        key="ingest-summary",
        description=f"Ingest {result.ingest_id}",
        markdown=ingest_report(result) + compaction_report(compaction) + new_data_report(fresh),
    )
    return {**result.to_dict(), "new_data": fresh.to_dict(), "compaction": compaction}
