"""The memory model against one real training step on CPU
(tests/tasks/planning/_measure_step_memory.py, a fresh process per case): parameters, gradients and
AdamW state exactly; activations within 25% of the measured rise of the process's peak resident
memory, in fp32 and CPU bf16 autocast, with and without gradient checkpointing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kiln_config import load_config
from tasks.planning.activation_trace import (
    _trace,
    fsdp_units,
    trace_activations,
    unet_parameter_count,
)
from tasks.planning.memory_model import Setup, stage_memory

REPO = Path(__file__).resolve().parents[3]
TINY = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())["train"]["model"]["unet"]
SD2 = yaml.safe_load((REPO / "configs" / "sd2-base.yaml").read_text())["train"]["model"]["unet"]
# The real recipe's widths, head counts and text width with fewer blocks.
SD2_REDUCED = {
    **SD2,
    "block_out_channels": [320, 640],
    "layers_per_block": 1,
    "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
    "attention_head_dim": [5, 10],
}


def _measure(unet: dict, batch: int, side: int, attention: str, ckpt: bool, precision: str):
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).parent / "_measure_step_memory.py"),
            json.dumps([unet, batch, side, 77, attention, ckpt, precision]),
        ],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        timeout=600,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _train(unet: dict, batch: int, side: int, attention: str):
    """A tiny pipeline config with this UNet and one stage whose latents are side x side
    (the frozen encoders are left out: the cases count precomputed latents)."""
    train = load_config(REPO / "configs" / "tiny.yaml").train
    factor = 2 ** (len(train.model.vae.config["block_out_channels"]) - 1)
    stage = train.stages[0].model_copy(update={"resolution": side * factor, "batch_size": batch})
    model = train.model.model_copy(update={"unet": unet})
    return train.model_copy(update={"model": model, "stages": [stage], "attention": attention})


@pytest.mark.parametrize(
    ("unet", "batch", "side", "attention", "ckpt", "precision"),
    [
        pytest.param(TINY, 32, 32, "sdpa", False, "no", id="tiny"),
        pytest.param(TINY, 32, 32, "eager", False, "no", id="tiny-eager-attention"),
        pytest.param(TINY, 32, 32, "sdpa", True, "no", id="tiny-checkpointing"),
        pytest.param(TINY, 32, 32, "sdpa", False, "bf16", id="tiny-bf16"),
        pytest.param(SD2_REDUCED, 2, 16, "sdpa", False, "no", id="sd2-widths"),
        pytest.param(SD2_REDUCED, 4, 32, "sdpa", True, "no", id="sd2-widths-checkpointing"),
        pytest.param(SD2_REDUCED, 2, 16, "sdpa", False, "bf16", id="sd2-widths-bf16"),
    ],
)
def test_memory_model_matches_a_measured_step(unet, batch, side, attention, ckpt, precision):
    train = _train(unet, batch, side, attention)
    setup = Setup(strategy="ddp", checkpointing=ckpt, mixed_precision="no", precomputed=True)
    predicted = stage_memory(train, 0, setup)
    measured = _measure(unet, batch, side, attention, ckpt, precision)
    assert predicted.parameters == measured["parameters"]
    assert predicted.gradients == measured["gradients"]
    assert predicted.optimizer == measured["optimizer"]
    assert predicted.comm_buffers == 0 and predicted.frozen_encoders == 0
    activations = trace_activations(unet, batch, side, 77, attention).peak_bytes(
        precision,
        ckpt,
        fp32_norms=False,  # CPU autocast runs the norms in bf16
    )
    if precision == "bf16":  # autocast's bf16 weight copies, held through the step
        activations += predicted.parameters // 2
    error = activations / measured["activations"] - 1
    assert abs(error) <= 0.25, (activations, measured["activations"])


def test_the_real_size_unet_is_counted_on_meta():
    assert unet_parameter_count(SD2) == 865_910_724


def test_sharding_buckets_and_ema_by_setup():
    """DDP holds everything plus its gradient buckets and autocast's bf16 weight copies;
    SHARD_GRAD_OP shards gradients and AdamW state over the world and keeps the parameters
    whole in bf16 beside its fp32 shard; the EMA copy follows train.ema and train.ema_dtype."""
    from tasks.planning.memory_model import ema_bytes_per_param

    train = _train(TINY, 8, 16, "sdpa")
    n = unet_parameter_count(TINY)
    ddp = stage_memory(train, 0, Setup("ddp", False, "bf16", world=8, precomputed=True))
    assert (ddp.parameters, ddp.gradients, ddp.optimizer) == (6 * n, 4 * n, 8 * n)
    assert ddp.comm_buffers == 4 * n and ddp.ema == 4 * n
    fsdp = stage_memory(train, 0, Setup("fsdp", False, "bf16", world=8, precomputed=True))
    assert fsdp.parameters == 2 * n + -(-4 * n // 8)
    assert (fsdp.gradients, fsdp.optimizer) == (-(-4 * n // 8), -(-8 * n // 8))
    assert fsdp.comm_buffers == 0 and fsdp.activations == ddp.activations
    # FULL_SHARD (Kiln's train.sharding): fp32 shards of everything; the root's own
    # parameters and two blocks (one computing, one prefetched) gathered in bf16, and one
    # block's bf16 gradients before their reduce-scatter.
    root, block = fsdp_units(TINY)
    assert 0 < root < block < n
    full = stage_memory(train, 0, Setup("full_shard", False, "bf16", world=8, precomputed=True))
    assert full.parameters == -(-4 * n // 8) + (root + 2 * block) * 2
    assert full.gradients == -(-4 * n // 8) + 2 * block
    assert full.optimizer == fsdp.optimizer and full.comm_buffers == 0
    ckpt = stage_memory(train, 0, Setup("ddp", True, "bf16", world=8, precomputed=True))
    assert ckpt.activations < ddp.activations
    no_ema = train.model_copy(update={"ema": train.ema.model_copy(update={"enabled": False})})
    assert ema_bytes_per_param(no_ema) == 0 and ema_bytes_per_param(train) == 4
    bf16 = train.model_copy(update={"ema_dtype": "bfloat16"})
    assert ema_bytes_per_param(bf16) == 2
    # Without precomputed latents the frozen encoders count, in the training dtype.
    with_encoders = stage_memory(train, 0, Setup("ddp", False, "bf16", world=8))
    assert with_encoders.frozen_encoders > 0
    assert with_encoders.frozen_encoders % 2 == 0


def test_encoders_in_a_local_folder_are_counted_and_a_hub_id_is_not(tmp_path):
    """`pretrained` pointing at a saved folder counts its parameters (config.json on meta);
    a hub id is left uncounted rather than downloaded."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel

    from kiln_config import Component, VaeComponent
    from tasks.planning.memory_model import encoder_params

    train = load_config(REPO / "configs" / "tiny.yaml").train
    inline = encoder_params(train)
    vae = AutoencoderKL.from_config(train.model.vae.config)
    vae.save_pretrained(tmp_path / "pipe" / "vae")
    te = CLIPTextModel(CLIPTextConfig(**train.model.text_encoder.config))
    te.save_pretrained(tmp_path / "pipe" / "text_encoder")
    local = train.model.model_copy(
        update={
            "vae": VaeComponent(pretrained=str(tmp_path / "pipe"), subfolder="vae"),
            "text_encoder": Component(pretrained=str(tmp_path / "pipe"), subfolder="text_encoder"),
        }
    )
    counted = encoder_params(train.model_copy(update={"model": local}))
    assert counted == inline
    assert counted["vae"] == sum(p.numel() for p in vae.parameters())
    assert counted["text_encoder"] == sum(p.numel() for p in te.parameters())
    hub = train.model.model_copy(
        update={
            "text_encoder": Component(
                pretrained="stabilityai/stable-diffusion-2-base", subfolder="text_encoder"
            )
        }
    )
    assert encoder_params(train.model_copy(update={"model": hub}))["text_encoder"] is None


def test_a_batch_traces_as_that_many_single_samples():
    """What autograd saves scales with the batch exactly, so the planner traces one sample
    per resolution: traced whole at a batch of 3, the figures are three single samples'."""
    whole = _trace(json.dumps(SD2_REDUCED, sort_keys=True), 3, 16, 77, "eager")
    assert whole == trace_activations(SD2_REDUCED, 3, 16, 77, "eager")
