"""The config schema of `train` and the resolved per-stage file, plus the pipeline sections
that tasks read (ingest, shards, evaluate, launch, the promotion gate).

They live below every layer that reads them: `tasks/` reads these sections, and the training
script reads one `stage.yaml` (a :class:`StageRun`) and nothing else, so `models.train` never
imports the orchestrator. `flows/config.py` holds the sections only flows read (storage,
execution, registry, retrain, human_eval) and composes the pipeline config.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit, urlunsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    SerializationInfo,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

__all__ = [
    "DIVERGED",
    "Component",
    "ConfigError",
    "EMAConfig",
    "EvalMetricsConfig",
    "EvaluateConfig",
    "FaultInjection",
    "REVEAL_SECRETS",
    "GateConfig",
    "GpuLimitConfig",
    "IngestConfig",
    "KubernetesConfig",
    "LaunchConfig",
    "ModelConfig",
    "SecretUri",
    "ShardsConfig",
    "SlurmConfig",
    "StageConfig",
    "StageRun",
    "StreamMix",
    "Strict",
    "TokenizerConfig",
    "TrainConfig",
    "VaeComponent",
    "VaeFitConfig",
    "format_validation_error",
    "is_remote",
    "load_yaml_model",
    "read_yaml",
    "redact_uri",
    "stable_hash",
]

# In a stage folder: the stage diverged and stays failed (models/train.py writes it; tasks/launch
# reads it without importing the training stack).
DIVERGED = "DIVERGED.json"


class ConfigError(ValueError):
    """A config file failed validation. The message names each bad field and its value."""


class Strict(BaseModel):
    """Base of every config section: an unknown key is an error, never silently ignored."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())


def stable_hash(obj: Any, n: int = 16) -> str:
    """The first `n` hex digits of the SHA-256 of `obj` as canonical JSON (sorted keys).

    The identity of settings, configs and encoders: equal values give equal hashes in any
    process and on any machine.
    """
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:n]


def is_remote(uri: str) -> bool:
    """Whether `uri` names a scheme (s3://, http://...) rather than a local path."""
    return "://" in uri


def redact_uri(uri: str) -> str:
    """`uri` with the secret of its userinfo masked, for anything shown or logged.

    Tracking URIs can hold database credentials (`postgresql://user:secret@host/db`) or, for an
    http(s) server, a bare token as the user (`https://token@host`). Never raises: the netloc
    is split as text, so a malformed port cannot turn a message into a traceback.
    """
    parts = urlsplit(uri)
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if not at:
        return uri
    user, colon, _ = userinfo.partition(":")
    if colon:
        masked = f"{user}:***"
    elif parts.scheme in ("http", "https"):
        masked = "***"  # a token in the user part
    else:
        return uri  # a database user name alone is no secret
    return urlunsplit(parts._replace(netloc=f"{masked}@{hostport}"))


def _redact_in_json(uri: str, info: SerializationInfo) -> str:
    return uri if (info.context or {}).get("reveal_secrets") else redact_uri(uri)


# A URI that may hold credentials (a database password, a token). A JSON dump of the config
# (a Prefect flow run's parameters, anything logged) masks them; a file that must load back
# (the run's config snapshot) dumps with `context=REVEAL_SECRETS`.
SecretUri = Annotated[str, PlainSerializer(_redact_in_json, when_used="json")]
REVEAL_SECRETS = {"reveal_secrets": True}


class Component(Strict):
    """A model component: built from a config dict, or loaded from a local path or hub id."""

    config: dict[str, Any] | None = None
    pretrained: str | None = None
    subfolder: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> Component:
        if (self.config is None) == (self.pretrained is None):
            raise ValueError("set exactly one of 'config' (build from a dict) or 'pretrained'")
        return self


