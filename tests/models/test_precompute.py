"""models.precompute under a real 2-process `accelerate launch`, and training on its output."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from streaming import StreamingDataset

from kiln_config import ConfigError, PrecomputeRun, StageRun, load_config, write_run_file
from models.components.factory import build_components
from models.data.images import decode_pixels

pytestmark = pytest.mark.integration  # accelerate launches / Prefect flow runs

REPO = Path(__file__).resolve().parents[2]


def _launch(module, args, topology="single.yaml"):
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "configs" / "accelerate" / topology),
        "-m",
        module,
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_precomputed_latents_match_the_training_path_and_train(tmp_path, tiny_shards):
    """The stage and its validation split (tiny.yaml holds some images out) are encoded in
    one launch; the latents match the VAE and text encoder, and training reads them."""
    from models.precompute import main as precompute

    cfg_path, root, version = tiny_shards
    cfg = load_config(cfg_path).train
    images, val_images = root / "shards" / version / "32", root / "shards" / version / "32-val"
    out, val_out = tmp_path / "32-latents", tmp_path / "32-val-latents"
    spec = PrecomputeRun(
        train=cfg,
        stage_index=0,
        shards=str(images),
        out_dir=str(out),
        val_shards=str(val_images),
        val_out_dir=str(val_out),
        text=True,
        batch_size=4,
    )
    # The run file is the launch's only input; a split without its output folder is refused.
    lone = spec.model_dump(mode="json") | {"val_out_dir": None}
    (tmp_path / "lone.yaml").write_text(yaml.safe_dump(lone))
    with pytest.raises(ConfigError, match="val_out_dir: set it with val_shards, or neither"):
        precompute(["--config", str(tmp_path / "lone.yaml")])
    run_file = write_run_file(spec, tmp_path / "precompute.yaml")
    _launch("models.precompute", ["--config", str(run_file)], "cpu-ddp-2.yaml")
    assert not (tmp_path / "32-latents.tmp").exists(), "published by rename"
    index = json.loads((out / "index.json").read_text())
    assert len(index["shards"]) == 2 and all(
        "part-" in s["raw_data"]["basename"] for s in index["shards"]
    )

    src = StreamingDataset(local=str(images), batch_size=1, shuffle=False)
    lat = StreamingDataset(local=str(out), batch_size=1, shuffle=False)
    assert lat.num_samples == src.num_samples
    by_key = {lat.get_item(i)["key"]: lat.get_item(i) for i in range(lat.num_samples)}
    comps = build_components(cfg.model, seed=cfg.seed)
    for i in range(0, src.num_samples, 7):
        s = src.get_item(i)
        row = by_key[s["key"]]
        with torch.no_grad():
            dist = comps.vae.encode(decode_pixels(s["image"], 32)[None]).latent_dist
            ids = comps.tokenizer(
                s["caption"],
                padding="max_length",
                max_length=77,
                truncation=True,
                return_tensors="pt",
            ).input_ids
            hidden = comps.text_encoder(ids)[0][0]
        assert row["latent_mean"].dtype == np.float16 and row["caption"] == s["caption"]
        torch.testing.assert_close(
            torch.from_numpy(row["latent_mean"].astype(np.float32)),
            dist.mean[0],
            atol=2e-3,
            rtol=2e-3,
        )
        torch.testing.assert_close(
            torch.from_numpy(row["latent_std"].astype(np.float32)),
            dist.std[0],
            atol=2e-3,
            rtol=2e-3,
        )
        torch.testing.assert_close(
            torch.from_numpy(row["text_hidden"].astype(np.float32)), hidden, atol=5e-3, rtol=5e-3
        )

    # The validation split's latents: every held-out image, none of the training ones.
    vsrc = StreamingDataset(local=str(val_images), batch_size=1, shuffle=False)
    vlat = StreamingDataset(local=str(val_out), batch_size=1, shuffle=False)
    val_rows = {vlat.get_item(i)["key"]: vlat.get_item(i) for i in range(vlat.num_samples)}
    assert sorted(val_rows) == sorted(vsrc.get_item(i)["key"] for i in range(vsrc.num_samples))
    assert val_rows and not set(val_rows) & set(by_key)
    s = vsrc.get_item(0)
    with torch.no_grad():
        dist = comps.vae.encode(decode_pixels(s["image"], 32)[None]).latent_dist
    torch.testing.assert_close(
        torch.from_numpy(val_rows[s["key"]]["latent_mean"].astype(np.float32)),
        dist.mean[0],
        atol=2e-3,
        rtol=2e-3,
    )
    assert set(val_rows[s["key"]]) == set(row), "the training latents' columns"

    # Training consumes the latents: no VAE or text-encoder FLOPs are counted per sample.
    stage = cfg.stages[0].model_copy(update={"max_steps": 3, "batch_size": 4})
    run = StageRun(
        train=cfg.model_copy(update={"stages": [stage], "log_every": 1}),
        stage_index=0,
        shards=str(out),
        output_dir=str(tmp_path / "train"),
    )
    _launch(
        "models.train", ["--config", str(write_run_file(run, tmp_path / "train" / "stage.yaml"))]
    )
    lines = [json.loads(x) for x in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    perf = next(x for x in lines if x.get("event") == "perf")
    from models.training.flops import train_flops_per_sample

    unet_only = train_flops_per_sample(cfg.model.unet, resolution=32, vae_scale=4, seq_len=77)
    assert perf["flops_per_sample"] == unet_only
    assert all(np.isfinite(x["loss"]) for x in lines if "loss" in x)
    assert json.loads((tmp_path / "train" / "manifest.json").read_text())["final_step"] == 3
