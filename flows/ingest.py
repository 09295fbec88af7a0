"""Ingest flow: catalog a source folder or bucket into `<root>/catalog/<ingest_id>/`."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from flows.config import check_inputs, load_config
from tasks.ingest import ingest_source
from tasks.reports import ingest_report

__all__ = ["ingest_flow"]


@flow(name="kiln-ingest", log_prints=True)
def ingest_flow(config_path: str, root: str | None = None, source: str | None = None) -> dict:
    """List the source, decode every image, write accepted and quarantine tables.

    Args:
        config_path: Pipeline YAML.
        root: Overrides `storage.root`.
        source: Overrides `ingest.source` (a local folder or s3://bucket/prefix).
    """
    cfg = load_config(config_path, root=root, source=source)
    check_inputs(cfg, ("ingest",))
    result = ingest_source(
        cfg.ingest,
        cfg.storage.root,
        endpoint_url=cfg.storage.endpoint_url,
        dask_address=cfg.execution.dask_address,
    )
    create_markdown_artifact(
        key="ingest-summary",
        description=f"Ingest {result.ingest_id}",
        markdown=ingest_report(result),
    )
    return result.to_dict()
