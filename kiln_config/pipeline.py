"""Pipeline configuration: one YAML file describes one pipeline.

This module declares the service sections (storage, execution, registry, retrain), composes
every section into `PipelineConfig`, loads a file and snapshots it. A bad value fails at
load with its dotted path and the value received.

Relative local paths in a file resolve against the file's folder, never the working
directory, so a config behaves the same from anywhere; `--root` and `--source` given on the
command line resolve against the working directory. A relative input file (a topology, the
prompts) that is not beside the config is looked up in the project, so bundled names such as
`configs/accelerate/single.yaml` work from any config. Loading makes every path absolute, so
subprocesses see the same files and a snapshot of the loaded config loads to the same values.
"""

from __future__ import annotations

import logging
from pathlib import Path

import yaml
from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from kiln_config.base import (
    REVEAL_SECRETS,
    EnvPath,
    SecretUri,
    Strict,
    is_remote,
    stable_hash,
    write_private,
)
from kiln_config.data import CATALOG_COLUMNS, IngestConfig, QualityConfig, ShardsConfig
from kiln_config.evaluate import EvaluateConfig, GateConfig, HumanEvalConfig
from kiln_config.launch import LaunchConfig
from kiln_config.loader import load_yaml_model
from kiln_config.train import TrainConfig

__all__ = [
    "ExecutionConfig",
    "PROJECT_DIR",
    "PipelineConfig",
    "RegistryConfig",
    "RetrainConfig",
    "StorageConfig",
    "config_hash",
    "encoder_key",
    "load_config",
    "run_config",
    "write_snapshot",
]


# Repository root (editable install): used to find bundled configs/accelerate/*.yaml.
PROJECT_DIR = Path(__file__).resolve().parent.parent


class StorageConfig(Strict):
    root: EnvPath = Field("./kiln-data", description="Local (or mounted) folder for all outputs.")
    endpoint_url: SecretUri | None = Field(
        None, description="S3-compatible endpoint (MinIO, R2...)."
    )

    @field_validator("root")
    @classmethod
    def _root(cls, v: str) -> str:
        if is_remote(v):
            # Sources may be s3://; the root (catalog, shards, runs) is a local or mounted
            # folder for now.
            raise ValueError("storage.root must be a local (or mounted) folder")
        return v


class ExecutionConfig(Strict):
    dask_address: EnvPath | None = Field(
        None, description="Dask scheduler (tcp://host:8786) for ingest partitions; else local."
    )


class RegistryConfig(Strict):
    tracking_uri: SecretUri | None = Field(None, description="Default: sqlite:///<root>/mlflow.db")
    experiment: str = "kiln"
    model_name: str = "kiln-t2i"
    alias: str = "candidate"
    gate: GateConfig = Field(default_factory=GateConfig)


class RetrainConfig(Strict):
    """When new data makes a retrain due (the ingest flow's `kiln.ingest.completed` event)."""

    min_new_images: int = Field(
        10_000,
        ge=1,
        description="Accepted images new or changed since the last training run "
        "that make a retrain due (the event's `kiln.retrain-due` label; a deployment trigger "
        "starts the retrain).",
    )


