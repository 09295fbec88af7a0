"""Resolve `train.model.vae.fit` to the fitted VAE's folder, fitting it once if needed.

The train and shard flows call `resolve_fitted_vae` before anything encodes: it returns the
train config with `vae: {pretrained: <root>/vae/<key>}` (weights in its `vae/`), so the run's
config snapshot, every `stage.yaml` and the precompute launches name the same fitted weights,
and the encoder key of precomputed latents changes with them. The images are the dataset
version's stage shards; the key hashes the VAE dict, the fit settings and the dataset version
(models/components/vae_fit.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from kiln_config import TrainConfig, VaeComponent
from kiln_config.errors import MissingInput
from tasks.runtime.logs import task_logger
from tasks.storage.layout import Layout

__all__ = ["fitted_vae_folder", "resolve_fitted_vae", "stage_image_folders", "vae_from_pipeline"]


def stage_image_folders(layout: Layout, version: str, resolutions: list[int]) -> list[Path]:
    """The MDS folders holding the version's training images: each stage's folder, or each
    bucket's folder of a stage written as aspect-ratio buckets (never the validation split)."""
    folders = []
    for r in resolutions:
        stage = layout.shards(version, r)
        if (stage / "index.json").is_file():
            folders.append(stage)
        elif (stage / "buckets.json").is_file():
            buckets = json.loads((stage / "buckets.json").read_text())["buckets"]
            folders += [stage / b["name"] for b in buckets]
        else:
            raise MissingInput(
                f"fitting the VAE needs the shards of {version} at {r}px, but {stage} is not "
                "a complete dataset; run `kiln shard`"
            )
    return folders


@task(name="fit-vae", cache_policy=NO_CACHE)
def fitted_vae_folder(vae: VaeComponent, root: str, version: str, resolutions: list[int]) -> str:
    """The folder of the VAE fitted on dataset `version` (trained now unless cached)."""
    # torch and diffusers load here, not when the flows import this module: a flow run that
    # never fits (a retrain with nothing new) starts seconds sooner.
    from models.components.vae_fit import ensure_fitted_vae, read_images

    layout = Layout(Path(root))
    folders = stage_image_folders(layout, version, resolutions)
    out = ensure_fitted_vae(
        vae.config, vae.fit, version, lambda: read_images(folders), layout.vae_cache()
    )
    record = json.loads((out / "fit.json").read_text())
    task_logger(__name__).info(
        "fitted VAE %s (%d images, %.1f s when fitted, train MSE %.4f, scaling factor %.4f)",
        out,
        record["images"],
        record["wall_s"],
        record["train_mse"],
        record["scaling_factor"],
    )
    return str(out)


def vae_from_pipeline(train: TrainConfig, pipeline: str) -> TrainConfig:
    """`train` with its VAE loaded from a pipeline folder's `vae/` (a warm start keeps the
    latent space its UNet learned, so it never gets a VAE fitted on other data)."""
    model = train.model.model_copy(update={"vae": VaeComponent(pretrained=str(pipeline))})
    return train.model_copy(update={"model": model})


def resolve_fitted_vae(train: TrainConfig, root: str, version: str) -> TrainConfig:
    """`train` with a `fit` VAE replaced by `pretrained: <its fitted folder>`; else unchanged."""
    vae = train.model.vae
    if vae.fit is None:
        return train
    folder = fitted_vae_folder(vae, root, version, [s.resolution for s in train.stages])
    model = train.model.model_copy(update={"vae": VaeComponent(pretrained=folder)})
    return train.model_copy(update={"model": model})
