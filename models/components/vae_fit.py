"""Fit a small AutoencoderKL once on the dataset's own images, cache it, then freeze it.

The `tiny` preset cannot download SD2's VAE, and a randomly initialised one maps images to
noise-like latents that a diffusion model cannot learn shapes from. So the VAE built from the
preset's dict (the same class, a tiny dict) is trained once, on random crops of the dataset
version's stage images, with a reconstruction (MSE) + small KL objective, as the VAE of
latent diffusion is (Rombach et al. 2022, without the perceptual and GAN terms), a few hundred
steps on CPU. `save_pretrained` writes it to `<root>/vae/<key>/vae/`, where the key hashes the VAE
dict, the fit settings and the images' identity (the dataset version), so the same inputs
reuse the folder and any change trains a new one. From then on it is loaded and frozen like
SD2's VAE (`models.components.factory`).

Like SD, the latents are scaled to about unit variance: `scaling_factor` = 1 / (std of the
sampled latents of the training images), stored in the VAE's config, which the loss, the
precompute step and the exported pipeline all read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL

from kiln_config import VaeFitConfig, stable_hash
from kiln_config.errors import InputError
from models.data.images import decode_uint8

__all__ = [
    "FIT_RECORD",
    "ensure_fitted_vae",
    "fit_vae",
    "fitted_vae_key",
    "read_images",
    "reconstruction_mse",
]

log = logging.getLogger("kiln.vae_fit")

# Beside the weights: the fit's settings, its cost and its reconstruction error.
FIT_RECORD = "fit.json"


def fitted_vae_key(config: dict, fit: VaeFitConfig, images_id: str) -> str:
    """The cache key: the VAE dict, the fit settings and the identity of the images."""
    return stable_hash([config, fit.model_dump(mode="json"), images_id], 16)


def read_images(folders: list[Path]) -> list[torch.Tensor]:
    """Every image (uint8, 3 x H x W) of the MDS datasets in `folders`, in a fixed order.

    Streaming's shard readers, not a StreamingDataset: each StreamingDataset keeps
    shared-memory handles until its process exits, and the flow process is long-lived.
    """
    from streaming.base.format import reader_from_json

    images = []
    for folder in folders:
        index = json.loads((Path(folder) / "index.json").read_text())
        for spec in index["shards"]:
            shard = reader_from_json(str(folder), None, spec)
            images += [decode_uint8(shard.get_item(j)["image"], None) for j in range(shard.samples)]
    return images


@contextlib.contextmanager
def _one_thread():
    """One intra-op thread for the fit. On 2 quiet cores two threads are 1.5x faster, but
    wherever the cores are shared (the flow process's own threads, other jobs) OpenMP's
    spinning threads made the fit ~10x slower: 455 CPU-seconds instead of 46 in `kiln
    pipeline` under load. One thread costs 37 s on a quiet core and degrades gracefully."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _to_float(pixels: torch.Tensor) -> torch.Tensor:
    return pixels.float() / 127.5 - 1.0


def _crops(images: list[torch.Tensor], n: int, side: int, gen: torch.Generator) -> torch.Tensor:
    """`n` random `side` x `side` crops (in [-1, 1]) of images drawn with replacement."""
    out = []
    for i in torch.randint(len(images), (n,), generator=gen).tolist():
        img = images[i]
        y = int(torch.randint(img.shape[1] - side + 1, (1,), generator=gen))
        x = int(torch.randint(img.shape[2] - side + 1, (1,), generator=gen))
        out.append(img[:, y : y + side, x : x + side])
    return _to_float(torch.stack(out))


def _objective(vae: AutoencoderKL, x: torch.Tensor, fit: VaeFitConfig, gen: torch.Generator):
    """MSE reconstruction of a posterior sample, plus the KL to N(0, I) per pixel value."""
    post = vae.encode(x).latent_dist
    rec = vae.decode(post.sample(generator=gen)).sample
    mse = F.mse_loss(rec, x)
    kl = post.kl().mean() / x[0].numel()  # kl() sums over the latent; per pixel value here
    return mse + fit.kl_weight * kl, mse


# The training images whose reconstruction error the fit's record reports (a diagnostic: the
# fit itself uses them all), evenly spaced over the stages.
MSE_IMAGES = 256

# Images encoded at once by the scaling factor and the reconstruction error (one image at a time,
# the two passes over the tiny preset's 804 demo images took 14 s beside its 50 s of steps;
# batched, with the error on a sample, 4 s).
EVAL_BATCH = 64


def _batches(images: list[torch.Tensor]):
    """`images` in their order, as float batches of at most EVAL_BATCH images of one size."""
    start = 0
    while start < len(images):
        end = start + 1
        shape = images[start].shape
        while end < len(images) and end - start < EVAL_BATCH and images[end].shape == shape:
            end += 1
        yield _to_float(torch.stack(images[start:end]))
        start = end


@torch.no_grad()
def _scaling_factor(vae: AutoencoderKL, images: list[torch.Tensor], gen: torch.Generator):
    """1 / std of the sampled latents of `images` (SD's recipe for its 0.18215)."""
    z = [vae.encode(x).latent_dist.sample(generator=gen).flatten() for x in _batches(images)]
    return 1.0 / float(torch.cat(z).std())


@torch.no_grad()
def reconstruction_mse(vae: AutoencoderKL, images: list[torch.Tensor]) -> float:
    """Mean per-image MSE (pixels in [-1, 1]) of decoding the posterior mean of each image."""
    vae.eval()
    with _one_thread():
        errs = [
            (vae(x, sample_posterior=False).sample - x).square().mean(dim=(1, 2, 3))
            for x in _batches(images)
        ]
    return float(torch.cat(errs).mean())


def fit_vae(config: dict, fit: VaeFitConfig, images: list[torch.Tensor]) -> AutoencoderKL:
    """Train the AutoencoderKL built from `config` on random crops of `images`; seeded.

    Returns it frozen, in eval mode, with `scaling_factor` set in its config.

    Raises:
        ValueError: when no image is at least `fit.resolution` on both sides.
    """
    with _one_thread():
        return _fit(config, fit, images)


def _fit(config: dict, fit: VaeFitConfig, images: list[torch.Tensor]) -> AutoencoderKL:
    images = [i for i in images if min(i.shape[1:]) >= fit.resolution]
    if not images:
        raise InputError(
            f"train.model.vae.fit.resolution: no image is {fit.resolution} px on both sides; "
            "lower it to at most the smallest stage resolution"
        )
    with torch.random.fork_rng(devices=[]):  # the caller's global RNG is left as it was
        torch.manual_seed(fit.seed)
        vae = AutoencoderKL.from_config(config)
    gen = torch.Generator().manual_seed(fit.seed)
    opt = torch.optim.AdamW(vae.parameters(), lr=fit.learning_rate, weight_decay=0.0)
    vae.train()
    for step in range(fit.steps):
        loss, mse = _objective(vae, _crops(images, fit.batch_size, fit.resolution, gen), fit, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == fit.steps - 1:
            log.info("vae fit step %d/%d: mse %.4f", step + 1, fit.steps, mse.item())
    vae.eval().requires_grad_(False)
    vae.register_to_config(scaling_factor=_scaling_factor(vae, images, gen))
    return vae


def ensure_fitted_vae(
    config: dict,
    fit: VaeFitConfig,
    images_id: str,
    load_images,
    cache_root: Path,
) -> Path:
    """The folder of the VAE fitted on these inputs: reused when present, else trained now.

    Args:
        config: The AutoencoderKL dict (`train.model.vae.config`).
        fit: The fit settings.
        images_id: Identity of the training images (a dataset version): part of the key.
        load_images: Called only when the VAE must be trained; returns the uint8 images.
        cache_root: Parent of the cached folders (`<root>/vae`).

    The folder is written under a temporary name and renamed into place complete, so a reader
    never sees a partial VAE; when two processes fit at once, the first rename wins.
    """
    out = Path(cache_root) / fitted_vae_key(config, fit, images_id)
    if (out / FIT_RECORD).is_file():
        return out
    start, cpu = time.perf_counter(), time.process_time()
    images = load_images()
    vae = fit_vae(config, fit, images)
    sample = images[:: -(-len(images) // MSE_IMAGES)]  # evenly spaced, every stage's size
    record = {
        "images_id": images_id,
        "images": len(images),
        "fit": fit.model_dump(mode="json"),
        "scaling_factor": vae.config.scaling_factor,
        "train_mse": reconstruction_mse(vae, sample),
        "train_mse_images": len(sample),
        "wall_s": round(time.perf_counter() - start, 2),
        "cpu_s": round(time.process_time() - cpu, 2),
    }
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    vae.save_pretrained(tmp / "vae")  # the `vae` subfolder, as in an SD pipeline folder
    (tmp / FIT_RECORD).write_text(json.dumps(record, indent=2))
    try:
        tmp.rename(out)
    except OSError:  # another process fitted the same VAE first: keep its folder
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("fitted the VAE in %.1f s: %s", record["wall_s"], out)
    return out
