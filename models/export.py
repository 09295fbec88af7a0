"""The exported pipeline's format, written by one function: the stage's `final/` export and
the sample grids' temporary exports (models/sample_grid.py) are the same bytes for the same
weights, so a grid shows what `kiln evaluate` will load."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import torch
from diffusers import StableDiffusionPipeline
from diffusers.training_utils import EMAModel

from models.factory import Components, sampling_scheduler

__all__ = ["export_unet", "write_pipeline"]


def write_pipeline(comps: Components, unet: torch.nn.Module, path: Path) -> None:
    """Write the fp32 diffusers pipeline of `unet` and the frozen components to `path`,
    replacing whatever is there (a stale copy left by a killed launch included).

    The VAE and text encoder are cast to fp32 in place, the export's dtype: a caller that
    goes on training casts them back to the training dtype.
    """
    pipe = StableDiffusionPipeline(
        vae=comps.vae.to(torch.float32),
        text_encoder=comps.text_encoder.to(torch.float32),
        tokenizer=comps.tokenizer,
        unet=unet.to(torch.float32),
        scheduler=sampling_scheduler(comps.noise_scheduler),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    shutil.rmtree(path, ignore_errors=True)
    pipe.save_pretrained(path)


def export_unet(unet: torch.nn.Module, ema: EMAModel | None) -> torch.nn.Module:
    """The UNet an export holds: a copy carrying the EMA weights when EMA is on (the training
    UNet keeps its raw weights untouched), else `unet` itself."""
    if ema is None:
        return unet
    copied = copy.deepcopy(unet)
    ema.copy_to(copied.parameters())
    return copied
