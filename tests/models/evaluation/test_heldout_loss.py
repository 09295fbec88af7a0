"""The held-out validation loss and conditioning gap: during training
(models/evaluation/heldout.py) and of an export (models/heldout_loss.py)."""

import io
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file
from streaming import MDSWriter

from kiln_config import StageRun, load_config
from models.evaluation.heldout import _noise, build_validator, eval_timesteps, noise_seed

REPO = Path(__file__).resolve().parents[3]
TINY = load_config(REPO / "configs" / "tiny.yaml").train


def _write_split(out: Path, captions: list[str], size_limit: int = 6000, seed: int = 0) -> str:
    """A small validation split in the training shards' columns: 32 px JPEGs, captions, keys."""
    rng = np.random.default_rng(seed)
    cols = {"image": "bytes", "caption": "str", "key": "str"}
    with MDSWriter(out=str(out), columns=cols, size_limit=size_limit) as w:
        for i, caption in enumerate(captions):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(buf, "JPEG")
            w.write({"image": buf.getvalue(), "caption": caption, "key": f"img-{i:03d}"})
    return str(out)


def _validator(tmp_path, split: str, ema=None, **train):
    from accelerate import Accelerator

    from models.components.factory import build_components

    cfg = TINY.model_copy(update={"val_timesteps": 3, **train})
    run = StageRun(
        train=cfg, stage_index=0, shards=split, output_dir=str(tmp_path / "out"), val_shards=split
    )
    comps = build_components(cfg.model, seed=0)
    val = build_validator(run, Accelerator(cpu=True), comps, ema, torch.float32)
    return val, comps


def _numbers(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k != "val/eval_s"}


CAPTIONS = [
    f"a {c} circle above a {d} square"
    for c in ("red", "green", "blue")
    for d in ("yellow", "purple", "orange")
] + ["a white triangle"]


def test_timesteps_and_noise_are_fixed_per_sample():
    assert eval_timesteps(1000, 4) == [125, 375, 625, 875]
    assert eval_timesteps(1000, 8)[0] == 62 and eval_timesteps(1000, 8)[-1] == 937
    with pytest.raises(ValueError, match="val_timesteps"):
        eval_timesteps(1000, 0)
    assert noise_seed("img-1", 125) == noise_seed("img-1", 125)
    assert len({noise_seed(k, t) for k in ("img-1", "img-2") for t in (125, 375)}) == 4
    like = torch.zeros(2, 4, 8, 8)
    pair = _noise(["img-1", "img-2"], 125, like)
    alone = _noise(["img-2"], 125, like[:1])
    assert torch.equal(pair[1], alone[0]), "a sample's noise does not depend on its batch"
    assert not torch.equal(pair[0], pair[1])


def test_same_numbers_twice_and_training_state_untouched(tmp_path):
    val, comps = _validator(tmp_path, _write_split(tmp_path / "val", CAPTIONS))
    before = {k: v.clone() for k, v in comps.unet.state_dict().items()}
    torch.manual_seed(123)
    random.seed(4)
    np.random.seed(5)
    states = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    first = val.evaluate()
    second = val.evaluate()
    assert _numbers(first) == _numbers(second)
    assert first["val/eval_s"] > 0
    t = eval_timesteps(1000, 3)
    assert set(_numbers(first)) == {
        "raw/val/loss",
        "raw/val/cond_gap",
        *(f"raw/val/loss_t{x}" for x in t),
        *(f"raw/val/cond_gap_t{x}" for x in t),
    }
    assert first["raw/val/loss"] == pytest.approx(np.mean([first[f"raw/val/loss_t{x}"] for x in t]))
    assert torch.equal(torch.get_rng_state(), states[0]), "training's torch RNG moved"
    assert random.getstate() == states[1] and np.array_equal(np.random.get_state()[1], states[2])
    assert comps.unet.training, "the UNet goes back to train mode"
    after = comps.unet.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # The distinct captions matter to a random UNet: the gap is measured, not assumed.
    assert first["raw/val/cond_gap"] != 0


def test_cond_gap_is_zero_when_every_caption_is_the_same(tmp_path):
    val, _ = _validator(tmp_path, _write_split(tmp_path / "val", ["a red disc"] * 10))
    metrics = val.evaluate()
    gaps = [v for k, v in metrics.items() if "cond_gap" in k]
    assert len(gaps) == 4 and all(g == 0.0 for g in gaps)
    assert metrics["raw/val/loss"] > 0