class VaeFitConfig(Strict):
    """Train the VAE built from `config` once on the dataset's own images, before anything
    encodes with it (the `tiny` preset: a randomly initialised VAE gives noise-like latents,
    and a diffusion model trained on them samples noise). See `models/vae_fit.py`."""

    steps: int = Field(
        800, gt=0, description="Optimizer steps (AdamW); 400 lost colours (docs/architecture.md)."
    )
    batch_size: int = Field(16, gt=0, description="Random crops per step.")
    resolution: int = Field(32, gt=0, description="Side of the square training crops.")
    learning_rate: float = Field(3.0e-3, gt=0)
    kl_weight: float = Field(
        1.0e-4, ge=0, description="Weight of the KL term (per pixel value, like the MSE term)."
    )
    seed: int = Field(0, description="Seeds the initial weights, the crops and the sampling.")


class VaeComponent(Component):
    """The VAE: a :class:`Component`, optionally fitted once on the data (`fit`).

    The train and shard flows resolve a `fit` to `pretrained: <root>/vae/<key>` (the fitted
    weights, cached) before any process encodes, so every consumer loads the same weights.
    """

    fit: VaeFitConfig | None = None

    @model_validator(mode="after")
    def _fit_needs_config(self) -> VaeComponent:
        if self.fit is not None and self.config is None:
            raise ValueError("'fit' trains a VAE built from 'config'; a 'pretrained' VAE is "
                             "used as it is (remove 'fit' or use 'config')")  # fmt: skip
        return self


class TokenizerConfig(Strict):
    """`builtin: bytes` builds a byte-level CLIP tokenizer offline; else load `pretrained`.

    `words` (builtin only): words that become single tokens on top of the bytes, as a real
    BPE vocabulary has its common words (the tiny preset lists the demo captions' words). The
    merges are built from each word's end (`models.factory`), so a listed word is one token
    wherever it stands alone, and also where it ends a longer word ("bored" is "b", "o",
    "red"), as in any BPE vocabulary with only an end-of-word marker; elsewhere bytes stay
    bytes."""

    builtin: Literal["bytes"] | None = None
    pretrained: str | None = None
    subfolder: str | None = None
    model_max_length: int = Field(77, gt=1)
    words: list[str] = Field(default_factory=list)

    @field_validator("words", mode="before")
    @classmethod
    def _no_yaml_booleans(cls, v: Any) -> Any:
        if isinstance(v, list) and any(isinstance(w, bool) for w in v):
            raise ValueError('YAML reads a bare on, off, yes or no as true/false: quote it ("on")')
        return v

    @model_validator(mode="after")
    def _one_source(self) -> TokenizerConfig:
        if (self.builtin is None) == (self.pretrained is None):
            raise ValueError("set exactly one of 'builtin' or 'pretrained'")
        if self.words and self.pretrained is not None:
            raise ValueError("'words' extends the builtin tokenizer; a pretrained one has its own")
        bad = [w for w in self.words if not re.fullmatch(r"[a-z]{2,}", w)]
        if bad:
            raise ValueError(f"tokenizer words must be lower-case letters, 2 or more: {bad}")
        return self

    @model_serializer(mode="wrap")
    def _without_empty_words(self, handler) -> dict[str, Any]:
        """No `words` key when there are none: the dump is hashed into dataset versions and
        encoder keys, which must not change for configs written before `words` existed."""
        data = handler(self)
        if not self.words:
            data.pop("words", None)
        return data


class ModelConfig(Strict):
    unet: dict[str, Any]
    vae: VaeComponent
    text_encoder: Component
    tokenizer: TokenizerConfig
    noise_scheduler: dict[str, Any] = Field(
        default_factory=lambda: {
            "num_train_timesteps": 1000,
            "beta_schedule": "scaled_linear",
            "beta_start": 0.00085,
            "beta_end": 0.012,
            "prediction_type": "epsilon",
            "clip_sample": False,
            "set_alpha_to_one": False,
            "steps_offset": 1,
        }
    )

    @model_validator(mode="after")
    def _zero_snr_needs_v_prediction(self) -> ModelConfig:
        s = self.noise_scheduler
        v_pred = s.get("prediction_type", "epsilon") == "v_prediction"
        if s.get("rescale_betas_zero_snr") and not v_pred:
            raise ValueError(
                "train.model.noise_scheduler: rescale_betas_zero_snr needs prediction_type "
                "v_prediction (at zero SNR the noise is the input, so an epsilon target "
                "teaches nothing and min-SNR weights divide by zero; Lin et al. 2024); "
                f"received prediction_type {s.get('prediction_type', 'epsilon')!r}"
            )
        return self


