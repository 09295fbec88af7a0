"""GPU memory of a training stage, per process, from the config alone (nothing allocated).

What one training process holds, as Kiln trains (models/train.py): the UNet's fp32 master
weights (Accelerate's mixed precision keeps fp32 parameters and autocasts the compute), their
fp32 gradients, AdamW's two fp32 moments, the EMA copy, the frozen VAE and text encoder in the
training dtype (when latents are not precomputed), and the activations of one micro-batch
(`tasks.planning.activation_trace`: a meta-device trace of what autograd saves).

Two ways to spread the state over the `world` processes of a stage:

- `ddp`: every process holds everything; DDP's gradient buckets are a second fp32 copy of the
  gradients (Accelerate's default `gradient_as_bucket_view=False`), and bf16 autocast keeps a
  2-byte copy of each weight for the step;
- `fsdp` (`SHARD_GRAD_OP`, ZeRO-2): gradients and optimizer state are sharded over the world
  size; the parameters stay whole for the forward and backward passes (in the compute dtype),
  and each process keeps its fp32 shard.

Each can run with gradient checkpointing (every ResNet and transformer block recomputed).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from kiln_config import Component, TrainConfig
from tasks.planning.activation_trace import fsdp_units, trace_activations, unet_parameter_count
from tasks.planning.topology import topology_setup

__all__ = [
    "CHECKPOINTING_COST",
    "GB",
    "Setup",
    "StageMemory",
    "ema_bytes_per_param",
    "memory_plan",
    "recommend",
    "encoder_params",
    "stage_line",
    "stage_memory",
    "stage_strategy",
]

GB = 1e9
_ADAMW_STATE = 8  # two fp32 moments per parameter
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Setup:
    """How a stage runs: sharding, checkpointing, precision, world size and GPU memory."""

    strategy: str = "ddp"  # ddp | fsdp (SHARD_GRAD_OP) | full_shard
    checkpointing: bool = False
    mixed_precision: str = "bf16"  # no | bf16 | fp16 (the accelerate config's)
    world: int = 1
    gpu_memory_gb: float = 80.0
    precomputed: bool = False  # latents and text states read from shards: no frozen encoders

    @property
    def label(self) -> str:
        """The strategy (`ddp`, `fsdp` for SHARD_GRAD_OP, `full_shard`), `+ckpt` with
        gradient checkpointing."""
        return self.strategy + ("+ckpt" if self.checkpointing else "")


@dataclass
class StageMemory:
    """Bytes per GPU by component, for one stage in one :class:`Setup`."""

    setup: str
    batch_size: int
    parameters: int
    gradients: int
    optimizer: int
    ema: int
    comm_buffers: int
    frozen_encoders: int
    activations: int
    total: int
    fits: bool
    gpu_bytes: int

    def as_dict(self) -> dict:
        """The fields, for JSON."""
        return asdict(self)


def ema_bytes_per_param(train: TrainConfig) -> int:
    """Bytes per UNet parameter of the EMA copy: 0 with EMA off, else the size of
    `train.ema_dtype` ('float32' or 'bfloat16', models/components/ema.py)."""
    if not train.ema.enabled:
        return 0
    return _DTYPE_BYTES[train.ema_dtype]


def _local_config(comp: Component, default_subfolder: str) -> dict | None:
    """The component's config dict: given inline, or a local folder's config.json."""
    if comp.config is not None:
        return comp.config
    folder = Path(comp.pretrained or "").expanduser() / (comp.subfolder or default_subfolder)
    path = folder / "config.json"
    if not path.is_file():
        path = Path(comp.pretrained or "").expanduser() / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def encoder_params(train: TrainConfig) -> dict[str, int | None]:
    """Parameter counts of the frozen VAE and text encoder, on the meta device; None for a
    component known only by a hub id (the plan never downloads)."""
    import torch
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel

    out: dict[str, int | None] = {}
    vae_cfg = _local_config(train.model.vae, "vae")
    text_cfg = _local_config(train.model.text_encoder, "text_encoder")
    with torch.device("meta"):
        out["vae"] = (
            sum(p.numel() for p in AutoencoderKL.from_config(vae_cfg).parameters())
            if vae_cfg
            else None
        )
        if text_cfg:
            text_cfg = {k: v for k, v in text_cfg.items() if not k.startswith("_")}
            model = CLIPTextModel(CLIPTextConfig(**text_cfg))
            out["text_encoder"] = sum(p.numel() for p in model.parameters())
        else:
            out["text_encoder"] = None
    return out


def _vae_factor(train: TrainConfig) -> int:
    cfg = _local_config(train.model.vae, "vae")
    blocks = len((cfg or {}).get("block_out_channels", [0, 0, 0, 0]))
    return 2 ** (blocks - 1)


def _state_bytes(n: int, setup: Setup, ema_b: int, units: tuple[int, int]) -> dict[str, int]:
    """Parameters, gradients, optimizer state, EMA and communication buffers per GPU."""
    half = setup.mixed_precision in ("bf16", "fp16")
    if setup.strategy == "full_shard":  # FULL_SHARD: fp32 shards; a unit gathered at a time
        root, block = units
        compute = 2 if half else 4
        return {
            # the root's own parameters, the block computing and the next one prefetched
            "parameters": -(-n * 4 // setup.world) + (root + 2 * block) * compute,
            # one block's, in the compute dtype, before its reduce-scatter
            "gradients": -(-n * 4 // setup.world) + block * compute,
            "optimizer": -(-n * _ADAMW_STATE // setup.world),
            "ema": n * ema_b,
            "comm_buffers": 0,
        }
    if setup.strategy == "fsdp":  # SHARD_GRAD_OP: whole compute-dtype params, fp32 shard
        return {
            "parameters": n * (2 if half else 4) + -(-n * 4 // setup.world),
            "gradients": -(-n * 4 // setup.world),
            "optimizer": -(-n * _ADAMW_STATE // setup.world),
            "ema": n * ema_b,
            "comm_buffers": 0,
        }
    return {
        "parameters": n * 4 + (n * 2 if half else 0),  # fp32 master + autocast's weight copies
        "gradients": n * 4,
        "optimizer": n * _ADAMW_STATE,
        "ema": n * ema_b,
        "comm_buffers": n * 4 if setup.world > 1 else 0,  # DDP's gradient buckets
    }


def stage_memory(
    train: TrainConfig,
    stage_index: int,
    setup: Setup,
    *,
    batch_size: int | None = None,
    encoders: dict[str, int | None] | None = None,
    unet_params: int | None = None,
) -> StageMemory:
    """Bytes per GPU of one stage's training step in `setup`.

    Args:
        train: The `train` section.
        stage_index: The stage (its resolution and per-process batch).
        setup: Sharding, checkpointing, precision, world size and GPU memory.
        batch_size: A per-process batch other than the stage's (a recommendation's).
        encoders: `encoder_params(train)`, when already counted.
        unet_params: `unet_parameter_count(...)`, when already counted.

    Returns:
        The components, their total and whether it fits `setup.gpu_memory_gb`.
    """
    stage = train.stages[stage_index]
    batch = batch_size or stage.batch_size
    n = unet_params if unet_params is not None else unet_parameter_count(train.model.unet)
    units = fsdp_units(train.model.unet) if setup.strategy == "full_shard" else (0, 0)
    state = _state_bytes(n, setup, ema_bytes_per_param(train), units)
    seq = train.model.tokenizer.model_max_length
    side = max(1, stage.resolution // _vae_factor(train))
    trace = trace_activations(train.model.unet, batch, side, seq, train.attention)
    activations = trace.peak_bytes(setup.mixed_precision, setup.checkpointing)
    frozen = 0
    if not setup.precomputed:
        counts = encoders if encoders is not None else encoder_params(train)
        frozen = sum(c or 0 for c in counts.values()) * (
            2 if setup.mixed_precision in ("bf16", "fp16") else 4
        )
    total = sum(state.values()) + frozen + activations
    gpu = int(setup.gpu_memory_gb * GB)
    return StageMemory(
        setup=setup.label,
        batch_size=batch,
        **state,
        frozen_encoders=frozen,
        activations=activations,
        total=total,
        fits=total <= gpu,
        gpu_bytes=gpu,
    )


# Step time of each lever, by the plan's own model: a training sample is a forward and a
# backward (about three forwards); checkpointing runs each block's forward again in the
# backward pass. A smaller micro-batch with more accumulation does the same FLOPs per sample.
CHECKPOINTING_COST = 4 / 3


def _smaller_batch(train: TrainConfig, i: int, setup: Setup, **counts) -> tuple | None:
    """The largest per-process batch below the stage's that divides it and fits, with the
    accumulation that keeps the global batch; None if even a batch of 1 does not fit."""
    stage = train.stages[i]
    for b in range(stage.batch_size - 1, 0, -1):
        if stage.batch_size % b == 0:
            mem = stage_memory(train, i, setup, batch_size=b, **counts)
            if mem.fits:
                return b, stage.gradient_accumulation_steps * stage.batch_size // b, mem
    return None


def stage_line(train: TrainConfig, i: int, **changes) -> str:
    """Stage `i`'s entry of `train.stages` with `changes`, as a YAML line to paste in its
    place (only the fields that differ from their defaults, as a user writes them)."""
    entry = {**train.stages[i].model_dump(exclude_defaults=True), **changes}
    entry = {k: v for k, v in entry.items() if v is not None}
    flow = yaml.safe_dump(entry, default_flow_style=True, sort_keys=False, width=10**6)
    return "- " + flow.strip()


def _option(change: str, mem: StageMemory, cost: float, paste: str, **extra) -> dict:
    return {
        "change": change,
        "memory": mem.as_dict(),
        "step_time_factor": round(cost, 4),
        "paste": paste,
        "text": (
            f"{mem.total / GB:.3g} GB per GPU, step time +{cost - 1:.0%} by the plan's model; "
            f"{paste}"
        ),
        **extra,
    }


def _options(train: TrainConfig, i: int, setup: Setup, **counts) -> list[dict]:
    """Every change that makes stage `i` fit, cheapest first by the plan's step-time
    estimate (a tie keeps this order: a smaller micro-batch, FSDP, checkpointing, both)."""
    out = []
    smaller = _smaller_batch(train, i, setup, **counts)
    if smaller:
        b, accum, mem = smaller
        line = stage_line(train, i, batch_size=b, gradient_accumulation_steps=accum)
        out.append(
            _option(
                "batch_size",
                mem,
                1.0,
                f"replace train.stages[{i}] with  {line}  (global batch unchanged)",
                batch_size=b,
                gradient_accumulation_steps=accum,
            )
        )
    # Kiln's FSDP (train.sharding): on more than one process, not with compile or fp16.
    sharding_ok = setup.world > 1 and not train.compile and setup.mixed_precision != "fp16"
    if setup.strategy == "ddp" and sharding_ok:
        for name, strategy in (("shard_grad_op", "fsdp"), ("full_shard", "full_shard")):
            mem = stage_memory(train, i, Setup(**{**asdict(setup), "strategy": strategy}), **counts)
            if mem.fits:
                line = stage_line(train, i, sharding=name)
                out.append(_option(name, mem, 1.0, f"replace train.stages[{i}] with  {line}"))
                break  # FULL_SHARD only where SHARD_GRAD_OP does not fit: it gathers twice
    if not setup.checkpointing:
        on = Setup(**{**asdict(setup), "checkpointing": True})
        ckpt = stage_memory(train, i, on, **counts)
        if ckpt.fits:
            line = stage_line(train, i, gradient_checkpointing=True)
            out.append(
                _option(
                    "gradient_checkpointing",
                    ckpt,
                    CHECKPOINTING_COST,
                    f"replace train.stages[{i}] with  {line}",
                )
            )
        elif both := _smaller_batch(train, i, on, **counts):
            b, accum, mem = both
            line = stage_line(
                train,
                i,
                batch_size=b,
                gradient_accumulation_steps=accum,
                gradient_checkpointing=True,
            )
            out.append(
                _option(
                    "gradient_checkpointing+batch_size",
                    mem,
                    CHECKPOINTING_COST,
                    f"replace train.stages[{i}] with  {line}  (global batch unchanged)",
                    batch_size=b,
                    gradient_accumulation_steps=accum,
                )
            )
    return sorted(out, key=lambda o: o["step_time_factor"])  # stable: ties keep their order


def recommend(train: TrainConfig, i: int, setup: Setup, **counts) -> dict:
    """What to change for stage `i` to fit: the cheapest by the plan's step-time estimate of
    a smaller per-process batch with more accumulation (same global batch), Kiln's FSDP
    (`sharding: shard_grad_op`, else `full_shard`; more than one process), gradient
    checkpointing, and checkpointing with a smaller batch. Each is YAML to paste (`paste`);
    every other option that fits is under `alternatives`."""
    options = _options(train, i, setup, **counts)
    if not options:
        stage = train.stages[i]
        return {
            "change": None,
            "alternatives": [],
            "text": (
                f"nothing fits {setup.gpu_memory_gb:g} GB at batch 1 of {stage.resolution}px: a "
                "larger GPU (launch.gpu_memory_gb) or a smaller model"
            ),
        }
    first = dict(options[0])
    first["alternatives"] = options[1:]
    return first


def stage_strategy(train: TrainConfig, i: int, topology_strategy: str, world: int) -> str:
    """Stage `i`'s strategy for the memory and scale models: its `train.sharding` (Kiln's
    FSDP: `fsdp` for shard_grad_op, `full_shard`; on one process it shards nothing and trains
    as DDP would), else the topology's (`ddp` or `fsdp`)."""
    sharding = train.stage_sharding(i)
    if world == 1 and sharding != "ddp":
        return "ddp"
    return {"shard_grad_op": "fsdp", "full_shard": "full_shard"}.get(sharding, topology_strategy)


