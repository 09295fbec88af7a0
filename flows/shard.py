"""Shard flow: one MDS dataset per training stage from the newest (or a given) clean catalog."""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from flows.config import check_inputs, encoder_key, load_config
from models.config import StageRun
from tasks.launch import launch_precompute
from tasks.layout import Layout
from tasks.publish import publish_shards
from tasks.shard import write_shards

__all__ = ["shard_flow"]


@flow(name="kiln-shard", log_prints=True)
def shard_flow(config_path: str, root: str | None = None, ingest_id: str | None = None) -> dict:
    """Write `<root>/shards/<dataset_version>/<resolution>/` for every stage resolution, and
    publish the version to `shards.remote` when it is set.

    Args:
        config_path: Pipeline YAML.
        root: Overrides `storage.root`.
        ingest_id: Validated catalog to shard; default the newest ingest.
    """
    cfg = load_config(config_path, root=root)
    layout = Layout(Path(cfg.storage.root))
    ingest_id = ingest_id or layout.latest("catalog", "shard")
    cat = layout.catalog(ingest_id)
    if not (cat / "clean.parquet").is_file():
        raise FileNotFoundError(
            f"catalog {ingest_id} has not been validated ({cat / 'clean.parquet'} missing): "
            "run `kiln validate` first"
        )
    result = write_shards(
        cfg.storage.root,
        ingest_id,
        [s.resolution for s in cfg.train.stages],
        min_side_factor=cfg.shards.min_side_factor,
        jpeg_quality=cfg.shards.jpeg_quality,
        image_format=cfg.shards.image_format,
        size_limit=cfg.shards.size_limit,
        workers=cfg.shards.workers,
        partition_size=cfg.shards.partition_size,
        endpoint_url=cfg.storage.endpoint_url,
        dask_address=cfg.execution.dask_address,
        bucket_stages=cfg.bucket_stages(),
        bucket_step=cfg.shards.bucket_step,
        bucket_max_aspect=cfg.shards.bucket_max_aspect,
        tokenizer=cfg.train.model.tokenizer.model_dump() if cfg.shards.token_ids else None,
    )
    if cfg.shards.precompute:
        check_inputs(cfg, ("train",))
        for i, stage in enumerate(cfg.train.stages):
            images = layout.shards(result.dataset_version, stage.resolution)
            out = layout.latents(result.dataset_version, stage.resolution, encoder_key(cfg))
            spec = StageRun(train=cfg.train, stage_index=i, shards=str(images),
                            output_dir=str(out.parent))  # fmt: skip
            launch_precompute.with_options(name=f"precompute-{stage.resolution}px")(
                spec, str(out), cfg.launch.accelerate_config,
                text=cfg.shards.precompute_text, num_processes=cfg.launch.num_processes,
            )  # fmt: skip
            result.stages[stage.resolution]["latents"] = str(out)
    published = ""
    if cfg.shards.remote:
        pub = publish_shards(
            cfg.storage.root, result.dataset_version, cfg.shards.remote, cfg.storage.endpoint_url
        )
        published = (f"Published to `{pub['remote']}`: {pub['uploaded']} objects "
                     f"({pub['bytes'] / 1e6:.2f} MB) sent; {pub['already_there']} were there "
                     "already.\n\n")  # fmt: skip
    rows = "\n".join(
        f"| {r}px | {s['samples']} | {s['shards']} | {s['bytes'] / 1e6:.2f} MB | "
        f"{', '.join(f'{b}: {n}' for b, n in s.get('buckets', {}).items()) or 'square'} |"
        for r, s in result.stages.items()
    )
    create_markdown_artifact(
        key="shards",
        description=f"Dataset {result.dataset_version}",
        markdown=(
            f"## Dataset `{result.dataset_version}`{' (reused)' if result.reused else ''}\n\n"
            f"From catalog `{ingest_id}`, at `{layout.shards(result.dataset_version)}`.\n\n"
            f"{published}"
            f"| stage | samples | shards | bytes | buckets |\n|---|---:|---:|---:|---|\n{rows}\n"
        ),
    )
    out = result.to_dict()
    if cfg.shards.remote:
        out["remote"] = pub["remote"]
    return out