class PipelineConfig(Strict):
    storage: StorageConfig = Field(default_factory=StorageConfig)
    ingest: IngestConfig = Field(default_factory=IngestConfig)
    quality: QualityConfig = Field(default_factory=QualityConfig)
    execution: ExecutionConfig = Field(default_factory=ExecutionConfig)
    shards: ShardsConfig = Field(default_factory=ShardsConfig)
    train: TrainConfig
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    registry: RegistryConfig = Field(default_factory=RegistryConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    human_eval: HumanEvalConfig = Field(default_factory=HumanEvalConfig)
    retrain: RetrainConfig = Field(default_factory=RetrainConfig)

    @model_validator(mode="after")
    def _metadata_columns_are_not_catalog_columns(self) -> PipelineConfig:
        clash = sorted(set(self.ingest.metadata_columns) & set(CATALOG_COLUMNS))
        if clash:
            raise ValueError(
                f"ingest.metadata_columns: names {clash} are catalog columns; pick other names "
                f"(received {self.ingest.metadata_columns!r})"
            )
        return self

    @model_validator(mode="after")
    def _one_clip_for_curation_and_evaluation(self) -> PipelineConfig:
        # The study's CLIP score reads the CLIP that curated the data unless told otherwise.
        if self.evaluate.metrics.clip_model is None and self.quality.clip_model is not None:
            self.evaluate.metrics.clip_model = self.quality.clip_model
        return self

    @model_validator(mode="after")
    def _buckets_fit_the_stages(self) -> PipelineConfig:
        stages = [s.resolution for s in self.train.stages]
        for r in self.shards.bucket_stages or []:
            if r not in stages:
                raise ValueError(
                    f"shards.bucket_stages: {r} is not a stage resolution {stages} "
                    f"(received {self.shards.bucket_stages})"
                )
        for r in self.bucket_stages():
            if r % self.shards.bucket_step:
                raise ValueError(
                    f"shards.bucket_step: stage {r}px is not a multiple of it "
                    f"(received {self.shards.bucket_step})"
                )
        return self

    @model_validator(mode="after")
    def _many_nodes_need_a_cluster(self) -> PipelineConfig:
        for i, s in enumerate(self.train.stages):
            if s.num_machines > 1 and self.launch.backend == "local":
                raise ValueError(
                    f"train.stages.{i}.num_machines: {s.num_machines} nodes need a cluster "
                    f"backend; set launch.backend: slurm or kubernetes (received local)"
                )
        return self

    @model_validator(mode="after")
    def _claim_holds_the_root(self) -> PipelineConfig:
        kube = self.launch.kubernetes
        if self.launch.backend == "kubernetes" and kube.storage_claim and kube.mount_path:
            root = Path(self.storage.root).resolve()
            if not root.is_relative_to(kube.mount_path):
                raise ValueError(
                    f"launch.kubernetes.mount_path: the nodes must see storage.root ({root}) "
                    f"at the same path, inside the claim (received {kube.mount_path})"
                )
        return self

    def bucket_stages(self) -> list[int]:
        """Stage resolutions written as aspect-ratio buckets (none unless aspect_buckets)."""
        if not self.shards.aspect_buckets:
            return []
        if self.shards.bucket_stages is not None:
            return sorted(self.shards.bucket_stages)
        return [max(s.resolution for s in self.train.stages)]

    @property
    def tracking_uri(self) -> str:
        if self.registry.tracking_uri:
            return self.registry.tracking_uri
        return f"sqlite:///{Path(self.storage.root) / 'mlflow.db'}"


def encoder_key(cfg: PipelineConfig) -> str:
    """Identity of the frozen encoders (and text mode) that precomputed latents depend on.

    A fitted VAE enters as its folder (`tasks.shards.vae_folder.resolve_fitted_vae`), whose name
    hashes what it was fitted from; an unresolved `fit` has no weights yet, so it has no key.
    """
    m = cfg.train.model
    if m.vae.fit is not None:
        raise ValueError(
            "train.model.vae.fit is not resolved to its fitted folder yet; "
            "call tasks.shards.vae_folder.resolve_fitted_vae first"
        )
    vae = m.vae.model_dump(exclude={"fit"})  # as before `fit` existed: the same keys
    parts = [vae, m.text_encoder.model_dump(), m.tokenizer.model_dump(), cfg.shards.precompute_text]
    return stable_hash(parts, 8)


def config_hash(cfg: PipelineConfig) -> str:
    """Identity of a loaded config: the hash of the snapshot `write_snapshot` writes."""
    return stable_hash(cfg.model_dump(mode="json", context=REVEAL_SECRETS), 16)


def _abs(p: str, base: Path) -> str:
    return p if is_remote(p) else str((base / Path(p).expanduser()).resolve())


def _find_input(p: str, base: Path) -> str:
    """An input file beside the config, else the project's bundled file of that name."""
    path = Path(p).expanduser()
    if not path.is_absolute() and not (base / path).exists() and (PROJECT_DIR / path).exists():
        return str((PROJECT_DIR / path).resolve())
    return _abs(p, base)


def load_config(
    path: str | Path, *, root: str | None = None, source: str | None = None
) -> PipelineConfig:
    """Load and validate a pipeline YAML, applying CLI overrides; every path made absolute.

    Args:
        path: The pipeline YAML. Relative paths in it resolve against its folder.
        root: Overrides `storage.root` (relative: against the working directory).
        source: Overrides `ingest.source` (relative: against the working directory).

    Raises:
        ConfigError: naming each bad field's dotted path and the value received.
    """
    is_snapshot = Path(path).expanduser().is_file() and _is_snapshot(Path(path).expanduser())
    cfg: PipelineConfig = load_yaml_model(PipelineConfig, path, env=not is_snapshot)
    base, cwd = Path(path).expanduser().resolve().parent, Path.cwd()
    if root is not None:
        cfg.storage = StorageConfig(root=_abs(root, cwd), endpoint_url=cfg.storage.endpoint_url)
    if source is not None:
        cfg.ingest.source = _abs(source, cwd)
    cfg.storage.root = _abs(cfg.storage.root, base)
    if cfg.ingest.source:
        cfg.ingest.source = _abs(cfg.ingest.source, base)
    if cfg.evaluate.prompts_csv:
        cfg.evaluate.prompts_csv = _find_input(cfg.evaluate.prompts_csv, base)
    if cfg.shards.remote:
        cfg.shards.remote = _abs(cfg.shards.remote, base)
    cache = cfg.shards.cache_dir
    cfg.shards.cache_dir = _abs(cache, base) if cache else str(Path(cfg.storage.root) / "cache")
    cfg.launch.accelerate_config = _find_input(cfg.launch.accelerate_config, base)
    if cfg.registry.tracking_uri:
        cfg.registry.tracking_uri = _abs_sqlite(cfg.registry.tracking_uri, base)
    warm = cfg.train.init_from_model
    if warm and not warm.startswith("models:/"):
        cfg.train.init_from_model = _abs(warm, base)
    if cfg.human_eval.database_url:
        cfg.human_eval.database_url = _abs_sqlite(cfg.human_eval.database_url, base)
    return cfg


def _abs_sqlite(url: str, base: Path) -> str:
    """`sqlite:///relative.db` against the config's folder, like every other path in it (a
    worker's flow run and `kiln rate serve` started elsewhere must open the same database)."""
    prefix = "sqlite:///"
    if not url.startswith(prefix) or url[len(prefix) :].startswith("/"):
        return url  # absolute, in memory (sqlite://), or another database
    return prefix + str((base / url[len(prefix) :]).resolve())


# The first line of a run's config snapshot. A config that starts with it is read as it is:
# its values are the ones the run loaded, `${NAME}` already expanded, so a value that holds
# `${` (a password) is not expanded a second time.
SNAPSHOT_HEADER = "# kiln: the config a run loaded, read as it is (no ${NAME} is expanded)\n"


def _is_snapshot(path: Path) -> bool:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.readline() == SNAPSHOT_HEADER


def _snapshot_text(cfg: PipelineConfig) -> str:
    dumped = cfg.model_dump(mode="json", context=REVEAL_SECRETS)
    return SNAPSHOT_HEADER + yaml.safe_dump(dumped, sort_keys=False)


def write_snapshot(cfg: PipelineConfig, path: Path) -> Path:
    """Write the loaded config (overrides applied, paths absolute) to `path`, atomically,
    readable by its owner alone (mode 600).

    Loading the snapshot gives the same config (and `config_hash`) from any directory, however
    the user's file changes afterwards.
    """
    # Owner-only: the snapshot keeps the config's credentials in clear (a database URL's
    # password), so that it loads back.
    return write_private(path, _snapshot_text(cfg))


def run_config(cfg: PipelineConfig, snapshot: Path, log: logging.Logger | None = None):
    """The config a training run started with: its snapshot, else `cfg` (a run from before
    snapshots). A step that reads a run (resume, evaluate, register) uses this, so an edit to
    the user's file after the run started changes nothing; the run's own snapshot is the file
    to edit (and pass as `--config`) to change it on purpose.

    A snapshot whose text is `cfg`'s (the pipeline passes on the config its training run
    wrote) is `cfg` itself: it is not parsed again.
    """
    log = log or logging.getLogger(__name__)
    if not snapshot.is_file():
        log.warning(
            "no config snapshot at %s (a run from before snapshots): using the given config",
            snapshot,
        )
        return cfg
    text = snapshot.read_text()
    if text == _snapshot_text(cfg):
        return cfg
    snap = load_config(snapshot)
    if config_hash(snap) != config_hash(cfg):
        log.warning(
            "the given config differs from the run's snapshot; the run keeps its snapshot %s",
            snapshot,
        )
    return snap