class StageConfig(Strict):
    resolution: int = Field(gt=0)
    batch_size: int = Field(gt=0, description="Per-process micro-batch size.")
    learning_rate: float = Field(gt=0)
    max_steps: int = Field(gt=0, description="Optimizer steps in this stage.")
    gradient_accumulation_steps: int = Field(1, ge=1)
    warmup_steps: int = Field(0, ge=0)
    lr_scheduler: Literal["constant", "cosine"] = "constant"
    num_machines: int = Field(
        1, ge=1, description="Nodes this stage trains on (more than 1: launch.backend slurm or "
        "kubernetes); each runs the backend's gpus_per_node processes, else launch."
        "num_processes or the topology's count.",
    )  # fmt: skip


class EMAConfig(Strict):
    enabled: bool = True
    decay: float = Field(0.9999, gt=0, lt=1)
    start_step: int = Field(0, ge=0, description="Global step (within the stage) EMA starts at.")


class StreamMix(Strict):
    """Another dataset version mixed into every stage, e.g. 20 % of last year's data."""

    dataset_version: str
    proportion: float = Field(gt=0, lt=1, description="Share of each epoch's samples.")


# A few DrawBench prompts (colours, counting, positions, text) for the sample grid.
DEFAULT_SAMPLE_PROMPTS = (
    "A red colored car.",
    "A black apple and a green backpack.",
    "A pizza on the right of a suitcase.",
    "Three cats and one dog sitting on the grass.",
    "A storefront with 'Hello World' written on it.",
)


