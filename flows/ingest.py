"""Ingest flow: catalog a source folder or bucket into `<root>/catalog/<ingest_id>/`."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from data_quality.suite import INGEST_REASONS
from flows.config import ConfigError, load_config
from tasks.ingest import IngestResult, ingest_source

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
    if not cfg.ingest.source:
        raise ConfigError("ingest.source is not set: pass --source or set ingest.source")
    ic = cfg.ingest
    result = ingest_source(
        ic.source,
        cfg.storage.root,
        layout=ic.layout,
        metadata_file=ic.metadata_file,
        caption_column=ic.caption_column,
        metadata_columns=tuple(ic.metadata_columns),
        image_extensions=tuple(ic.image_extensions),
        max_pixels=ic.max_pixels,
        workers=ic.workers,
        partition_size=ic.partition_size,
        endpoint_url=cfg.storage.endpoint_url,
        dask_address=cfg.execution.dask_address,
    )
    create_markdown_artifact(
        key="ingest-summary", description=f"Ingest {result.ingest_id}", markdown=_report(result)
    )
    return result.to_dict()


def _report(r: IngestResult) -> str:
    reasons = "\n".join(
        f"| `{k}` | {v} | {INGEST_REASONS.get(k, '')} |" for k, v in sorted(r.reasons.items())
    )
    state = (
        "unchanged, nothing decoded"
        if r.reused
        else (
            f"{r.new_items} new or changed items decoded ({r.decoded_accepted} accepted, "
            f"{r.decoded_quarantined} quarantined), {r.unchanged_items} unchanged, "
            f"{r.removed_items} removed"
        )
    )
    return (
        f"## Ingest `{r.ingest_id}` ({r.layout} layout)\n\n"
        f"Source `{r.source}`: {state}.\n\n"
        f"**{r.listed}** items listed = **{r.accepted}** accepted + **{r.quarantined}** "
        f"quarantined. Manifest problems: {r.manifest_problems}. The catalog view of this root "
        f"now holds {r.view_accepted} accepted rows.\n\n"
        f"| reason | items | meaning |\n|---|---:|---|\n{reasons or '| - | 0 | |'}\n"
    )
