"""The denoising objective: a batch's latents and text states, the target, the loss.

`models.train` calls `denoising_loss` once per micro-batch. Every random draw (the noise, the
timesteps, the VAE's latent sample) comes from torch's global RNG, so a seeded call is
reproducible. The held-out validation loss (`models.evaluation.heldout`) uses the same pieces
(`encode_latents`, `encode_text`, `diffusion_target`) with noise from its own seeded generators.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.training_utils import compute_snr

from kiln_config.errors import InputError
from models.components.factory import Components
from models.data.collation import device_pixels
from models.data.images import normalize_pixels

__all__ = [
    "denoising_loss",
    "diffusion_target",
    "encode_batch",
    "encode_latents",
    "encode_text",
    "min_snr_weight",
]


def encode_batch(
    comps: Components, batch: dict, weight_dtype: torch.dtype, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's scaled VAE latents and text-encoder states (frozen encoders, no gradients)."""
    return (
        encode_latents(comps, batch, weight_dtype, device),
        encode_text(comps, batch, weight_dtype, device),
    )


def encode_latents(
    comps: Components, batch: dict, weight_dtype: torch.dtype, device, noise_like=None
) -> torch.Tensor:
    """A batch's scaled latents: a sample of the VAE's posterior (or of the precomputed one).

    Args:
        noise_like: Draws the posterior sample's standard normal noise shaped like its argument
            (the posterior mean). Default: `torch.randn_like`, torch's global RNG, as training
            does; the validation loss passes per-sample seeded noise, so its latents are fixed.
    """
    scale = comps.vae.config.scaling_factor
    with torch.no_grad():
        if "latent_mean" in batch:
            # Precomputed: sample the VAE's diagonal Gaussian as latent_dist.sample() does.
            mean = batch["latent_mean"].to(device, dtype=weight_dtype, non_blocking=True)
            std = batch["latent_std"].to(device, dtype=weight_dtype, non_blocking=True)
            return (mean + std * (noise_like or torch.randn_like)(mean)) * scale
        # The loader's batch has channels-last strides (see KilnCollate); the model gets the
        # standard layout, transposed here on the device (and flipped, hflip).
        pixels = device_pixels(batch, device)
        if pixels.dtype == torch.uint8:  # the loader ships uint8; normalise on the device
            pixels = normalize_pixels(pixels)
        dist = comps.vae.encode(pixels.to(weight_dtype)).latent_dist
        if noise_like is None:
            return dist.sample() * scale
        return (dist.mean + dist.std * noise_like(dist.mean)) * scale  # what sample() computes


def encode_text(comps: Components, batch: dict, weight_dtype: torch.dtype, device) -> torch.Tensor:
    """A batch's text-encoder states: stored (`text_hidden`, the empty caption's where `drop`
    says so) or encoded from `input_ids`."""
    with torch.no_grad():
        if "text_hidden" in batch:
            encoder_hidden = batch["text_hidden"].to(device, dtype=weight_dtype)
            drop = batch["drop"].to(device)
            if drop.any():  # caption dropout: the empty caption's states
                empty = comps.tokenizer(
                    "",
                    padding="max_length",
                    max_length=comps.tokenizer.model_max_length,
                    return_tensors="pt",
                ).input_ids.to(device)
                empty_hidden = comps.text_encoder(empty)[0].to(weight_dtype)
                # Not an in-place write: `.to` may return the batch's own tensor.
                encoder_hidden = torch.where(drop[:, None, None], empty_hidden, encoder_hidden)
            return encoder_hidden
        ids = batch["input_ids"].to(device, non_blocking=True)
        return comps.text_encoder(ids)[0]


def diffusion_target(sched, latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor):
    """What the UNet learns to predict: the noise (epsilon) or the velocity (v-prediction).

    Raises:
        ValueError: for another `prediction_type` of the noise scheduler.
    """
    kind = sched.config.prediction_type
    if kind == "v_prediction":  # v = sqrt(alpha_bar) * noise - sqrt(1 - alpha_bar) * x0
        return sched.get_velocity(latents, noise, t)
    if kind == "epsilon":
        return noise
    raise InputError(
        f"train.model.noise_scheduler.prediction_type {kind!r} is not supported: "
        "use 'epsilon' or 'v_prediction'"
    )


def min_snr_weight(sched, t: torch.Tensor, gamma: float) -> torch.Tensor:
    """Min-SNR-gamma weights (Hang et al. 2023), one per sample: min(SNR, gamma) / SNR for
    epsilon, / (SNR + 1) for v-prediction, so that easy low-noise steps stop dominating."""
    snr = compute_snr(sched, t)
    v_pred = sched.config.prediction_type == "v_prediction"
    return torch.clamp(snr, max=gamma) / (snr + 1 if v_pred else snr)


def denoising_loss(
    comps: Components, batch: dict, weight_dtype: torch.dtype, device, cfg=None
) -> torch.Tensor:
    """The denoising loss of one micro-batch: fresh noise and timesteps from the global RNG."""
    latents, encoder_hidden = encode_batch(comps, batch, weight_dtype, device)
    noise = torch.randn_like(latents)
    sched = comps.noise_scheduler
    t = torch.randint(0, sched.config.num_train_timesteps, (latents.shape[0],), device=device)
    noisy = sched.add_noise(latents, noise, t)
    target = diffusion_target(sched, latents, noise, t)
    if cfg is not None and cfg.channels_last:
        noisy = noisy.contiguous(memory_format=torch.channels_last)
    pred = comps.unet(noisy, t, encoder_hidden).sample
    if cfg is None or cfg.snr_gamma is None:
        return F.mse_loss(pred.float(), target.float())
    per_sample = F.mse_loss(pred.float(), target.float(), reduction="none").mean(dim=(1, 2, 3))
    return (per_sample * min_snr_weight(sched, t, cfg.snr_gamma)).mean()