class TrainConfig(Strict):
    model: ModelConfig
    stages: list[StageConfig] = Field(min_length=1)
    seed: int = 0
    weight_decay: float = Field(0.01, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    checkpoint_every: int = Field(100, gt=0)
    keep_checkpoints: int = Field(2, ge=1)
    log_every: int = Field(10, gt=0)
    ema: EMAConfig = Field(default_factory=EMAConfig)
    ema_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Dtype of the EMA's copy of the UNet. bfloat16 halves it (1.7 GB instead "
        "of 3.5 GB for SD2-base); each update is computed in float32 and rounded "
        "stochastically (models/ema.py).",
    )
    init_from: Literal["ema", "raw"] = "ema"
    init_from_model: str | None = Field(
        None,
        description="Warm start: the first stage starts from this model's UNet (its EMA "
        "starts there too): models:/NAME@ALIAS, models:/NAME/VERSION or an exported pipeline "
        "folder. Null: random initialisation (training from scratch).",
    )
    num_workers: int = Field(0, ge=0, description="DataLoader workers per process.")
    caption_dropout: float = Field(
        0.1, ge=0, lt=1, description="Empty-caption rate, for classifier-free guidance."
    )
    hflip: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Chance of mirroring an image left to right (image shards only). Off by "
        "default: captions that say left or right would then be wrong for the flipped image.",
    )
    shuffle_seed: int = 1234
    shuffle_algo: Literal["py1e", "py1br", "py1b", "py1s", "py2s", "naive"] = Field(
        "py1e", description="Streaming's shuffle algorithm (py1e: MosaicML's default)."
    )
    num_canonical_nodes: int | None = Field(
        None,
        gt=0,
        description="Streaming's canonical node count: the sample order is fixed by it, so "
        "any split of a stage into nodes and processes sees the same samples in the same "
        "order. Each stage's num_machines must divide it or be a multiple of it. Null: 1 (64 "
        "for py1s/py2s), what one node gives; on many nodes set the largest stage's count, so "
        "each node reads its own shards.",
    )
    predownload: int | None = Field(None, gt=0, description="Samples to read ahead per worker.")
    cache_limit: str | None = Field(
        None, description="Local cache size limit for remote shards, e.g. '200gb'."
    )
    mix: list[StreamMix] = Field(
        default_factory=list,
        description="Other dataset versions mixed in; the current one gets the rest.",
    )
    log_sample_keys: bool = Field(
        False, description="Write the key of every sample each rank trains on (data lineage)."
    )
    snr_gamma: float | None = Field(
        None, gt=0, description="Min-SNR-gamma loss weighting (Hang et al. 2023); 5.0 is usual."
    )
    attention: Literal["sdpa", "eager"] = Field(
        "sdpa", description="sdpa: torch scaled_dot_product_attention (flash/mem-efficient)."
    )
    channels_last: bool = Field(False, description="UNet and latents in channels_last layout.")
    compile: bool = Field(False, description="torch.compile the UNet (inductor).")
    peak_tflops: float | None = Field(
        None,
        gt=0,
        description="Peak TFLOP/s per device for MFU; default a GPU table or a "
        "measured matmul peak on CPU.",
    )
    # -- the learning signal: held-out loss and sample grids while training --
    eval_every: int | None = Field(
        500,
        gt=0,
        description="Validation loss and conditioning gap every N optimizer steps (and at the "
        "end of each stage); null: only at the end of each stage.",
    )
    val_timesteps: int = Field(
        8, ge=1, le=1000, description="Evenly spaced timesteps the validation loss is taken at."
    )
    val_max_samples: int = Field(
        512,
        gt=0,
        description="Validation images per evaluation (all ranks together), to bound its cost.",
    )
    sample_every: int | None = Field(
        1000,
        gt=0,
        description="Sample grid every N optimizer steps (and at the end of each stage); "
        "null: only at the end of each stage.",
    )
    sample_prompts: list[str] = Field(
        default_factory=lambda: list(DEFAULT_SAMPLE_PROMPTS),
        description="Fixed prompts of the sample grid (one row each).",
    )
    sample_seeds: list[int] = Field(
        default_factory=lambda: [0, 1], min_length=1, description="Fixed seeds (grid columns)."
    )
    sample_steps: int = Field(25, gt=0, description="Inference steps per grid image.")
    sample_guidance_scale: float = Field(7.5, ge=0, description="Classifier-free guidance.")

    @model_validator(mode="after")
    def _mix_total(self) -> TrainConfig:
        total = sum(m.proportion for m in self.mix)
        if total >= 1:
            raise ValueError(f"train.mix proportions sum to {total:g}; they must leave the "
                             "current dataset a share (sum < 1)")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _canonical_nodes_fit(self) -> TrainConfig:
        canon = self.canonical_nodes()
        for i, s in enumerate(self.stages):
            if canon % s.num_machines and s.num_machines % canon:
                raise ValueError(
                    f"train.stages.{i}.num_machines: {s.num_machines} nodes neither divide nor "
                    f"are a multiple of train.num_canonical_nodes ({canon}): streaming cannot "
                    "split the sample order across them"
                )
        return self

    def canonical_nodes(self) -> int:
        """Streaming's canonical node count for every stage of this run."""
        if self.num_canonical_nodes is not None:
            return self.num_canonical_nodes
        return 64 if self.shuffle_algo in ("py1s", "py2s") else 1

    @model_validator(mode="after")
    def _increasing(self) -> TrainConfig:
        res = [s.resolution for s in self.stages]
        if res != sorted(res) or len(set(res)) != len(res):
            raise ValueError(f"stage resolutions must strictly increase, got {res}")
        return self


class FaultInjection(Strict):
    """Test seams for crash, hang, divergence and desync handling. A kill or stall fires once
    per stage folder (a marker file remembers it), so the relaunch that follows runs through;
    `nan_at_step` and `desync_rank` act on every launch, as a real divergence or desync would."""

    kill_at_steps: list[int] = Field(
        default_factory=list, description="SIGKILL the process right after these steps."
    )
    stall_at_step: int | None = Field(None, description="Hang (stop heartbeating) at this step.")
    nan_at_step: int | None = Field(
        None, ge=1, description="Make the loss NaN at this optimizer step (a divergence)."
    )
    kill_in_export: list[
        Literal["after_raw", "after_final_tmp", "after_final", "after_manifest_tmp"]
    ] = Field(default_factory=list, description="SIGKILL the main process at these export points.")
    desync_rank: int | None = Field(
        None, ge=0, description="Perturb this rank's UNet weights right before the export."
    )


