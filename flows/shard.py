"""Shard flow: one MDS dataset per training stage from the newest (or a given) clean catalog."""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from flows.train import resolve_warm_start
from kiln_config import PipelineConfig, PrecomputeRun, encoder_key
from tasks.launch.accelerate import launch_precompute
from tasks.reports import shards_report
from tasks.shards.publish import publish_shards
from tasks.shards.vae_folder import resolve_fitted_vae, vae_from_pipeline
from tasks.shards.write import write_shards
from tasks.storage.layout import Layout

__all__ = ["shard_flow"]


@flow(name="kiln-shard", log_prints=True)
def shard_flow(
    config: PipelineConfig,
    ingest_id: str | None = None,
    allow_failed_gate: bool = False,
    dry_run: bool = False,
) -> dict:
    """Write `<root>/shards/<dataset_version>/<resolution>/` for every stage resolution (and
    its held-out validation split, `<resolution>-val/`), with `shards.precompute` their
    latents, and publish the version to `shards.remote` when it is set.

    Args:
        config: The loaded config, its `shard` inputs checked by the caller.
        ingest_id: Validated catalog to shard; default the newest ingest.
        allow_failed_gate: Shard a catalog that failed the quality gate (or has no verdict);
            the override is recorded in the dataset's shards.json.
        dry_run: Plan only: the dataset version and each stage's image counts.
    """
    cfg = config
    layout = Layout(Path(cfg.storage.root))
    ingest_id = ingest_id or layout.latest("catalog", "shard")
    result = write_shards(
        cfg.shards,
        cfg.storage.root,
        ingest_id,
        [s.resolution for s in cfg.train.stages],
        endpoint_url=cfg.storage.endpoint_url,
        dask_address=cfg.execution.dask_address,
        bucket_stages=cfg.bucket_stages(),
        tokenizer=cfg.train.model.tokenizer.model_dump() if cfg.shards.token_ids else None,
        allow_failed_gate=allow_failed_gate,
        dry_run=dry_run,
    )
    if dry_run:
        return result.to_dict()
    if cfg.shards.precompute:
        # The latents are encoded with the VAE that training will load (a `fit` one: fitted
        # on this version, cached, and found again by the train flow under the same key).
        # A warm start encodes with the VAE of the model it starts from (flows/train.py).
        if cfg.train.init_from_model and cfg.train.model.vae.fit is not None:
            warm = resolve_warm_start(cfg, layout)["folder"]
            train = vae_from_pipeline(cfg.train, warm)
        else:
            train = resolve_fitted_vae(cfg.train, cfg.storage.root, result.dataset_version)
        cfg = cfg.model_copy(update={"train": train})  # the caller's config stays as given
        for i, stage in enumerate(cfg.train.stages):
            version, res = result.dataset_version, stage.resolution
            images = layout.shards(version, res)
            out = layout.latents(version, res, encoder_key(cfg))
            # The held-out split, when the stage has one, is encoded in the same launch.
            val = layout.val_shards(version, res) if result.stages[res]["val_samples"] else None
            val_out = layout.val_latents(version, res, encoder_key(cfg)) if val else None
            run = PrecomputeRun(
                train=cfg.train,
                stage_index=i,
                shards=str(images),
                out_dir=str(out),
                val_shards=val and str(val),
                val_out_dir=val_out and str(val_out),
                text=cfg.shards.precompute_text,
            )
            launch_precompute.with_options(name=f"precompute-{res}px")(run, cfg.launch)
            result.stages[res]["latents"] = str(out)
            if val_out:
                result.stages[res]["val_latents"] = str(val_out)
    pub = None
    if cfg.shards.remote:
        pub = publish_shards(
            cfg.storage.root, result.dataset_version, cfg.shards.remote, cfg.storage.endpoint_url
        )
    create_markdown_artifact(
        key="shards",
        description=f"Dataset {result.dataset_version}",
        markdown=shards_report(result, ingest_id, str(layout.shards(result.dataset_version)), pub),
    )
    out = result.to_dict()
    if cfg.shards.remote:
        out["remote"] = pub["remote"]
    return out
