"""The `train` section, and `StageRun`: one stage's resolved input, the only file a launched
training process reads.
"""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    model_validator,
)

from kiln_config.base import EnvPath, Strict
from kiln_config.evaluate import GUIDANCE_SCALE, INFERENCE_STEPS
from kiln_config.model import ModelConfig

__all__ = [
    "DEFAULT_SAMPLE_PROMPTS",
    "EMAConfig",
    "FaultInjection",
    "StageConfig",
    "StageRun",
    "StreamMix",
    "TrainConfig",
    "sharding_conflict",
]


Sharding = Literal["ddp", "shard_grad_op", "full_shard"]


def sharding_conflict(distributed_type: str, mixed_precision: str) -> str | None:
    """Why `train.sharding` cannot run on a topology of this distributed type and mixed
    precision, or None: Kiln shards the UNet itself, on a DDP topology, in bf16 or fp32."""
    if str(distributed_type).upper() == "FSDP":
        return "needs a DDP topology (multi-gpu.yaml, cpu-ddp-2.yaml), not an FSDP one"
    if str(mixed_precision) == "fp16":
        return "trains in bf16 or fp32, not fp16 (no gradient scaler on the sharded path)"
    return None


class StageConfig(Strict):
    resolution: int = Field(gt=0)
    batch_size: int = Field(gt=0, description="Per-process micro-batch size.")
    learning_rate: float = Field(gt=0)
    max_steps: int = Field(gt=0, description="Optimizer steps in this stage.")
    gradient_accumulation_steps: int = Field(1, ge=1)
    warmup_steps: int = Field(0, ge=0)
    lr_scheduler: Literal["constant", "cosine"] = "constant"
    num_machines: int = Field(
        1,
        ge=1,
        description="Nodes this stage trains on (more than 1: launch.backend slurm or "
        "kubernetes); each runs the backend's gpus_per_node processes, else launch."
        "num_processes or the topology's count.",
    )
    gradient_checkpointing: bool | None = Field(
        None,
        description="Recompute each ResNet and transformer block's activations in the backward "
        "pass for this stage (less memory, about a third more compute); null: "
        "train.gradient_checkpointing.",
    )
    sharding: Sharding | None = Field(
        None, description="This stage's sharding of the UNet; null: train.sharding."
    )

    def global_batch(self, processes: int) -> int:
        """Samples per optimizer step over `processes` training processes: the micro-batch,
        times the accumulated micro-batches, times the processes."""
        return self.batch_size * self.gradient_accumulation_steps * processes


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
        "stochastically (models/components/ema.py).",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute each ResNet and transformer block's activations in the backward "
        "pass (less activation memory, about a third more compute per step); a stage's own "
        "gradient_checkpointing overrides it. `kiln plan` shows both.",
    )
    sharding: Sharding = Field(
        "ddp",
        description="How the UNet's training state is spread over the processes: ddp (each "
        "holds all of it), shard_grad_op (FSDP: gradients and AdamW state sharded) or "
        "full_shard (FSDP: parameters sharded too); a stage's own sharding overrides it. "
        "models/components/sharding.py.",
    )
    init_from: Literal["ema", "raw"] = "ema"
    init_from_model: EnvPath | None = Field(
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
    sample_steps: int = Field(INFERENCE_STEPS, gt=0, description="Inference steps per grid image.")
    sample_guidance_scale: float = Field(
        GUIDANCE_SCALE, ge=0, description="Classifier-free guidance."
    )

    @model_validator(mode="after")
    def _mix_total(self) -> TrainConfig:
        total = sum(m.proportion for m in self.mix)
        if total >= 1:
            raise ValueError(
                f"train.mix proportions sum to {total:g}; they must leave the "
                "current dataset a share (sum < 1)"
            )
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

    @model_validator(mode="after")
    def _sharding_compiles_not(self) -> TrainConfig:
        sharded = [i for i in range(len(self.stages)) if self.stage_sharding(i) != "ddp"]
        if self.compile and sharded:
            raise ValueError(
                f"train.compile is not supported with train.sharding (stage {sharded[0] + 1} "
                f"shards with {self.stage_sharding(sharded[0])}): set one of them off"
            )
        return self

    def checkpointing(self, stage_index: int) -> bool:
        """Whether stage `stage_index` trains with gradient checkpointing."""
        own = self.stages[stage_index].gradient_checkpointing
        return self.gradient_checkpointing if own is None else own

    def stage_sharding(self, stage_index: int) -> str:
        """Stage `stage_index`'s sharding: its own, else `train.sharding`."""
        return self.stages[stage_index].sharding or self.sharding

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
            raise ValueError(
                "with shards_remote, every mix_shards entry needs a remote and a "
                f"cache (received {len(self.mix_shards)} mix_shards, "
                f"{len(self.mix_remotes)} mix_remotes, {len(self.mix_caches)} "
                "mix_caches)"
            )
        return self

    @model_validator(mode="after")
    def _index_in_range(self) -> StageRun:
        if self.stage_index >= len(self.train.stages):
            raise ValueError(
                f"stage_index {self.stage_index} out of range for {len(self.train.stages)} stages"
            )
        return self