class StageRun(Strict):
    """Everything one `accelerate launch -m models.train` needs: the resolved stage.yaml."""

    train: TrainConfig
    stage_index: int = Field(ge=0)
    shards: str = Field(description="Local folder of the stage's MDS dataset.")
    output_dir: str = Field(description="Stage folder: checkpoints/, final/, metrics.jsonl.")
    init_from_dir: str | None = Field(None, description="Previous stage's final/ export.")
    tracking_uri: str | None = None
    mlflow_run_id: str | None = None
    mix_shards: list[str] = Field(
        default_factory=list, description="Local folders of train.mix, in order, for this stage."
    )
    shards_remote: str | None = Field(
        None, description="Published copy of `shards` (s3://...) streamed into `shards_cache`."
    )
    shards_cache: str | None = Field(None, description="Local cache folder for shards_remote.")
    mix_remotes: list[str] = Field(
        default_factory=list, description="Published copies of mix_shards, in order."
    )
    mix_caches: list[str] = Field(
        default_factory=list, description="Local cache folders for mix_remotes, in order."
    )
    s3_endpoint_url: str | None = Field(None, description="S3-compatible endpoint for remotes.")
    gpu_hour_usd: float = Field(0.0, ge=0, description="Price of one device-hour, for cost.")
    val_shards: str | None = Field(
        None,
        description="Local folder of the stage's held-out validation split (same columns as "
        "`shards`); unset: no validation loss.",
    )
    faults: FaultInjection = Field(default_factory=FaultInjection)

    @property
    def stage(self) -> StageConfig:
        return self.train.stages[self.stage_index]

    @model_validator(mode="after")
    def _remotes_match(self) -> StageRun:
        if (self.shards_remote is None) != (self.shards_cache is None):
            raise ValueError("shards_remote and shards_cache are set together")
        if self.shards_remote and not (
            len(self.mix_remotes) == len(self.mix_caches) == len(self.mix_shards)
        ):
            raise ValueError("with shards_remote, every mix_shards entry needs a remote and a "
                             f"cache (received {len(self.mix_shards)} mix_shards, "
                             f"{len(self.mix_remotes)} mix_remotes, {len(self.mix_caches)} "
                             "mix_caches)")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _index_in_range(self) -> StageRun:
        if self.stage_index >= len(self.train.stages):
            raise ValueError(
                f"stage_index {self.stage_index} out of range for {len(self.train.stages)} stages"
            )
        return self


# -- pipeline sections that tasks read (composed by `flows.config`) -------------------------


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
    val_fraction: float = Field(
        0.01,
        ge=0,
        lt=1,
        description="Share of images held out as each stage's validation split, chosen by a "
        "hash of the image key; 0: no split.",
    )
    val_max: int = Field(2000, ge=0, description="Cap on the validation split's images.")

    @field_validator("remote")
    @classmethod
    def _remote(cls, v: str | None) -> str | None:
        if v is not None and "://" in v and not v.startswith("s3://"):
            raise ValueError(f"must be s3://bucket/prefix or a folder (received {v!r})")
        if v is not None and v.startswith("s3://") and not v[5:].split("/")[0]:
            raise ValueError(f"names no bucket (received {v!r})")
        return v.rstrip("/") if v else v


class EvalMetricsConfig(Strict):
    """Automated image metrics of `kiln evaluate`; each is skipped (and says so) when its
    weights are not configured or not found."""

    clip_model: str | None = Field(
        None, description="CLIP model for CLIP score: a local folder or a hub id (transformers)."
    )
    inception_weights: str | None = Field(
        None, description="Local path of the FID Inception weights (torch-fidelity's .pth)."
    )
    fid_max_images: int = Field(
        2000, gt=0, description="Validation images (and as many generated) for FID."
    )


class EvaluateConfig(Strict):
    prompts_csv: str | None = Field(
        None,
        description="CSV with columns Prompts,Category. Unset: KILN_DRAWBENCH_CSV, else the 200 "
        "DrawBench prompts fetched once from the Hugging Face Hub (tasks/prompts.py).",
    )
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    num_inference_steps: int = Field(25, gt=0)
    guidance_scale: float = Field(7.5, ge=0)
    batch_size: int = Field(8, gt=0)
    limit: int | None = Field(None, gt=0, description="Use only the first N prompts.")
    metrics: EvalMetricsConfig = Field(default_factory=EvalMetricsConfig)


