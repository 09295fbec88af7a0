"""Pipeline configuration: one YAML file describes one pipeline.

The sections that only flows read (storage, execution, registry, retrain, human_eval) are
declared here; those that tasks read live below them, in `models.config` (and `quality` in
`data_quality.rules`). This module composes them, loads a file and snapshots it. A bad
value fails at load with its dotted path and the value received.

Relative local paths in a file resolve against the file's folder, never the working
directory, so a config behaves the same from anywhere; `--root` and `--source` given on the
command line resolve against the working directory. A relative input file (a topology, the
prompts) that is not beside the config is looked up in the project, so bundled names such as
`configs/accelerate/single.yaml` work from any config. Loading makes every path absolute, so
subprocesses see the same files and a snapshot of the loaded config loads to the same values.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from urllib.parse import urlparse

import yaml
from pydantic import Field, field_validator, model_validator

from data_quality.rules import QualityConfig
from models.config import (
    REVEAL_SECRETS,
    ConfigError,
    EvaluateConfig,
    GateConfig,
    IngestConfig,
    LaunchConfig,
    SecretUri,
    ShardsConfig,
    Strict,
    TrainConfig,
    is_remote,
    load_yaml_model,
    redact_uri,
    stable_hash,
)
from tasks.prompts import PromptsUnavailable, resolve_prompts
from tasks.storage import ProbeError, Storage

__all__ = [
    "PROJECT_DIR", "ConfigError", "PipelineConfig", "as_config", "check_inputs", "config_hash",
    "encoder_key", "load_config", "run_config", "tracking_folder", "write_snapshot",
]  # fmt: skip

# Repository root (editable install): used to find bundled configs/accelerate/*.yaml.
PROJECT_DIR = Path(__file__).resolve().parent.parent


class StorageConfig(Strict):
    root: str = Field("./kiln-data", description="Local (or mounted) folder for all outputs.")
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
    dask_address: str | None = Field(
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
        10_000, ge=1, description="Accepted images new or changed since the last training run "
        "that make a retrain due (the event's `kiln.retrain-due` label; a deployment trigger "
        "starts the retrain).",
    )  # fmt: skip


class HumanEvalConfig(Strict):
    """The blind A/B rating app and its report (`kiln compare`, `kiln rate ...`)."""

    database_url: SecretUri | None = Field(
        None,
        description="SQLAlchemy URL of the ratings store (e.g. postgresql://... for a shared "
        "server). Default: sqlite:///<root>/human_eval/ratings.db (WAL).",
    )
    host: str = Field("127.0.0.1", description="Address `kiln rate serve` listens on.")
    port: int = Field(8765, gt=0, lt=65536, description="Port of `kiln rate serve`.")
    raters_per_pair: int = Field(5, ge=1, description="Votes collected per pair (K).")
    gold_per_rater: int = Field(10, ge=0, description="Attention checks shown to each rater.")
    min_gold_accuracy: float = Field(
        0.8, ge=0, le=1, description="Raters below this gold accuracy are left out of results."
    )
    bootstrap_resamples: int = Field(2000, ge=100, description="Prompt-level bootstrap draws.")
    seed: int = Field(0, description="Seed of the bootstrap and of the gold pairs' choice.")


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
        from tasks.sources import CATALOG_COLUMNS

        clash = sorted(set(self.ingest.metadata_columns) & set(CATALOG_COLUMNS))
        if clash:
            raise ValueError(
                f"ingest.metadata_columns: names {clash} are catalog columns; pick other names "
                f"(received {self.ingest.metadata_columns!r})"
            )
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

    A fitted VAE enters as its folder (`tasks.vae_folder.resolve_fitted_vae`), whose name hashes
    what it was fitted from; an unresolved `fit` has no weights yet, so it has no key.
    """
    m = cfg.train.model
    if m.vae.fit is not None:
        raise ValueError("train.model.vae.fit is not resolved to its fitted folder yet; "
                         "call tasks.vae_folder.resolve_fitted_vae first")  # fmt: skip
    vae = m.vae.model_dump(exclude={"fit"})  # as before `fit` existed: the same keys
    parts = [vae, m.text_encoder.model_dump(), m.tokenizer.model_dump(),
             cfg.shards.precompute_text]  # fmt: skip
    return stable_hash(parts, 8)


def config_hash(cfg: PipelineConfig) -> str:
    """Identity of a loaded config: the hash of the snapshot `write_snapshot` writes."""
    return stable_hash(cfg.model_dump(mode="json", context=REVEAL_SECRETS), 16)


