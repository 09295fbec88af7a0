"""Pipeline configuration: one YAML file describes one pipeline.

Sections: `storage`, `ingest`, `quality`, `shards`, `train` (schema in `models.config`),
`evaluate`, `registry`, `launch`. A bad value fails at load with its dotted path and the value
received. Relative local paths are resolved against the working directory at load time, so
that subprocesses see the same files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from data_quality.rules import QualityConfig
from models.config import ConfigError, TrainConfig, load_yaml_model

__all__ = [
    "PipelineConfig", "ConfigError", "check_inputs", "encoder_key", "load_config", "PROJECT_DIR",
]  # fmt: skip

# Repository root (editable install): used to find bundled configs/accelerate/*.yaml.
PROJECT_DIR = Path(__file__).resolve().parent.parent


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


def _is_remote(uri: str) -> bool:
    return "://" in uri


class StorageConfig(Strict):
    root: str = Field("./kiln-data", description="Local (or mounted) folder for all outputs.")
    endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, R2...).")

    @field_validator("root")
    @classmethod
    def _root(cls, v: str) -> str:
        if _is_remote(v):
            # Sources may be s3://; the root (catalog, shards, runs) is a local or mounted
            # folder for now.
            raise ValueError("storage.root must be a local (or mounted) folder")
        return v


class IngestConfig(Strict):
    source: str | None = Field(None, description="Local folder or s3://bucket/prefix.")
    layout: Literal["auto", "imagefolder", "img2dataset", "webdataset"] = Field(
        "auto", description="Source layout; auto detects it from the listing."
    )
    metadata_file: str | None = Field(
        None, description="imagefolder manifest; default metadata.jsonl, .csv or .parquet."
    )
    caption_column: str = "text"
    metadata_columns: list[str] = Field(
        default_factory=list,
        description="Pass-through columns kept in the catalog (license, contributor, ...).",
    )
    image_extensions: list[str] = Field(
        default_factory=lambda: [".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"]
    )
    workers: int = Field(0, ge=0, description="Decode processes; 0 means one per CPU core.")
    max_pixels: int = Field(
        89_478_485, gt=0, description="Images over this pixel count are quarantined unread."
    )
    partition_size: int = Field(1000, gt=0, description="Items per decode task.")

    @field_validator("metadata_columns")
    @classmethod
    def _no_clash(cls, v: list[str]) -> list[str]:
        from tasks.sources import CATALOG_COLUMNS

        clash = sorted(set(v) & set(CATALOG_COLUMNS))
        if clash:
            raise ValueError(f"names {clash} are catalog columns; pick other names")
        return v


class ExecutionConfig(Strict):
    dask_address: str | None = Field(
        None, description="Dask scheduler (tcp://host:8786) for ingest partitions; else local."
    )


class ShardsConfig(Strict):
    min_side_factor: float = Field(
        1.0, gt=0, description="A stage takes images whose short side >= resolution * factor."
    )
    jpeg_quality: int = Field(90, ge=1, le=100, description="JPEG or WebP quality.")
    image_format: Literal["jpeg", "webp", "png"] = Field("jpeg", description="Stored encoding.")
    partition_size: int = Field(2000, gt=0, description="Images per conversion task.")
    size_limit: int = Field(1 << 26, gt=0, description="Bytes per MDS shard before a new one.")
    workers: int = Field(0, ge=0, description="Resize processes; 0 means one per CPU core.")
    token_ids: bool = Field(
        True,
        description="Store each caption's token ids (the model's tokenizer) in the image shards, "
        "so the loader does not tokenize; the tokenizer becomes part of the dataset version.",
    )
    precompute: bool = Field(
        False, description="Also write VAE latents and text states per stage (models.precompute)."
    )
    precompute_text: bool = Field(
        True, description="With precompute: store text-encoder states (else token ids only)."
    )
    aspect_buckets: bool = Field(
        False,
        description="SDXL-style aspect-ratio buckets instead of centre crops for bucket_stages; "
        "each bucket is its own stream, and every batch comes from one bucket.",
    )
    bucket_stages: list[int] | None = Field(
        None, description="Stage resolutions that use buckets; default the largest stage."
    )
    bucket_step: int = Field(
        64, gt=0, description="Bucket sides are multiples of this (64 for SD2: VAE x UNet)."
    )
    bucket_max_aspect: float = Field(2.0, ge=1.0, description="Widest aspect ratio either way.")
    remote: str | None = Field(
        None,
        description="s3://bucket/prefix (or a shared folder) to publish dataset versions to; "
        "training then streams them from there through cache_dir.",
    )
    cache_dir: str | None = Field(
        None,
        description="Local cache of streamed shards on each training machine (fast local "
        "disk); default <root>/cache.",
    )

    @field_validator("remote")
    @classmethod
    def _remote(cls, v: str | None) -> str | None:
        if v is not None and "://" in v and not v.startswith("s3://"):
            raise ValueError(f"must be s3://bucket/prefix or a folder (received {v!r})")
        if v is not None and v.startswith("s3://") and not v[5:].split("/")[0]:
            raise ValueError(f"names no bucket (received {v!r})")
        return v.rstrip("/") if v else v


class EvaluateConfig(Strict):
    prompts_csv: str = Field(description="CSV with columns Prompts,Category (DrawBench).")
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    num_inference_steps: int = Field(25, gt=0)
    guidance_scale: float = Field(7.5, ge=0)
    batch_size: int = Field(8, gt=0)
    limit: int | None = Field(None, gt=0, description="Use only the first N prompts.")


class RegistryConfig(Strict):
    tracking_uri: str | None = Field(None, description="Default: sqlite:///<root>/mlflow.db")
    experiment: str = "kiln"
    model_name: str = "kiln-t2i"
    alias: str = "candidate"


class LaunchConfig(Strict):
    accelerate_config: str = Field(
        "configs/accelerate/single.yaml", description="Accelerate topology YAML."
    )
    num_processes: int | None = Field(None, gt=0, description="Override the topology's count.")
    max_restarts: int = Field(2, ge=0, description="Relaunches (resuming) after a crash.")
    hang_timeout_s: float = Field(
        900, gt=0, description="Kill a launch whose heartbeat is older than this (a hang)."
    )
    gpu_hour_usd: float = Field(
        0.0, ge=0, description="Price of one device-hour; 0 reports GPU-hours without cost."
    )
    health_check: bool = Field(
        True, description="Pre-flight check (GPUs, all-reduce, disk, storage) before launches."
    )
    health_timeout_s: float = Field(
        300, gt=0, description="Longest the pre-flight all-reduce launch may take."
    )


class PipelineConfig(Strict):
    storage: StorageConfig = Field(default_factory=StorageConfig)
    ingest: IngestConfig = Field(default_factory=IngestConfig)
    quality: QualityConfig = Field(default_factory=QualityConfig)
    execution: ExecutionConfig = Field(default_factory=ExecutionConfig)
    shards: ShardsConfig = Field(default_factory=ShardsConfig)
    train: TrainConfig
    evaluate: EvaluateConfig
    registry: RegistryConfig = Field(default_factory=RegistryConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)

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
    """Identity of the frozen encoders (and text mode) that precomputed latents depend on."""
    import hashlib
    import json

    m = cfg.train.model
    parts = [m.vae.model_dump(), m.text_encoder.model_dump(), m.tokenizer.model_dump(),
             cfg.shards.precompute_text]  # fmt: skip
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:8]


def check_inputs(cfg: PipelineConfig, steps: tuple[str, ...]) -> None:
    """Fail fast on missing files that a later step needs, before hours of earlier steps."""
    need = {
        "train": [("launch.accelerate_config", cfg.launch.accelerate_config)],
        "evaluate": [
            ("evaluate.prompts_csv", cfg.evaluate.prompts_csv),
            ("launch.accelerate_config", cfg.launch.accelerate_config),
        ],
    }
    for step in steps:
        for field, path in need.get(step, []):
            if not Path(path).is_file():
                raise ConfigError(f"{field}: file not found (received {path!r})")


def _abs(p: str) -> str:
    return p if _is_remote(p) else str(Path(p).expanduser().resolve())


def _find_bundled(p: str) -> str:
    path = Path(p).expanduser()
    if not path.is_absolute() and not path.exists() and (PROJECT_DIR / path).exists():
        path = PROJECT_DIR / path
    return str(path.resolve())


def load_config(
    path: str | Path, *, root: str | None = None, source: str | None = None
) -> PipelineConfig:
    """Load and validate a pipeline YAML, applying CLI overrides.

    Args:
        path: The pipeline YAML.
        root: Overrides `storage.root`.
        source: Overrides `ingest.source`.

    Raises:
        ConfigError: naming each bad field's dotted path and the value received.
    """
    cfg: PipelineConfig = load_yaml_model(PipelineConfig, path)
    if root is not None:
        cfg.storage = StorageConfig(root=root, endpoint_url=cfg.storage.endpoint_url)
    if source is not None:
        cfg.ingest.source = source
    cfg.storage.root = _abs(cfg.storage.root)
    if cfg.ingest.source:
        cfg.ingest.source = _abs(cfg.ingest.source)
    cfg.evaluate.prompts_csv = _abs(cfg.evaluate.prompts_csv)
    if cfg.shards.remote:
        cfg.shards.remote = _abs(cfg.shards.remote)
    cfg.shards.cache_dir = _abs(cfg.shards.cache_dir or str(Path(cfg.storage.root) / "cache"))
    cfg.launch.accelerate_config = _find_bundled(cfg.launch.accelerate_config)
    return cfg