class GateConfig(Strict):
    """What `kiln promote` needs before `champion` moves to a candidate (tasks/promotion.py)."""

    min_votes_per_pair: int = Field(
        3, ge=1, description="Fewest human votes every compared pair must have, per question."
    )
    min_pref_ci_low: float = Field(
        0.5, ge=0, le=1, description="Lower 95% CI bound of the candidate's preference rate."
    )
    min_category_pref: float = Field(
        0.4, ge=0, le=1, description="No DrawBench category's preference may be below this."
    )
    max_val_loss_increase: float = Field(
        0.02, ge=0, description="Validation loss may exceed the champion's by this fraction."
    )


class GpuLimitConfig(Strict):
    """A Prefect global concurrency limit held around every `accelerate launch`, so runs from
    the UI, schedules and triggers never share the GPUs (tasks/gpu_limit.py)."""

    name: str = Field("gpu", min_length=1, description="The global concurrency limit's name.")
    slots: int = Field(
        1, ge=1, description="Its slots when Kiln creates it on first use (launches at once)."
    )
    lease_s: float = Field(
        300, ge=60, le=86400, description="Lease of a held slot (the server accepts 60 s to a "
        "day), renewed while the launch runs; a killed holder's slot frees itself after this "
        "long on a Prefect server.",
    )  # fmt: skip


class SlurmConfig(Strict):
    """Where and how a stage's job is submitted when `launch.backend` is `slurm`. The cluster
    is the one the SLURM commands on PATH reach (`SLURM_CONF` as usual)."""

    partition: str | None = Field(None, description="None: the cluster's default partition.")
    account: str | None = None
    time_limit: str | None = Field(None, description="sbatch --time, e.g. 2-00:00:00.")
    gpus_per_node: int | None = Field(
        None, ge=1, description="sbatch --gpus-per-node; also each node's process count."
    )
    sbatch_lines: list[str] = Field(
        default_factory=list, description="Extra `#SBATCH` lines, e.g. `--exclusive`."
    )
    main_process_port: int = Field(
        29500, gt=0, le=64536, description="Rendezvous port on the job's first node, plus the "
        "job id modulo 1000 (so two jobs that share a first node do not collide).",
    )  # fmt: skip
    poll_s: float = Field(2.0, gt=0, description="How often the job's state and log are read.")