# The inputs each step needs before it starts; `check_inputs` checks them for the given steps.
STEP_INPUTS = {
    "ingest": ("source",),
    "train": ("topology", "tracking", "cluster"),
    "plan": ("topology",),
    "evaluate": ("topology", "prompts"),
    "register": ("tracking",),
}


def check_inputs(cfg: PipelineConfig, steps: tuple[str, ...]) -> None:
    """Fail fast on missing inputs that a later step needs, before hours of earlier steps.

    Runs before any flow starts, so a typo costs a second, not a Prefect server start and a
    failed run. The local checks (the source folder, the topology file, the tracking folder)
    run first and report every failure at once; the ones that may reach the network (an S3
    source listed with a fast probe, an http(s) tracking server, the DrawBench prompts, which
    may come from the Hub) run after, so an offline machine reports a local typo quickly.

    Raises:
        ConfigError: one line per failing input, naming the field, the value and the fix.
    """
    need = {check for step in steps for check in STEP_INPUTS.get(step, ())}
    if "shard" in steps and cfg.shards.precompute:  # precompute launches on the topology
        need.add("topology")
    errors = []
    if "source" in need:
        errors += _check_source_local(cfg)
    if "topology" in need:
        errors += _check_topology(cfg)
    if "tracking" in need:
        errors += _check_tracking_local(cfg.tracking_uri)
    if errors:
        raise ConfigError("\n".join(errors))
    if "source" in need:
        _check_source_remote(cfg)
    if "tracking" in need:
        _check_tracking_server(cfg.tracking_uri)
    if "cluster" in need and cfg.launch.backend == "slurm":
        from tasks.slurm import SlurmError, check_slurm

        try:  # the cluster's own answer: a bad partition or an impossible node count
            check_slurm(cfg.launch.slurm, max(s.num_machines for s in cfg.train.stages))
        except SlurmError as e:
            raise ConfigError(str(e)) from e
    if "cluster" in need and cfg.launch.backend == "kubernetes":
        from tasks.kubernetes import KubernetesRejected, check_kubernetes

        try:  # a client configuration, and the runtime the TrainJobs refer to
            check_kubernetes(cfg.launch.kubernetes)
        except KubernetesRejected as e:
            raise ConfigError(str(e)) from e
    if "prompts" in need:
        # The prompts are readable now, not after training: a configured file, the copy
        # KILN_DRAWBENCH_CSV names, or DrawBench from the Hub (fetched once, then cached). The
        # resolved path goes into the run's config snapshot.
        try:
            cfg.evaluate.prompts_csv = str(resolve_prompts(cfg.evaluate.prompts_csv))
        except (PromptsUnavailable, FileNotFoundError) as e:
            msg = str(e).removeprefix("evaluate.prompts_csv: ")
            raise ConfigError(f"evaluate.prompts_csv: {msg}") from e


SOURCE_FIX = "pass --source or set ingest.source"


def _check_source_local(cfg: PipelineConfig) -> list[str]:
    """A local source is a folder that holds files (ingest reads folders, tars inside them)."""
    src = cfg.ingest.source
    if not src:
        return [f"ingest.source: not set ({SOURCE_FIX})"]
    if is_remote(src) and not src.startswith("file://"):
        return []  # s3://: probed after the local checks; other schemes fail in Storage
    return _probe_source(cfg)


def _check_source_remote(cfg: PipelineConfig) -> None:
    src = cfg.ingest.source
    if src and is_remote(src) and not src.startswith("file://"):
        errors = _probe_source(cfg)
        if errors:
            raise ConfigError(errors[0])


def _probe_source(cfg: PipelineConfig) -> list[str]:
    src = cfg.ingest.source
    try:
        store = Storage(src, cfg.storage.endpoint_url)
        if not store.probe():
            return [f"ingest.source: {src} holds no files ({SOURCE_FIX})"]
    except ProbeError as e:
        if store.is_s3:
            hint = ("check the bucket and prefix, the AWS credentials, and storage.endpoint_url "
                    "or S3_ENDPOINT_URL for MinIO, Ceph or R2")  # fmt: skip
        elif "is a file" in str(e):
            hint = "ingest reads a folder: images with a manifest or .txt captions, or .tar shards"
        else:
            hint = SOURCE_FIX
        return [f"ingest.source: {e} ({hint})"]
    except ValueError as e:  # an unsupported scheme, an S3 URI without a bucket
        return [f"ingest.source: {e} ({SOURCE_FIX})"]
    return []


def _check_topology(cfg: PipelineConfig) -> list[str]:
    path = cfg.launch.accelerate_config
    if Path(path).is_file():
        return []
    return [
        f"launch.accelerate_config: file not found (received {path!r}); set it to a topology "
        f"such as configs/accelerate/single.yaml"
    ]