def memory_plan(
    train: TrainConfig,
    accelerate_config: str,
    worlds: list[int],
    gpu_memory_gb: float,
    precomputed: bool,
) -> list[dict]:
    """Per stage: the configured setup's memory, every setup's total, and a recommendation
    for a stage that does not fit."""
    strategy, precision = topology_setup(accelerate_config)
    counts = {
        "encoders": encoder_params(train),
        "unet_params": unet_parameter_count(train.model.unet),
    }
    out = []
    for i, world in enumerate(worlds):
        ckpt = train.checkpointing(i)
        kind = stage_strategy(train, i, strategy, world)
        base = Setup(kind, ckpt, precision, world, gpu_memory_gb, precomputed)
        mem = stage_memory(train, i, base, **counts)
        setups = {}
        for s, ck in [(s, ck) for s in ("ddp", "fsdp", "full_shard") for ck in (False, True)]:
            other = Setup(s, ck, precision, world, gpu_memory_gb, precomputed)
            setups[other.label] = stage_memory(train, i, other, **counts).total
        out.append(
            {
                "resolution": train.stages[i].resolution,
                "configured": mem.as_dict(),
                "setups_total": setups,
                "recommendation": None if mem.fits else recommend(train, i, base, **counts),
                "unknown_encoders": [
                    k for k, v in counts["encoders"].items() if v is None and not precomputed
                ],
            }
        )
    return out
