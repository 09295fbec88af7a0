"""The tiny preset's VAE: fitted once on the demo images, cached by key, used by every step."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from diffusers import AutoencoderKL
from PIL import Image

from kiln_config import ModelConfig, VaeComponent, VaeFitConfig, load_config, load_yaml_model
from models.components.vae_fit import (
    FIT_RECORD,
    ensure_fitted_vae,
    fit_vae,
    fitted_vae_key,
    reconstruction_mse,
)

REPO = Path(__file__).resolve().parents[3]
TINY = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
VAE_DICT = TINY["train"]["model"]["vae"]["config"]
# Fewer steps than the preset's fit (400 x 16), so the test takes seconds, not a minute.
QUICK = VaeFitConfig(steps=150, batch_size=8, resolution=32, learning_rate=3e-3, seed=0)


def _demo_images(src: Path) -> list[torch.Tensor]:
    """The demo's good images, centre-cropped square and resized to 32 or 64 px (as shards)."""
    images = []
    for line in (src / "metadata.jsonl").read_text().splitlines():
        row = json.loads(line)
        if not row["file_name"][0].isdigit():
            continue  # the planted bad items
        img = Image.open(src / row["file_name"]).convert("RGB")
        side = min(img.size)
        if side < 32:
            continue
        left, top = (img.width - side) // 2, (img.height - side) // 2
        res = 64 if side >= 64 else 32
        img = img.crop((left, top, left + side, top + side)).resize((res, res), Image.BICUBIC)
        images.append(torch.from_numpy(np.array(img)).permute(2, 0, 1).contiguous())
    return images


@pytest.fixture(scope="module")
def split(demo_src):
    """(training images, held-out images): every fifth demo image is held out."""
    images = _demo_images(demo_src)
    return [im for i, im in enumerate(images) if i % 5], images[::5]


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, split):
    """The VAE fitted on the training split, through the cache: (folder, seconds it took)."""
    cache = tmp_path_factory.mktemp("vae-cache")
    start = time.perf_counter()
    folder = ensure_fitted_vae(VAE_DICT, QUICK, "demo-train", lambda: split[0], cache)
    return folder, time.perf_counter() - start


def test_the_fitted_vae_reconstructs_held_out_demo_images(fitted, split):
    folder, _ = fitted
    held_out = split[1]
    torch.manual_seed(0)
    random_mse = reconstruction_mse(AutoencoderKL.from_config(VAE_DICT), held_out)
    vae = AutoencoderKL.from_pretrained(folder, subfolder="vae")
    fitted_mse = reconstruction_mse(vae, held_out)
    assert fitted_mse < 0.5 * random_mse, (fitted_mse, random_mse)
    record = json.loads((folder / FIT_RECORD).read_text())
    assert record["images"] == len(split[0]) and record["fit"] == QUICK.model_dump(mode="json")


def test_the_scaling_factor_gives_latents_of_about_unit_variance(fitted, split):
    vae = AutoencoderKL.from_pretrained(fitted[0], subfolder="vae")
    scale = vae.config.scaling_factor
    assert scale != AutoencoderKL.from_config(VAE_DICT).config.scaling_factor  # set, not default
    with torch.no_grad():
        z = [vae.encode(im[None].float() / 127.5 - 1).latent_dist.mean.flatten() for im in split[1]]
    std = float(torch.cat(z).std()) * scale
    assert 0.7 < std < 1.4, std


def test_the_same_inputs_reuse_the_cached_folder(fitted, split):
    folder, first_s = fitted

    def must_not_load():
        raise AssertionError("the cached VAE was fitted again")

    start = time.perf_counter()
    again = ensure_fitted_vae(VAE_DICT, QUICK, "demo-train", must_not_load, folder.parent)
    assert again == folder and time.perf_counter() - start < min(1.0, first_s / 5)
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temporary left
    # Any change of the dict, the settings or the images is another key.
    base = fitted_vae_key(VAE_DICT, QUICK, "demo-train")
    assert folder.name == base
    assert fitted_vae_key(VAE_DICT, QUICK.model_copy(update={"seed": 1}), "demo-train") != base
    assert fitted_vae_key(VAE_DICT, QUICK, "another-version") != base
    assert fitted_vae_key({**VAE_DICT, "latent_channels": 8}, QUICK, "demo-train") != base


