"""The memory model against one real training step on CPU (tests/tasks/_measure_step_memory.py,
a fresh process per case): parameters, gradients and AdamW state exactly; activations within
25% of the measured rise of the process's peak resident memory."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.config import load_config
from tasks.activation_trace import unet_parameter_count
from tasks.memory_model import Setup, stage_memory

REPO = Path(__file__).resolve().parents[2]
TINY = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())["train"]["model"]["unet"]
SD2 = yaml.safe_load((REPO / "configs" / "sd2-base.yaml").read_text())["train"]["model"]["unet"]
# The real recipe's widths, head counts and text width with fewer blocks.
SD2_REDUCED = {**SD2, "block_out_channels": [320, 640], "layers_per_block": 1,
               "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
               "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
               "attention_head_dim": [5, 10]}  # fmt: skip


def _measure(unet: dict, batch: int, side: int, attention: str) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "_measure_step_memory.py"),
         json.dumps([unet, batch, side, 77, attention])],
        capture_output=True, text=True, check=True, env=env, timeout=600,
    )  # fmt: skip
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
    ("name", "unet", "batch", "side", "attention"),
    [
        ("tiny", TINY, 32, 32, "sdpa"),
        ("tiny-eager", TINY, 32, 32, "eager"),
        ("sd2-widths", SD2_REDUCED, 2, 16, "sdpa"),
    ],
)
def test_memory_model_matches_a_measured_step(name, unet, batch, side, attention):
    train = _train(unet, batch, side, attention)
    setup = Setup(strategy="ddp", mixed_precision="no", world=1, precomputed=True)
    predicted = stage_memory(train, 0, setup)
    measured = _measure(unet, batch, side, attention)
    assert predicted.parameters == measured["parameters"]
    assert predicted.gradients == measured["gradients"]
    assert predicted.optimizer == measured["optimizer"]
    assert predicted.comm_buffers == 0 and predicted.frozen_encoders == 0
    error = predicted.activations / measured["activations"] - 1
    assert abs(error) <= 0.25, (name, predicted.activations, measured["activations"])


def test_the_real_size_unet_is_counted_on_meta():
    assert unet_parameter_count(SD2) == 865_910_724