def test_the_subset_is_fixed_by_the_keys_not_the_sharding(tmp_path):
    a, _ = _validator(
        tmp_path, _write_split(tmp_path / "a", CAPTIONS, size_limit=6000), val_max_samples=6
    )
    b, _ = _validator(
        tmp_path, _write_split(tmp_path / "b", CAPTIONS, size_limit=1 << 20), val_max_samples=6
    )
    assert len(a.evalset) == len(b.evalset) == 6
    keys = [[str(e.dataset[i]["key"]) for i in e.order] for e in (a.evalset, b.evalset)]
    assert keys[0] == keys[1]
    assert _numbers(a.evaluate()) == _numbers(b.evaluate())


def test_ema_weights_are_evaluated_then_put_back(tmp_path):
    from diffusers.training_utils import EMAModel

    split = _write_split(tmp_path / "val", CAPTIONS)
    val, comps = _validator(tmp_path, split)
    ema = EMAModel(comps.unet.parameters(), decay=0.5, update_after_step=0)
    val.ema = ema
    assert "ema/val/loss" not in val.evaluate(), "no EMA metrics before the EMA has started"
    ema.step(comps.unet.parameters())  # decay 0 at its first step: a copy
    with torch.no_grad():  # a training step's worth of change; the EMA then lags behind
        for p in comps.unet.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ema.step(comps.unet.parameters())
    raw = {k: v.clone() for k, v in comps.unet.state_dict().items()}
    metrics = val.evaluate()
    assert metrics["ema/val/loss"] != metrics["raw/val/loss"]
    assert {k.replace("ema/", "raw/") for k in metrics if k.startswith("ema/")} == {
        k for k in metrics if k.startswith("raw/")
    }
    assert all(torch.equal(raw[k], v) for k, v in comps.unet.state_dict().items())
    # The raw numbers are those of the raw weights alone.
    val.ema = None
    assert {k: v for k, v in _numbers(metrics).items() if k.startswith("raw/")} == _numbers(
        val.evaluate()
    )


def _launch(cmd: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _accelerate(topology: str, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "configs" / "accelerate" / topology),
        *args,
    ]


@pytest.mark.integration
def test_one_and_two_processes_give_the_same_numbers(tmp_path):
    """Each rank evaluates its batches; the all-reduced table gives every rank, and any
    number of ranks, the same bits."""
    split = _write_split(tmp_path / "val", CAPTIONS)
    stage = [TINY.stages[0].model_copy(update={"batch_size": 3})]
    run = StageRun(
        train=TINY.model_copy(update={"stages": stage}),
        stage_index=0,
        shards=split,
        output_dir=str(tmp_path / "out"),
        val_shards=split,
    )
    stage_yaml = tmp_path / "stage.yaml"
    stage_yaml.write_text(yaml.safe_dump(run.model_dump(mode="json")))
    got = {}
    for topology in ("single.yaml", "cpu-ddp-2.yaml"):
        out = tmp_path / f"{topology}.json"
        _launch(
            _accelerate(
                topology,
                "-m",
                "models.heldout_loss",
                "--config",
                str(stage_yaml),
                "--out",
                str(out),
            )
        )
        got[topology] = _numbers(json.loads(out.read_text()))
    assert got["single.yaml"] == got["cpu-ddp-2.yaml"]
    assert len(got["single.yaml"]) == 2 + 2 * 4


def _train(cfg_path, root, version, out: Path, val_shards: str | None = None, **train) -> None:
    """One `accelerate launch -m models.train` of the tiny 32 px stage (as test_train.py)."""
    cfg = load_config(cfg_path)
    run = StageRun(
        train=cfg.train.model_copy(update=train),
        stage_index=0,
        output_dir=str(out),
        shards=str(root / "shards" / version / "32"),
        val_shards=val_shards,
    )
    out.mkdir(parents=True)
    (out / "stage.yaml").write_text(yaml.safe_dump(run.model_dump(mode="json")))
    _launch(_accelerate("single.yaml", "-m", "models.train", "--config", str(out / "stage.yaml")))


def _val_split(root: Path, version: str, res: int) -> str:
    """The stage's held-out split, as the shard step writes it (`shards.val_fraction`)."""
    split = root / "shards" / version / f"{res}-val"
    assert (split / "index.json").is_file(), f"the shard step wrote no validation split {split}"
    return str(split)