def test_fitting_is_seeded(split):
    fit = QUICK.model_copy(update={"steps": 3})
    a, b = (fit_vae(VAE_DICT, fit, split[0]) for _ in range(2))
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    assert a.config.scaling_factor == b.config.scaling_factor


def test_fit_is_only_for_a_vae_built_from_a_dict(tmp_path):
    with pytest.raises(ValueError, match="'pretrained' VAE is used as it is"):
        VaeComponent(pretrained="stabilityai/stable-diffusion-2-base", fit=QUICK)
    model = dict(TINY["train"]["model"])
    model["text_encoder"] = {**model["text_encoder"], "fit": {"steps": 1}}
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(model))
    with pytest.raises(ValueError, match="text_encoder.fit"):
        load_yaml_model(ModelConfig, path)


def _by_key(folder: Path) -> dict[str, dict]:
    from streaming.base.format import reader_from_json

    index = json.loads((folder / "index.json").read_text())
    shards = [reader_from_json(str(folder), None, s) for s in index["shards"]]
    return {s["key"]: s for sh in shards for s in (sh.get_item(j) for j in range(sh.samples))}


@pytest.mark.integration
def test_the_shard_and_train_flows_use_the_one_fitted_vae(tmp_path, demo_src, make_config):
    """Real flow runs: the shard flow fits the VAE and precomputes latents with it, the train
    flow finds the same folder (not fitted again), and the run's snapshot, its stage.yaml and
    its export all name or hold those weights."""
    from flows.ingest import ingest_flow
    from flows.shard import shard_flow
    from flows.train import train_flow
    from flows.validate import validate_flow
    from kiln_config import encoder_key
    from models.data.images import decode_uint8

    root = tmp_path / "root"
    cfg_path = make_config(
        tmp_path / "c.yaml",
        root,
        demo_src,
        **{
            "shards.precompute": True,
            "launch.health_check": False,
            "train.model.vae.fit": {"steps": 20, "batch_size": 4},
            "train.stages": [
                {"resolution": 32, "batch_size": 4, "learning_rate": 1e-4, "max_steps": 1}
            ],
        },
    )
    ingest_flow(load_config(cfg_path))
    validate_flow(load_config(cfg_path))
    shards = shard_flow(load_config(cfg_path))
    (folder,) = (root / "vae").iterdir()  # one fitted VAE
    fitted_at = (folder / FIT_RECORD).stat().st_mtime_ns
    resolved = load_config(cfg_path)
    resolved.train.model.vae = VaeComponent(pretrained=str(folder))
    latents = Path(shards["stages"][32]["latents"])
    assert latents.name == f"32-latents-{encoder_key(resolved)}"
    # The precompute subprocess encoded with the fitted weights.
    vae = AutoencoderKL.from_pretrained(folder, subfolder="vae").eval()
    images, encoded = _by_key(root / "shards" / shards["dataset_version"] / "32"), _by_key(latents)
    key = sorted(encoded)[0]
    pixels = decode_uint8(images[key]["image"], 32)[None].float() / 127.5 - 1
    with torch.no_grad():
        mean = vae.encode(pixels).latent_dist.mean[0]
    got = torch.from_numpy(encoded[key]["latent_mean"].astype(np.float32))
    assert torch.allclose(got, mean, rtol=1e-2, atol=1e-2), float((got - mean).abs().max())

    record = train_flow(load_config(cfg_path))
    assert [p.name for p in (root / "vae").iterdir()] == [folder.name]
    assert (folder / FIT_RECORD).stat().st_mtime_ns == fitted_at  # reused, not fitted again
    run = root / "runs" / record["run_id"]
    snap = yaml.safe_load((run / "config.yaml").read_text())["train"]["model"]["vae"]
    assert snap["pretrained"] == str(folder) and snap["fit"] is None and snap["config"] is None
    stage = yaml.safe_load((run / "stage-32" / "stage.yaml").read_text())
    assert stage["train"]["model"]["vae"]["pretrained"] == str(folder)
    assert stage["shards"] == str(latents)  # trained on the fitted VAE's latents
    exported = AutoencoderKL.from_pretrained(record["export"], subfolder="vae")
    assert exported.config.scaling_factor == vae.config.scaling_factor
    for (name, a), b in zip(vae.state_dict().items(), exported.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