class KubernetesConfig(Strict):
    """Where and how a stage's Kubeflow Trainer `TrainJob` runs when `launch.backend` is
    `kubernetes`. The cluster is the one the Kubernetes client finds the standard way (the
    in-cluster service account, else `KUBECONFIG` or ~/.kube/config)."""

    image: str | None = Field(
        None, description="Container image with Kiln installed at its working directory "
        "(required for the kubernetes backend).",
    )  # fmt: skip
    namespace: str = "default"
    runtime: str = Field(
        "torch-distributed", description="The ClusterTrainingRuntime the TrainJob refers to."
    )
    context: str | None = Field(None, description="kubeconfig context; None: the current one.")
    gpus_per_node: int | None = Field(
        None, ge=1, description="nvidia.com/gpu per node; also each node's process count."
    )
    resources_per_node: dict[str, str] = Field(
        default_factory=dict, description="More limits per node, e.g. {cpu: '32', memory: 400Gi}."
    )
    storage_claim: str | None = Field(
        None, description="PersistentVolumeClaim holding the storage root, mounted on every "
        "node at mount_path; None: the runtime mounts the shared filesystem itself.",
    )  # fmt: skip
    mount_path: str | None = Field(
        None, description="Where storage_claim is mounted: the storage root's absolute path, "
        "the same as on the machine that runs the flow.",
    )  # fmt: skip
    env: dict[str, str] = Field(
        default_factory=dict, description="Environment of every node, e.g. NCCL_SOCKET_IFNAME."
    )
    node_selector: dict[str, str] = Field(default_factory=dict)
    poll_s: float = Field(5.0, gt=0, description="How often the job's status and log are read.")

    @model_validator(mode="after")
    def _claim_has_a_path(self) -> KubernetesConfig:
        if self.storage_claim and not (self.mount_path and self.mount_path.startswith("/")):
            raise ValueError(
                f"launch.kubernetes.mount_path: storage_claim {self.storage_claim!r} needs the "
                f"absolute path to mount it at (received {self.mount_path!r})"
            )
        return self


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
    gpu_limit: GpuLimitConfig | None = Field(
        default_factory=GpuLimitConfig,
        description="Global concurrency limit taken around every local launch; null: none. "
        "On a cluster backend the cluster's scheduler owns the GPUs.",
    )
    backend: Literal["local", "slurm", "kubernetes"] = Field(
        "local", description="local: `accelerate launch` on this machine; slurm: one SLURM "
        "job per stage on its `num_machines` nodes; kubernetes: one Kubeflow Trainer TrainJob "
        "per stage. A cluster backend needs the storage root on a shared filesystem.",
    )  # fmt: skip
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    kubernetes: KubernetesConfig = Field(default_factory=KubernetesConfig)
    gpu_memory_gb: float = Field(
        80.0, gt=0, description="Memory of each GPU (GB): `kiln plan` and the train flow check "
        "every stage's per-GPU memory (tasks/memory_model.py) against it.",
    )  # fmt: skip
    inter_node_gbps: float = Field(
        400.0, gt=0, description="Network bandwidth of each node (Gbit/s; p4de: 400): "
        "`kiln plan`'s gradient traffic and scaling efficiency (tasks/scale_model.py).",
    )  # fmt: skip

    @model_validator(mode="after")
    def _kubernetes_has_an_image(self) -> LaunchConfig:
        if self.backend == "kubernetes" and not self.kubernetes.image:
            raise ValueError(
                "launch.kubernetes.image: the kubernetes backend runs each node in a container "
                "image with Kiln installed; name it (received None)"
            )
        return self


# "Value error, train.stages.1.num_machines: ..." : a model validator's message that already
# starts with the field's dotted path.
_NAMED = re.compile(r"^Value error, ([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)+: .*)$", re.DOTALL)


def format_validation_error(err: ValidationError, source: str) -> str:
    """Render each error as `dotted.path: message (received value)`."""
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        own = _NAMED.match(e["msg"]) if e["type"] == "value_error" else None
        if own:  # a check across fields that names the field and the value itself
            lines.append(f"  {own.group(1)}")
            continue
        path = ".".join(str(p) for p in e["loc"]) or "<root>"
        received = e.get("input")
        shown = repr(received)
        if len(shown) > 120:
            shown = shown[:117] + "..."
        lines.append(f"  {path}: {e['msg']} (received {shown})")
    return "\n".join(lines)


def _merge(base: dict, over: dict) -> dict:
    """`over` on top of `base`: mappings merge key by key; lists and scalars replace."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def read_yaml(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict:
    """A YAML mapping, with its `base:` file (relative to its folder) merged underneath.

    `base: tiny.yaml` lets a variant state only what differs from a preset. The merge is by
    key: mappings merge, lists (such as `train.stages`) and scalars replace. Relative paths in
    either file resolve against the folder of the file Kiln was given.

    Raises:
        ConfigError: A missing file, invalid YAML, a non-mapping, or a `base:` cycle.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    if path.resolve() in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, path.resolve()))
        raise ConfigError(f"base: the configs include each other ({chain})")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config {path} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"base: expected the path of a config file (received {base!r})")
    seen = (*_seen, path.resolve())
    try:
        under = read_yaml(path.parent / base, seen)
    except ConfigError as e:
        raise ConfigError(f"{path}: base: {e}") from None
    return _merge(under, data)


def load_yaml_model(model: type[BaseModel], path: str | Path) -> Any:
    """Load a YAML file (and its `base:`) into `model`, raising :class:`ConfigError` with
    dotted field paths."""
    path = Path(path)
    data = read_yaml(path)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, str(path))) from None
