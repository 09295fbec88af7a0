"""Real `accelerate launch` subprocesses of models.train on tiny shards."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from flows.config import load_config
from models.config import StageRun

REPO = Path(__file__).resolve().parents[2]


def _stage(cfg_path, root, version, out, *, stage_index=0, **train_overrides):
    cfg = load_config(cfg_path)
    train = cfg.train.model_copy(update=train_overrides)
    res = train.stages[stage_index].resolution
    run = StageRun(
        train=train,
        stage_index=stage_index,
        shards=str(root / "shards" / version / str(res)),
        output_dir=str(out),
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "stage.yaml").write_text(yaml.safe_dump(run.model_dump(mode="json")))
    return out / "stage.yaml"


def _launch(stage_yaml, topology="single.yaml"):
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(REPO / "configs" / "accelerate" / topology),
        "-m", "models.train", "--config", str(stage_yaml),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _keys(out, rank):
    return [
        json.loads(line) for line in (out / f"samples-rank{rank}.jsonl").read_text().splitlines()
    ]


def test_two_cpu_processes_train_on_different_samples_with_identical_weights(tmp_path, tiny_shards):
    cfg_path, root, version = tiny_shards
    out = tmp_path / "ddp"
    cfg = load_config(cfg_path)
    stages = [cfg.train.stages[0].model_copy(update={"max_steps": 4, "batch_size": 4})]
    _launch(
        _stage(cfg_path, root, version, out, stages=stages, log_sample_keys=True), "cpu-ddp-2.yaml"
    )
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["num_processes"] == 2
    a, b = manifest["param_checksums"]
    assert a == b, "DDP ranks must end with identical weights"
    k0 = [k for rec in _keys(out, 0) for k in rec["keys"]]
    k1 = [k for rec in _keys(out, 1) for k in rec["keys"]]
    assert len(k0) == len(k1) == 16
    assert not set(k0) & set(k1), "each rank trains on its own samples"
    # The export loads as a diffusers pipeline.
    assert (out / "final" / "model_index.json").is_file()


def test_resume_from_checkpoint_matches_uninterrupted_run(tmp_path, tiny_shards):
    cfg_path, root, version = tiny_shards
    cfg = load_config(cfg_path)
    stages = [cfg.train.stages[0].model_copy(update={"max_steps": 6, "batch_size": 4})]
    opts = {"stages": stages, "checkpoint_every": 3, "log_every": 1, "log_sample_keys": True}
    full, crashed = tmp_path / "full", tmp_path / "crashed"
    _launch(_stage(cfg_path, root, version, full, **opts))
    _launch(_stage(cfg_path, root, version, crashed, **opts))
    # Roll the second run back to the state a crash right after step 3 would have left.
    for name in ("final", "final-raw", "manifest.json", "checkpoints/step-00000006"):
        p = crashed / name
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    lines = (crashed / "samples-rank0.jsonl").read_text().splitlines()[:3]
    (crashed / "samples-rank0.jsonl").write_text("\n".join(lines) + "\n")
    (crashed / "checkpoints" / "step-00000009.tmp").mkdir()  # a half-written checkpoint
    (crashed / "checkpoints" / "step-00000007").mkdir()  # one without kiln_state.json
    proc = _launch(crashed / "stage.yaml")
    assert "resumed from" in proc.stdout + proc.stderr
    assert _keys(crashed, 0) == _keys(full, 0), "the resumed run sees exactly the same batches"
    m_full = json.loads((full / "manifest.json").read_text())
    m_res = json.loads((crashed / "manifest.json").read_text())
    assert m_res["losses"] == m_full["losses"][3:]
    for sub in ("final/unet", "final-raw/unet"):
        wa = load_file(full / sub / "diffusion_pytorch_model.safetensors")
        wb = load_file(crashed / sub / "diffusion_pytorch_model.safetensors")
        assert wa.keys() == wb.keys()
        assert all(torch.equal(wa[k], wb[k]) for k in wa), f"{sub} differs after resume"


def test_completed_stage_is_not_retrained(tmp_path, tiny_shards):
    cfg_path, root, version = tiny_shards
    cfg = load_config(cfg_path)
    stages = [cfg.train.stages[0].model_copy(update={"max_steps": 1, "batch_size": 2})]
    out = tmp_path / "once"
    _launch(_stage(cfg_path, root, version, out, stages=stages))
    before = (out / "manifest.json").stat().st_mtime_ns
    proc = _launch(out / "stage.yaml")
    assert "already complete" in proc.stdout + proc.stderr
    assert (out / "manifest.json").stat().st_mtime_ns == before


@pytest.mark.parametrize("bad", ["stage_index: 7", "train: {}"])
def test_bad_stage_file_fails_clearly(tmp_path, tiny_shards, bad):
    cfg_path, root, version = tiny_shards
    stage_yaml = _stage(cfg_path, root, version, tmp_path / "s")
    data = yaml.safe_load(stage_yaml.read_text())
    data.update(yaml.safe_load(bad))
    stage_yaml.write_text(yaml.safe_dump(data))
    proc = subprocess.run(
        [sys.executable, "-m", "models.train", "--config", str(stage_yaml)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "invalid config" in proc.stderr
