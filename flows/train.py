"""Train flow: the resolution stages in order, each one `accelerate launch` of `models.train`.

Stage k+1 starts from stage k's EMA (or raw) weights. Each stage task is retried
`launch.max_restarts` times; a retry resumes from the stage's newest complete checkpoint. A
stage that cannot run as configured (too little data for one batch, or, on GPUs, a step over
`launch.gpu_memory_gb`) fails first, once, before anything is fitted, written or launched.
Passing an existing `run_id` resumes a whole interrupted run: finished stages are skipped.

The config is written once to `<root>/runs/<run_id>/config.yaml` (with the fitted VAE's
folder); a resumed run, evaluation and registration use that snapshot, so edits to the user's
file never change a run that has started. The flow returns the config it trained with under
`"config"`, which the pipeline passes on to evaluate and register. The run's MLflow run ends
FINISHED when every stage is trained, and FAILED (KILLED on cancellation) when the flow fails;
registration logs into it later.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from kiln_config import PipelineConfig, StageRun, encoder_key, run_config, write_snapshot
from kiln_config.errors import InputError, MissingInput
from tasks.evaluation.grid_artifact import sample_grid_report
from tasks.launch.accelerate import launch_stage
from tasks.launch.preflight import preflight, stage_feasibility
from tasks.registry.promotion import PromotionRefused, registered_version
from tasks.registry.tracking import (
    create_training_run,
    log_run_artifact,
    mark_training_run,
    resolve_pipeline,
)
from tasks.reports import stage_report, write_loss_curves
from tasks.shards.publish import publish_shards
from tasks.shards.vae_folder import resolve_fitted_vae, vae_from_pipeline
from tasks.storage.layout import Layout, is_published, new_run_id
from tasks.storage.lock import root_lock

__all__ = ["train_flow"]


def _run_record(
    cfg: PipelineConfig, layout: Layout, run_id: str, version: str, warm: dict | None = None
) -> dict:
    path = layout.run_record(run_id)
    if path.is_file():
        return json.loads(path.read_text())
    shards = json.loads((layout.shards(version) / "shards.json").read_text())
    mlflow_run_id = create_training_run(
        cfg.tracking_uri,
        cfg.registry.experiment,
        run_id,
        params={
            "dataset_version": version,
            "ingest_id": shards["ingest_id"],
            "stages": ",".join(str(s.resolution) for s in cfg.train.stages),
            "accelerate_config": Path(cfg.launch.accelerate_config).name,
            **{
                f"stage{s.resolution}.{k}": v
                for s in cfg.train.stages
                for k, v in s.model_dump().items()
            },
        },
        tags={"kiln.run_id": run_id, "kiln.dataset_version": version},
        artifact_root=str(layout.mlflow_artifacts()),
        dataset=(
            version,
            f"{cfg.shards.remote}/{version}" if cfg.shards.remote else str(layout.shards(version)),
        ),
    )
    record = {
        "run_id": run_id,
        "mlflow_run_id": mlflow_run_id,
        "dataset_version": version,
        "ingest_id": shards["ingest_id"],
        "stages": {},
    }
    if cfg.train.init_from_model:  # resolved once: a resumed run keeps the version it began from
        record["init_from_model"] = warm or resolve_warm_start(cfg, layout)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    return record


def resolve_warm_start(cfg: PipelineConfig, layout: Layout) -> dict:
    """`train.init_from_model` pinned: an alias becomes the version it points at now, and the
    pipeline folder stage 1 loads its UNet from (the run's export when it is under this root,
    else downloaded from the registry into `<root>/models/`).

    Raises:
        ValueError: the alias or version does not exist, or a folder holds no pipeline.
    """
    from mlflow.exceptions import MlflowException

    ref = cfg.train.init_from_model
    out = {"ref": ref}
    if ref.startswith("models:/"):
        from mlflow.tracking import MlflowClient

        client = MlflowClient(cfg.tracking_uri, registry_uri=cfg.tracking_uri)
        try:
            mv = registered_version(client, ref)
        except PromotionRefused as e:  # no such alias or version
            raise InputError(f"train.init_from_model: {e}") from e
        out.update(
            name=mv.name, version=str(mv.version), resolved=f"models:/{mv.name}/{mv.version}"
        )
        ref = out["resolved"]
    try:
        _, folder = resolve_pipeline(ref, cfg.tracking_uri, layout.root)
    except (FileNotFoundError, LookupError, MlflowException) as e:
        raise InputError(f"train.init_from_model {cfg.train.init_from_model}: {e}") from e
    out["folder"] = str(folder)
    get_run_logger().info(
        "warm start: stage 1 starts from %s (%s)", out.get("resolved", ref), folder
    )
    return out


def _mix_shards(cfg: PipelineConfig, layout: Layout, res: int, latents: bool) -> list[str]:
    """Folders of the mixed-in datasets for one stage, of the same kind as the main one."""
    out = []
    for m in cfg.train.mix:
        path = (
            layout.latents(m.dataset_version, res, encoder_key(cfg))
            if latents
            else layout.shards(m.dataset_version, res)
        )
        if not is_published(path):
            kind = "precomputed latents" if latents else "shards"
            raise MissingInput(
                f"train.mix: {m.dataset_version} has no {kind} for {res}px at {path}; shard it "
                "with the same settings (and shards.precompute) first"
            )
        out.append(str(path))
    return out


def _val_shards(
    cfg: PipelineConfig, layout: Layout, version: str, res: int, latents: bool
) -> str | None:
    """The stage's held-out validation split (`tasks.shards.write`), of the same kind as what it
    trains on (precomputed latents or images); None when the version has none for `res`.

    Always the local copy, even when training streams `shards.remote` (the split is small):
    validation on another machine needs `storage.root` mounted there.
    """
    path = (
        layout.val_latents(version, res, encoder_key(cfg))
        if latents
        else layout.val_shards(version, res)
    )
    return str(path) if is_published(path) else None


def _streamed(cfg: PipelineConfig, layout: Layout, shards: Path, mix: list[str]) -> dict:
    """StageRun fields that stream the published copies of `shards` and `mix` (under
    `shards.remote`, as `tasks.shards.publish` lays them out) through `shards.cache_dir`."""
    rel = [Path(p).relative_to(layout.folder("shards")).as_posix() for p in [shards, *mix]]
    remotes = [f"{cfg.shards.remote}/{r}" for r in rel]
    caches = [str(Path(cfg.shards.cache_dir, r)) for r in rel]
    return {
        "shards_remote": remotes[0],
        "shards_cache": caches[0],
        "mix_remotes": remotes[1:],
        "mix_caches": caches[1:],
        "s3_endpoint_url": cfg.storage.endpoint_url,
    }


@flow(name="kiln-train", log_prints=True)
def train_flow(
    config: PipelineConfig,
    dataset_version: str | None = None,
    run_id: str | None = None,
) -> dict:
    """Train every stage and export a StableDiffusionPipeline per stage.

    Args:
        config: The loaded config, its `train` inputs checked by the caller; a resumed run
            uses its own snapshot instead (checked when the run began).
        dataset_version: Shards to train on; default the newest.
        run_id: Resume this run; default a new `run-<UTC timestamp>`.

    Returns:
        The run record (run.json), and under `"config"` the config the run trained with.
    """
    layout = Layout(Path(config.storage.root))
    run_id = run_id or new_run_id()
    # One training writer per root: a second `kiln train`/`kiln run` fails here, at once,
    # naming the first, before it touches LATEST, a run folder or an MLflow run.
    with root_lock(layout.root, f"training run {run_id}"):
        return _train_locked(config, layout, run_id, dataset_version)


def _train_locked(
    cfg: PipelineConfig, layout: Layout, run_id: str, dataset_version: str | None
) -> dict:
    snapshot = layout.run_config(run_id)
    if snapshot.is_file():  # a resumed run keeps the config it started with
        cfg = run_config(cfg, snapshot, get_run_logger())
    version = dataset_version or layout.latest("shards", "train")
    _feasible(cfg, layout, run_id, version)
    # A `train.model.vae.fit` VAE is fitted on this data (once, cached) and the snapshot names
    # its folder, so every stage, resume and export uses the same weights. A warm start keeps
    # the VAE of the model it starts from instead: its UNet learned that latent space.
    warm = None
    if cfg.train.init_from_model and cfg.train.model.vae.fit is not None:
        warm = resolve_warm_start(cfg, layout)
        fitted = vae_from_pipeline(cfg.train, warm["folder"])
    else:
        fitted = resolve_fitted_vae(cfg.train, cfg.storage.root, version)
    if fitted is not cfg.train or not snapshot.is_file():
        cfg = cfg.model_copy(update={"train": fitted})  # the caller's config stays as given
        write_snapshot(cfg, snapshot)
    record = _run_record(cfg, layout, run_id, version, warm)
    if record["dataset_version"] != version and dataset_version is not None:
        raise InputError(
            f"run {run_id} trains on {record['dataset_version']}, not {dataset_version}: "
            "start a new run to train on other data"
        )
    layout.set_latest("runs", run_id)
    mark_training_run(cfg.tracking_uri, record["mlflow_run_id"], "RUNNING")  # also a resume
    try:
        _train_stages(cfg, layout, record)
    except BaseException as e:  # cancellation and interrupts too: never leave it RUNNING
        status = "FAILED" if isinstance(e, Exception) else "KILLED"
        # Plain call: a cancelled flow run may no longer start task runs. A tracking store that
        # fails here too is logged, never raised: the training error is the one to see.
        try:
            mark_training_run.fn(cfg.tracking_uri, record["mlflow_run_id"], status)
        except Exception as mark_error:
            get_run_logger().warning(
                "could not mark MLflow run %s %s: %s", record["mlflow_run_id"], status, mark_error
            )
        raise
    mark_training_run(cfg.tracking_uri, record["mlflow_run_id"], "FINISHED")
    return {**record, "config": cfg}


def _feasible(cfg: PipelineConfig, layout: Layout, run_id: str, version: str) -> None:
    """Fail, before a VAE is fitted, a run folder written or a job launched, when a pending
    stage cannot run as configured (tasks.launch.preflight.stage_feasibility); never retried."""
    pending = [
        i
        for i, s in enumerate(cfg.train.stages)
        if not (layout.stage(run_id, s.resolution) / "manifest.json").is_file()
    ]
    if not pending:
        return
    shards = json.loads((layout.shards(version) / "shards.json").read_text())
    stats = {int(r): st for r, st in shards.get("stages", {}).items()}
    stage_feasibility(cfg.train, cfg.launch, stats, pending, cfg.shards.precompute)


def _train_stages(cfg: PipelineConfig, layout: Layout, record: dict) -> None:
    """Pre-flight check, publish, then each stage in order; fills `record` and run.json."""
    run_id = record["run_id"]
    version = record["dataset_version"]  # a resumed run keeps its own data
    # Stage 1 starts from random weights, or from the warm-start model's UNet.
    init_from: str | None = record.get("init_from_model", {}).get("folder")
    manifest: dict = {}
    plan_path = layout.plan()  # written by `kiln plan`
    plan = json.loads(plan_path.read_text()) if plan_path.is_file() else None
    pending = [
        s
        for s in cfg.train.stages
        if not (layout.stage(run_id, s.resolution) / "manifest.json").is_file()
    ]
    if cfg.launch.health_check and pending:
        record["health"] = preflight(
            cfg.train,
            cfg.launch,
            str(layout.run(run_id)),
            [
                str(layout.shards(v, s.resolution))
                for s in pending
                for v in [version, *(m.dataset_version for m in cfg.train.mix)]
            ],
            nodes=max(s.num_machines for s in pending),
        )
    if cfg.shards.remote:  # idempotent: makes sure every version trained on is published
        for v in dict.fromkeys([version, *(m.dataset_version for m in cfg.train.mix)]):
            publish_shards(cfg.storage.root, v, cfg.shards.remote, cfg.storage.endpoint_url)
    for i, stage in enumerate(cfg.train.stages):
        out = layout.stage(run_id, stage.resolution)
        # Precomputed latents for these encoders, when the shard step wrote them.
        latents = layout.latents(version, stage.resolution, encoder_key(cfg))
        images = layout.shards(version, stage.resolution)
        shards = latents if is_published(latents) else images
        mix = _mix_shards(cfg, layout, stage.resolution, latents=shards == latents)
        streamed = _streamed(cfg, layout, shards, mix) if cfg.shards.remote else {}
        run = StageRun(
            train=cfg.train,
            stage_index=i,
            shards=str(shards),
            mix_shards=mix,
            val_shards=_val_shards(cfg, layout, version, stage.resolution, shards == latents),
            **streamed,
            output_dir=str(out),
            init_from_dir=init_from,
            tracking_uri=cfg.tracking_uri,
            mlflow_run_id=record["mlflow_run_id"],
            gpu_hour_usd=cfg.launch.gpu_hour_usd,
        )
        # Called, not submitted: the stage runs in this thread, so a cancellation or SIGTERM
        # (raised here) reaches its watch, which kills the launch or cancels the cluster job.
        manifest = launch_stage.with_options(
            name=f"train-{stage.resolution}px",
            retries=cfg.launch.max_restarts,
            retry_delay_seconds=2,
        )(run, cfg.launch)
        raw = out / "final-raw"
        init_from = str(raw if cfg.train.init_from == "raw" and raw.is_dir() else out / "final")
        record["stages"][str(stage.resolution)] = manifest
        curves = write_loss_curves(out)
        if curves is not None:
            log_run_artifact(
                cfg.tracking_uri, record["mlflow_run_id"], str(curves), f"stage-{stage.resolution}"
            )
        create_markdown_artifact(
            key=f"stage-{stage.resolution}",
            description=f"{run_id} stage {stage.resolution}px",
            markdown=stage_report(
                run_id, i, stage.resolution, manifest, plan, str(curves) if curves else None
            ),
        )
        grid = sample_grid_report(stage.resolution, manifest, cfg.tracking_uri, run.mlflow_run_id)
        if grid:  # the newest sample grid of the stage, shown from MLflow
            create_markdown_artifact(
                key=f"samples-{stage.resolution}",
                markdown=grid,
                description=f"{run_id} stage {stage.resolution}px samples",
            )
    record["export"] = manifest["export"]
    layout.run_record(run_id).write_text(json.dumps(record, indent=2))
