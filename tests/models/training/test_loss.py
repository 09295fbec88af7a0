"""The denoising loss of models.train on tiny components, against direct computations."""

from pathlib import Path

import pytest
import torch
from diffusers import DDPMScheduler

from kiln_config import load_config
from models.components.factory import build_components
from models.training.loss import denoising_loss, diffusion_target, encode_batch, min_snr_weight

REPO = Path(__file__).resolve().parents[3]
B = 8


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config(REPO / "configs" / "tiny.yaml").train
    return cfg, build_components(cfg.model, seed=0)


def _with_prediction(comps, kind):
    """SD2's schedule (the tiny preset's zero terminal SNR is for v-prediction only)."""
    sched = DDPMScheduler.from_config(
        comps.noise_scheduler.config, prediction_type=kind, rescale_betas_zero_snr=False
    )
    return type(comps)(comps.unet, comps.vae, comps.text_encoder, comps.tokenizer, sched)


def _pixel_batch():
    g = torch.Generator().manual_seed(1)
    return {
        "pixel_values": torch.randint(0, 256, (B, 3, 32, 32), dtype=torch.uint8, generator=g),
        "input_ids": torch.randint(0, 512, (B, 77), generator=g),
    }


def _direct(comps, batch, gamma=None):
    """The loss written out from the schedule's alpha_bar, drawing the RNG in the same order:
    the VAE sample, then the noise, then the timesteps."""
    with torch.no_grad():
        pixels = batch["pixel_values"].float() / 127.5 - 1.0
        x0 = comps.vae.encode(pixels).latent_dist.sample() * comps.vae.config.scaling_factor
        hidden = comps.text_encoder(batch["input_ids"])[0]
    noise = torch.randn_like(x0)
    t = torch.randint(0, 1000, (B,))
    ab = comps.noise_scheduler.alphas_cumprod[t].view(B, 1, 1, 1)
    noisy = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
    v_pred = comps.noise_scheduler.config.prediction_type == "v_prediction"
    target = ab.sqrt() * noise - (1 - ab).sqrt() * x0 if v_pred else noise
    with torch.no_grad():
        pred = comps.unet(noisy, t, hidden).sample
    per_sample = ((pred - target) ** 2).mean(dim=(1, 2, 3))
    if gamma is None:
        return per_sample.mean()
    snr = (ab / (1 - ab)).flatten()
    return (per_sample * torch.clamp(snr, max=gamma) / (snr + 1 if v_pred else snr)).mean()


def _seeded_loss(comps, batch, cfg=None):
    torch.manual_seed(0)
    with torch.no_grad():
        return denoising_loss(comps, batch, torch.float32, "cpu", cfg)


@pytest.mark.parametrize("kind", ["epsilon", "v_prediction"])
@pytest.mark.parametrize("gamma", [None, 5.0])
def test_loss_matches_a_direct_computation(tiny, kind, gamma):
    cfg, comps = tiny
    comps = _with_prediction(comps, kind)
    batch = _pixel_batch()
    got = _seeded_loss(comps, batch, cfg.model_copy(update={"snr_gamma": gamma}))
    torch.manual_seed(0)
    want = _direct(comps, batch, gamma)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_targets_and_min_snr_weights_follow_the_definitions(tiny):
    _, comps = tiny
    x0, noise = torch.randn(3, 4, 4, 4), torch.randn(3, 4, 4, 4)
    t = torch.tensor([1, 100, 999])
    eps = _with_prediction(comps, "epsilon").noise_scheduler
    v = _with_prediction(comps, "v_prediction").noise_scheduler
    ab = eps.alphas_cumprod[t]
    snr = ab / (1 - ab)
    assert torch.equal(diffusion_target(eps, x0, noise, t), noise)
    want_v = ab.sqrt().view(3, 1, 1, 1) * noise - (1 - ab).sqrt().view(3, 1, 1, 1) * x0
    torch.testing.assert_close(diffusion_target(v, x0, noise, t), want_v)
    w_eps, w_v = min_snr_weight(eps, t, 5.0), min_snr_weight(v, t, 5.0)
    torch.testing.assert_close(w_eps, torch.clamp(snr, max=5.0) / snr)
    torch.testing.assert_close(w_v, torch.clamp(snr, max=5.0) / (snr + 1))
    # Low-noise steps (huge SNR) are down-weighted; high-noise ones keep their weight.
    assert w_eps[0] < 0.01 and w_eps[-1] == pytest.approx(1.0)
    # The tiny preset's own schedule: zero SNR at the last step, where the v target is -x0
    # and the min-SNR weight is 0, not a division by zero.
    zero = comps.noise_scheduler
    assert zero.config.prediction_type == "v_prediction" and zero.alphas_cumprod[-1] == 0
    torch.testing.assert_close(diffusion_target(zero, x0, noise, t)[-1], -x0[-1])
    w_zero = min_snr_weight(zero, t, 5.0)
    assert torch.isfinite(w_zero).all() and w_zero[-1] == 0
    sample = _with_prediction(comps, "sample").noise_scheduler
    with pytest.raises(ValueError, match="prediction_type 'sample'"):
        diffusion_target(sample, x0, noise, t)


def test_caption_dropout_uses_the_empty_caption_states(tiny):
    _, comps = tiny
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(4, 77, 32, generator=g)
    batch = {
        "latent_mean": torch.randn(4, 4, 4, 4, generator=g),
        "latent_std": torch.zeros(4, 4, 4, 4),
        "text_hidden": hidden.clone(),
        "drop": torch.tensor([True, False, True, False]),
    }
    latents, enc = encode_batch(comps, batch, torch.float32, "cpu")
    empty_ids = comps.tokenizer("", padding="max_length", max_length=77, return_tensors="pt")
    with torch.no_grad():
        empty = comps.text_encoder(empty_ids.input_ids)[0][0]
    for i, dropped in enumerate(batch["drop"].tolist()):
        torch.testing.assert_close(enc[i], empty if dropped else hidden[i])
    assert not torch.allclose(empty, hidden[0]), "the dropped rows really changed"
    assert torch.equal(batch["text_hidden"], hidden), "the batch itself is left as it was"
    # Precomputed latents: the VAE's Gaussian sampled and scaled (std 0: the mean).
    torch.testing.assert_close(latents, batch["latent_mean"] * comps.vae.config.scaling_factor)
    # And the loss trains on those states: the same as feeding them in without dropout.
    plain = {**batch, "text_hidden": enc, "drop": torch.zeros(4, dtype=torch.bool)}
    assert _seeded_loss(comps, batch) == _seeded_loss(comps, plain)
