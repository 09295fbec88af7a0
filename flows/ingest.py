"""Ingest flow: catalog a source folder or bucket into `<root>/catalog/<ingest_id>/`."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from flows.config import ConfigError, load_config
from tasks.ingest import ingest_source

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
        metadata_file=ic.metadata_file,
        caption_column=ic.caption_column,
        image_extensions=tuple(ic.image_extensions),
        max_pixels=ic.max_pixels,
        workers=ic.workers,
        endpoint_url=cfg.storage.endpoint_url,
    )
    reasons = (
        "\n".join(f"| `{k}` | {v} |" for k, v in sorted(result.reasons.items())) or "| - | 0 |"
    )
    create_markdown_artifact(
        key="ingest-summary",
        description=f"Ingest {result.ingest_id}",
        markdown=(
            f"## Ingest `{result.ingest_id}`{' (reused)' if result.reused else ''}\n\n"
            f"Source `{result.source}`: **{result.listed}** files listed = "
            f"**{result.accepted}** accepted + **{result.quarantined}** quarantined. "
            f"Manifest problems: {result.manifest_problems}.\n\n"
            f"| reason | files |\n|---|---:|\n{reasons}\n"
        ),
    )
    return result.to_dict()