def tracking_folder(uri: str) -> Path | None:
    """The local folder MLflow writes for `uri`, or None for a server or database URI.

    `sqlite:///path/mlflow.db` writes beside the database file; a `file:` URI or a plain path
    is a file store, a folder of its own. Relative paths are MLflow's: against the working
    directory.
    """
    if uri.startswith("sqlite:///"):
        return Path(uri.removeprefix("sqlite:///")).expanduser().parent
    if uri.startswith("file:"):
        return Path(urlparse(uri).path).expanduser()
    if "://" in uri or uri == "databricks" or uri.startswith("databricks:"):
        return None  # http(s), postgresql, mysql, sqlite:// in memory, databricks
    return Path(uri).expanduser()


def _check_tracking_local(uri: str) -> list[str]:
    """The tracking folder exists and is writable, or can be created (nothing is created)."""
    folder = tracking_folder(uri)
    if folder is None:
        return []
    shown = redact_uri(uri)
    fix = "set registry.tracking_uri or --root to a writable place"
    folder = folder.absolute()
    existing = next(p for p in (folder, *folder.parents) if p.exists() or p == p.parent)
    if not existing.is_dir():
        return [f"registry.tracking_uri: {existing} is a file, not a folder (received "
                f"{shown!r}); {fix}"]  # fmt: skip
    try:  # os.access says yes to root even on a read-only mount: write, then remove
        with tempfile.TemporaryFile(dir=existing, prefix=".kiln-write-check-"):
            pass
    except OSError as e:
        return [f"registry.tracking_uri: {existing} is not writable ({e.strerror or e}; received "
                f"{shown!r}); {fix}"]  # fmt: skip
    return []


def _check_tracking_server(uri: str, timeout_s: float = 5.0) -> None:
    """An http(s) tracking server answers at all (any HTTP status: auth is MLflow's concern).

    Only reachability is checked: a refused connection, an unknown host or a timeout fails
    here, in seconds, instead of when training starts hours later. Database URIs are not
    probed (their drivers and credentials belong to MLflow).
    """
    if not uri.startswith(("http://", "https://")):
        return
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return  # it answered
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise ConfigError(
            f"registry.tracking_uri: the MLflow server at {redact_uri(uri)} does not answer "
            f"({reason}); start it or set registry.tracking_uri"
        ) from e


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
    cfg: PipelineConfig = load_yaml_model(PipelineConfig, path)
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


def as_config(
    config: PipelineConfig | str,
    steps: tuple[str, ...] = (),
    *,
    root: str | None = None,
    source: str | None = None,
) -> PipelineConfig:
    """A flow's config: the loaded one its caller passes, or a path loaded and checked here.

    The CLI and the pipeline load and check the config once and pass the object down; a flow
    started on its own (a deployment, a test) gets a path, and this is its one load.

    Args:
        config: A loaded config (already checked by the caller), or a pipeline YAML path.
        steps: With a path: the steps whose inputs `check_inputs` checks.
        root: With a path: overrides `storage.root`.
        source: With a path: overrides `ingest.source`.

    Raises:
        ConfigError: the file fails validation or an input check.
        ValueError: `root` or `source` given with a loaded config (apply them when loading).
    """
    if isinstance(config, PipelineConfig):
        if root is not None or source is not None:
            raise ValueError(
                f"root={root!r}, source={source!r}: overrides apply to a config path; pass them "
                "to load_config for a loaded config"
            )
        return config
    cfg = load_config(config, root=root, source=source)
    check_inputs(cfg, steps)
    return cfg


def _snapshot_text(cfg: PipelineConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json", context=REVEAL_SECRETS), sort_keys=False)


def write_snapshot(cfg: PipelineConfig, path: Path) -> Path:
    """Write the loaded config (overrides applied, paths absolute) to `path`, atomically.

    Loading the snapshot gives the same config (and `config_hash`) from any directory, however
    the user's file changes afterwards.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(_snapshot_text(cfg))
    tmp.replace(path)
    return path


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
        log.warning("no config snapshot at %s (a run from before snapshots): using the given "
                    "config", snapshot)  # fmt: skip
        return cfg
    text = snapshot.read_text()
    if text == _snapshot_text(cfg):
        return cfg
    snap = load_config(snapshot)
    if config_hash(snap) != config_hash(cfg):
        log.warning("the given config differs from the run's snapshot; the run keeps its "
                    "snapshot %s", snapshot)  # fmt: skip
    return snap