@pytest.mark.integration
def test_training_logs_val_metrics_and_trains_the_same_without_them(tmp_path, tiny_shards):
    """ema/ and raw/ validation metrics every `eval_every` steps and at the stage's end, in
    metrics.jsonl and the manifest; and validation leaves training bit-identical."""
    cfg_path, root, version = tiny_shards
    stages = [TINY.stages[0].model_copy(update={"max_steps": 5, "batch_size": 4})]
    opts = {
        "stages": stages,
        "log_every": 1,
        "eval_every": 2,
        "val_max_samples": 6,
        "val_timesteps": 2,
    }
    val_split = _val_split(root, version, 32)
    with_val, without = tmp_path / "with", tmp_path / "without"
    _train(cfg_path, root, version, with_val, val_split, **opts)
    _train(cfg_path, root, version, without, **opts)
    lines = [json.loads(x) for x in (with_val / "metrics.jsonl").read_text().splitlines()]
    evals = [x for x in lines if "raw/val/loss" in x]
    assert [x["step"] for x in evals] == [0, 2, 4, 5], "at the start, every 2 steps, at the end"
    assert "ema/val/loss" not in evals[0], "step 0: the EMA has not started (same weights)"
    for x in evals[1:]:
        assert x["ema/val/loss"] > 0 and x["raw/val/loss"] > 0 and x["val/eval_s"] > 0
        assert {
            "ema/val/cond_gap",
            "raw/val/cond_gap",
            "ema/val/loss_t250",
            "raw/val/loss_t750",
        } <= x.keys()
    manifest = json.loads((with_val / "manifest.json").read_text())
    assert manifest["val"]["step"] == 5 and manifest["val"] == manifest["val_history"][-1]
    assert manifest["val"]["ema/val/loss"] == evals[-1]["ema/val/loss"]
    assert "loss" in manifest["metrics"] and "raw/val/loss" not in manifest["metrics"]
    # The export (EMA weights) re-evaluated from its folder gives the gap logged at the end (to
    # float32 rounding: this process runs other CPU thread counts than the launched one), with
    # a bootstrap CI over the validation images around it.
    from models.heldout_loss import bootstrap_cond_gap

    gap = bootstrap_cond_gap(with_val / "final", manifest, n_boot=500)
    index = json.loads((Path(val_split) / "index.json").read_text())
    assert gap["n"] == min(6, sum(x["samples"] for x in index["shards"]))
    assert gap["weights"] == "ema"
    assert gap["cond_gap"] == pytest.approx(manifest["val"]["ema/val/cond_gap"], rel=0, abs=1e-7)
    assert gap["ci_low"] <= gap["cond_gap"] <= gap["ci_high"]
    plain = json.loads((without / "manifest.json").read_text())
    assert plain["val"] is None and plain["val_history"] == []
    assert manifest["losses"] == plain["losses"], "validation changed the training losses"
    for sub in ("final/unet", "final-raw/unet"):
        wa = load_file(with_val / sub / "diffusion_pytorch_model.safetensors")
        wb = load_file(without / sub / "diffusion_pytorch_model.safetensors")
        assert all(torch.equal(wa[k], wb[k]) for k in wa), f"{sub} differs with validation"


def test_bucketed_latent_split_batches_within_buckets(tmp_path):
    """A split of precomputed latents and text states in two aspect buckets (as the shard
    step's precompute writes the 64 px stage): every batch has one latent shape, and the
    captions still roll across the whole set."""
    rng = np.random.default_rng(0)
    cols = {
        "key": "str",
        "caption": "str",
        "latent_mean": "ndarray",
        "latent_std": "ndarray",
        "text_hidden": "ndarray",
    }
    buckets = [("32x32", 32, 32, 5), ("40x24", 40, 24, 4)]
    for name, w, h, n in buckets:
        with MDSWriter(out=str(tmp_path / "val" / name), columns=cols) as writer:
            for i in range(n):
                shape = (4, h // 4, w // 4)
                writer.write(
                    {
                        "key": f"{name}-{i}",
                        "caption": f"caption {name} {i}",
                        "latent_mean": rng.standard_normal(shape).astype(np.float16),
                        "latent_std": np.full(shape, 0.1, np.float16),
                        "text_hidden": rng.standard_normal((77, 32)).astype(np.float16),
                    }
                )
    (tmp_path / "val" / "buckets.json").write_text(
        json.dumps(
            {
                "buckets": [
                    {"name": name, "width": w, "height": h, "samples": n}
                    for name, w, h, n in buckets
                ]
            }
        )
    )
    stage = [TINY.stages[0].model_copy(update={"batch_size": 3})]
    val, _ = _validator(tmp_path, str(tmp_path / "val"), stages=stage)
    ev = val.evalset
    assert len(ev) == 9 and sorted(len(b) for b in ev.batches) == [1, 2, 3, 3]
    for b in ev.batches:
        assert len({str(ev.dataset[i]["key"]).split("-")[0] for i in b}) == 1, "mixed buckets"
    first = val.evaluate()
    assert _numbers(first) == _numbers(val.evaluate())
    assert all(np.isfinite(v) for v in first.values()) and first["raw/val/cond_gap"] != 0
