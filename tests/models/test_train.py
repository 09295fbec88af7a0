"""Real `accelerate launch` subprocesses of models.train on tiny shards."""

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from diffusers import StableDiffusionPipeline, UNet2DConditionModel
from safetensors.torch import load_file

from kiln_config import StageRun, load_config
from models.components.export import state_dict_sha256
from tasks.catalog.dataset_lineage import stage_draws

REPO = Path(__file__).resolve().parents[2]


def _stage(cfg_path, root, version, out, *, stage_index=0, run_opts=None, **train_overrides):
    cfg = load_config(cfg_path)
    train = cfg.train.model_copy(update=train_overrides)
    res = train.stages[stage_index].resolution
    run = StageRun(
        train=train,
        stage_index=stage_index,
        shards=str(root / "shards" / version / str(res)),
        output_dir=str(out),
        **(run_opts or {}),
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "stage.yaml").write_text(yaml.safe_dump(run.model_dump(mode="json")))
    return out / "stage.yaml"


def _launch(stage_yaml, topology="single.yaml", extra=(), ok=True):
    """`accelerate launch -m models.train`; asserts it succeeded (`ok`) or failed."""
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "configs" / "accelerate" / topology),
        *extra,
        "-m",
        "models.train",
        "--config",
        str(stage_yaml),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert (proc.returncode == 0) == ok, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _keys(out, rank):
    return [
        json.loads(line) for line in (out / f"samples-rank{rank}.jsonl").read_text().splitlines()
    ]


def _two_rank_stage(tiny_shards, out, faults=None, **opts):
    """4 steps of 4 images a rank on the first stage, validated at steps 0, 2 and 4 on 6
    held-out images (each rank its share, EMA swapped in and out)."""
    cfg_path, root, version = tiny_shards
    cfg = load_config(cfg_path)
    stages = [cfg.train.stages[0].model_copy(update={"max_steps": 4, "batch_size": 4})]
    val = root / "shards" / version / "32-val"  # the shard step's held-out split
    return _stage(
        cfg_path,
        root,
        version,
        out,
        stages=stages,
        log_sample_keys=True,
        eval_every=2,
        val_max_samples=6,
        val_timesteps=2,
        run_opts={"val_shards": str(val), "faults": faults or {}},
        **opts,
    )


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, tiny_shards):
    """`_two_rank_stage` on two CPU processes over gloo under DDP. Read by several tests."""
    out = tmp_path_factory.mktemp("ddp") / "stage"
    _launch(_two_rank_stage(tiny_shards, out), "cpu-ddp-2.yaml")
    return out


def _sharded_stage(tiny_shards, out, sharding, faults=None):
    """ddp_run's stage under Kiln's FSDP, checkpointed at every step (the gathered state) and
    logged at every step."""
    return _two_rank_stage(
        tiny_shards,
        out,
        faults,
        sharding=sharding,
        checkpoint_every=1,
        keep_checkpoints=4,
        log_every=1,
    )


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory, tiny_shards):
    """The ddp_run stage on the same 2 gloo ranks under SHARD_GRAD_OP, uninterrupted, and
    under FULL_SHARD, SIGKILLed after step 2 and relaunched."""
    base = tmp_path_factory.mktemp("fsdp")
    grad_op = base / "shard_grad_op"
    _launch(_sharded_stage(tiny_shards, grad_op, "shard_grad_op"), "cpu-ddp-2.yaml")
    full = base / "full_shard"
    killed = _sharded_stage(tiny_shards, full, "full_shard", {"kill_at_steps": [2]})
    _launch(killed, "cpu-ddp-2.yaml", ok=False)
    _launch(killed, "cpu-ddp-2.yaml")
    return grad_op, full


@pytest.mark.integration
def test_fsdp_trains_the_losses_of_ddp_and_resumes_exactly(ddp_run, fsdp_runs):
    """SHARD_GRAD_OP and FULL_SHARD (Kiln's FSDP2 on 2 gloo ranks) train the losses of DDP
    from the same seed within 1e-4 relative; the FULL_SHARD run, killed after step 2 and
    resumed from its checkpoint, ends bit-identical to the uninterrupted SHARD_GRAD_OP one
    (the two differ only in when parameters are gathered): raw weights, EMA, AdamW state and
    every loss and validation figure."""
    grad_op, full = fsdp_runs
    ddp = json.loads((ddp_run / "manifest.json").read_text())
    a, b = (json.loads((d / "manifest.json").read_text()) for d in (grad_op, full))
    assert a["num_processes"] == b["num_processes"] == 2
    # ddp_run logs one window of its 4 steps; these log each step (rank-averaged).
    assert len(a["losses"]) == 4 and len(ddp["losses"]) == 1
    assert sum(a["losses"]) / 4 == pytest.approx(ddp["losses"][0], rel=1e-4)
    untimed = [
        [{k: v for k, v in e.items() if k != "val/eval_s"} for e in m["val_history"]]
        for m in (a, b)
    ]
    assert b["losses"] == a["losses"] and untimed[0] == untimed[1]
    for mine, theirs in zip(a["val_history"], ddp["val_history"], strict=True):
        assert mine["step"] == theirs["step"]
        for k in ("raw/val/loss", "ema/val/loss"):
            if k in theirs:
                assert mine[k] == pytest.approx(theirs[k], rel=1e-4), (mine["step"], k)
    events = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e.get("event") == "resumed"] == [2]
    _same_export(grad_op, full)
    # Within float32 rounding of DDP's weights after 4 AdamW steps.
    for sub in ("final-raw/unet", "final/unet"):
        mine = load_file(grad_op / sub / "diffusion_pytorch_model.safetensors")
        theirs = load_file(ddp_run / sub / "diffusion_pytorch_model.safetensors")
        assert all(torch.allclose(mine[k], theirs[k], rtol=1e-3, atol=1e-5) for k in theirs), sub
    perf = [
        json.loads(x)
        for d in (grad_op, full)
        for x in (d / "metrics.jsonl").read_text().splitlines()
        if '"event": "perf"' in x
    ]
    assert {p["sharding"] for p in perf} == {"shard_grad_op", "full_shard"}
    # The gathered AdamW state of the last checkpoint, tensor for tensor.
    sa, sb = (
        torch.load(d / "checkpoints" / "step-00000004" / "sharded_state.pt", weights_only=True)
        for d in (grad_op, full)
    )
    for k, v in sa["optimizer"]["state"].items():
        for name, t in v.items():
            assert torch.equal(t, sb["optimizer"]["state"][k][name]), (k, name)
    assert sa["lr_scheduler"] == sb["lr_scheduler"]
    # The export is the gathered weights, and loads in diffusers.
    raw = load_file(grad_op / "final-raw" / "unet" / "diffusion_pytorch_model.safetensors")
    assert raw.keys() == sa["model"].keys()
    assert all(torch.equal(raw[k], sa["model"][k]) for k in raw)
    pipe = StableDiffusionPipeline.from_pretrained(grad_op / "final")
    assert type(pipe.unet).__name__ == "UNet2DConditionModel"


@pytest.mark.integration
@pytest.mark.parametrize("sharding", ["full_shard", "ddp"], ids=["ddp-to-fsdp", "fsdp-to-ddp"])
def test_the_next_stage_starts_from_the_last_one_whatever_each_sharding(
    tmp_path, tiny_shards, ddp_run, request, sharding
):
    """The export does not depend on the sharding: a DDP stage's export starts a FULL_SHARD
    stage 2, and an FSDP stage's export starts a DDP one, each from exactly the exported EMA
    weights (the init record's digest), and trains."""
    cfg_path, root, version = tiny_shards
    before = ddp_run if sharding == "full_shard" else request.getfixturevalue("fsdp_runs")[0]
    cfg = load_config(cfg_path)
    two = {
        "max_steps": 2,
        "batch_size": 2,
        "gradient_accumulation_steps": 2,
        "lr_scheduler": "cosine",
        "warmup_steps": 0,
    }
    stages = [*cfg.train.stages[:1], cfg.train.stages[1].model_copy(update=two)]
    out = tmp_path / "next"
    val = root / "shards" / version / f"{stages[1].resolution}-val"
    stage_yaml = _stage(
        cfg_path,
        root,
        version,
        out,
        stage_index=1,
        stages=stages,
        sharding=sharding,
        log_every=1,
        val_max_samples=4,
        val_timesteps=1,
        run_opts={"init_from_dir": str(before / "final"), "val_shards": str(val)},
    )
    _launch(stage_yaml, "cpu-ddp-2.yaml")
    init = json.loads((out / "init.json").read_text())
    exported = UNet2DConditionModel.from_pretrained(before / "final" / "unet")
    assert init["unet_sha256"] == state_dict_sha256(exported)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["final_step"] == 2 and manifest["num_processes"] == 2
    assert [v["step"] for v in manifest["val_history"]] == [0, 2]
    # Two micro-batches per step: the cosine schedule stepped once per optimizer step.
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    lr = {r["step"]: r["lr"] for r in rows if "lr" in r}
    assert lr[1] == pytest.approx(stages[1].learning_rate / 2) and lr[2] == pytest.approx(0)


@pytest.mark.integration
def test_two_cpu_processes_train_on_different_samples_with_identical_weights(ddp_run):
    out = ddp_run
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["num_processes"] == 2
    assert [e["step"] for e in manifest["val_history"]] == [0, 2, 4]
    assert "ema/val/loss" in manifest["val"] and "raw/val/cond_gap" in manifest["val"]
    a, b = manifest["param_checksums"]
    assert a == b, "DDP ranks must end with identical weights"
    k0 = [k for rec in _keys(out, 0) for k in rec["keys"]]
    k1 = [k for rec in _keys(out, 1) for k in rec["keys"]]
    assert len(k0) == len(k1) == 16
    assert not set(k0) & set(k1), "each rank trains on its own samples"
    # The contributors' exposure counts exactly the samples both ranks drew
    # (tasks/catalog/dataset_lineage.py).
    assert stage_draws(out) == Counter(k0 + k1) and sum(stage_draws(out).values()) == 32
    # The export loads as a diffusers pipeline.
    assert (out / "final" / "model_index.json").is_file()


@pytest.mark.integration
def test_resume_from_checkpoint_matches_uninterrupted_run(tmp_path, tiny_shards):
    """The crashed run loads with 2 worker processes (batches through reused shared buffers,
    models/data/shared_batch_buffers.py), the uninterrupted one in-process: batches, losses,
    validation numbers and weights match."""
    cfg_path, root, version = tiny_shards
    cfg = load_config(cfg_path)
    stages = [cfg.train.stages[0].model_copy(update={"max_steps": 6, "batch_size": 4})]
    val = root / "shards" / version / "32-val"  # the shard step's held-out split
    opts = {
        "stages": stages,
        "checkpoint_every": 3,
        "log_every": 1,
        "log_sample_keys": True,
        "eval_every": 2,
        "val_max_samples": 6,
        "val_timesteps": 2,
        "run_opts": {"val_shards": str(val)},
    }
    full, crashed = tmp_path / "full", tmp_path / "crashed"
    _launch(_stage(cfg_path, root, version, full, **opts))
    _launch(_stage(cfg_path, root, version, crashed, **opts, num_workers=2))
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
    assert m_res["losses"] == m_full["losses"], "the loss history survives the resume"
    # Fixed noise and bit-identical weights: the same validation numbers at the same steps,
    # step 2's from before the crash (kept in the checkpoint), 4 and 6 from after the resume.
    history = [{k: v for k, v in e.items() if k != "val/eval_s"} for e in m_full["val_history"]]
    assert [e["step"] for e in history] == [0, 2, 4, 6] and "ema/val/loss" in history[-1]
    assert [{k: v for k, v in e.items() if k != "val/eval_s"} for e in m_res["val_history"]] == (
        history
    ), "validation numbers differ after the resume"
    for sub in ("final/unet", "final-raw/unet"):
        wa = load_file(full / sub / "diffusion_pytorch_model.safetensors")
        wb = load_file(crashed / sub / "diffusion_pytorch_model.safetensors")
        assert wa.keys() == wb.keys()
        assert all(torch.equal(wa[k], wb[k]) for k in wa), f"{sub} differs after resume"


@pytest.mark.parametrize("bad", ["stage_index: 7", "train: {}"])
def test_bad_stage_file_fails_clearly(tmp_path, tiny_shards, bad):
    """The script's own entry point, in this process: it refuses the file before it builds
    anything (every other test here launches it for real)."""
    from kiln_config import ConfigError
    from models.train import main

    cfg_path, root, version = tiny_shards
    stage_yaml = _stage(cfg_path, root, version, tmp_path / "s")
    data = yaml.safe_load(stage_yaml.read_text())
    data.update(yaml.safe_load(bad))
    stage_yaml.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="invalid config"):
        main(["--config", str(stage_yaml)])
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["stage.yaml"]


@pytest.mark.integration
def test_speed_options_min_snr_and_perf_metrics(tmp_path, tiny_shards):
    cfg_path, root, version = tiny_shards
    cfg = load_config(cfg_path)
    stages = [cfg.train.stages[0].model_copy(update={"max_steps": 4, "batch_size": 4})]
    out = tmp_path / "opts"
    stage_yaml = _stage(
        cfg_path,
        root,
        version,
        out,
        stages=stages,
        log_every=2,
        attention="eager",
        channels_last=True,
        snr_gamma=5.0,
        run_opts={"gpu_hour_usd": 2.0},
    )
    _launch(stage_yaml, extra=("--mixed_precision", "bf16"))  # bf16 autocast works on CPU too
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    perf = next(x for x in lines if x.get("event") == "perf")
    assert perf["flops_per_sample"] > 1e6 and perf["peak_source"].startswith("measured")
    assert perf["precision"] == "bf16"
    logged = [x for x in lines if "loss" in x]
    assert [x["step"] for x in logged] == [2, 4]
    for x in logged:
        assert 0 < x["mfu"] < 1 and 0 <= x["data_wait_frac"] <= 1
        assert x["grad_norm"] > 0 and x["samples_per_s_per_device"] == x["samples_per_s"]
        assert x["cost_usd"] == pytest.approx(2.0 * x["gpu_hours"]) and x["gpu_hours"] > 0
    assert logged[1]["gpu_hours"] > logged[0]["gpu_hours"], "GPU-hours accumulate"
    assert (out / "final" / "model_index.json").is_file()


@pytest.mark.e2e
def test_compiled_unet_trains_checkpoints_and_exports(tmp_path, tiny_shards):
    cfg_path, root, version = tiny_shards
    cfg = load_config(cfg_path)
    stages = [cfg.train.stages[0].model_copy(update={"max_steps": 2, "batch_size": 2})]
    out = tmp_path / "compiled"
    _launch(_stage(cfg_path, root, version, out, stages=stages, compile=True, checkpoint_every=1))
    assert (out / "checkpoints" / "step-00000002" / "kiln_state.json").is_file()
    weights = load_file(out / "final" / "unet" / "diffusion_pytorch_model.safetensors")
    assert not any(k.startswith("_orig_mod") for k in weights), "export holds the plain UNet"


@pytest.mark.integration
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="Accelerate's FSDP plugin (configs/accelerate/fsdp.yaml) needs CUDA: Accelerate "
    "sets FSDP up only from a GPU state. Kiln's own FSDP (train.sharding) runs on CPU: "
    "test_fsdp_trains_the_losses_of_ddp_and_resumes_exactly.",
)
def test_fsdp_shard_grad_op_trains_and_exports(tmp_path, tiny_shards):
    cfg_path, root, version = tiny_shards
    cfg = load_config(cfg_path)
    stages = [cfg.train.stages[0].model_copy(update={"max_steps": 3, "batch_size": 4})]
    out = tmp_path / "fsdp"
    stage_yaml = _stage(
        cfg_path,
        root,
        version,
        out,
        stages=stages,
        checkpoint_every=2,
        ema=cfg.train.ema.model_copy(update={"enabled": False}),
    )
    n = min(2, torch.cuda.device_count())
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "configs" / "accelerate" / "fsdp.yaml"),
        "--num_processes",
        str(n),
        "--mixed_precision",
        "bf16",
        "-m",
        "models.train",
        "--config",
        str(stage_yaml),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads((out / "manifest.json").read_text())["final_step"] == 3
    weights = load_file(out / "final" / "unet" / "diffusion_pytorch_model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())


@pytest.mark.integration
def test_one_and_two_processes_see_the_same_global_sample_order(tmp_path, tiny_shards, ddp_run):
    """Elastic determinism: at the same global batch size, the union of the ranks' batches
    at every step is the single process's batch (streaming's canonical-node shuffle). The two
    processes are `ddp_run`'s (4 images a rank; its validation passes read another split)."""
    cfg_path, root, version = tiny_shards
    cfg = load_config(cfg_path)
    stages = [cfg.train.stages[0].model_copy(update={"max_steps": 4, "batch_size": 8})]
    out = tmp_path / "one"
    _launch(_stage(cfg_path, root, version, out, stages=stages, log_sample_keys=True))
    one = [sorted(rec["keys"]) for rec in _keys(out, 0)]
    two = [
        sorted(a["keys"] + b["keys"])
        for a, b in zip(_keys(ddp_run, 0), _keys(ddp_run, 1), strict=True)
    ]
    assert len(one) == len(two) == 4
    assert one == two


@pytest.mark.integration
def test_bucketed_stage_trains_per_bucket_and_resumes_exactly(tmp_path, tiny_shards, demo_src):
    """The 64 px stage as SDXL-style aspect buckets: every step's batch comes from one bucket
    (one non-square shape), and a resumed run sees exactly the same batches."""
    from streaming import StreamingDataset

    from kiln_config import IngestConfig, ShardsConfig
    from tasks.ingest.run import ingest_source
    from tasks.quality.validate import validate_catalog
    from tasks.shards.write import write_shards

    cfg_path, _, _ = tiny_shards
    cfg = load_config(cfg_path)
    root = tmp_path / "root"
    ing = ingest_source(IngestConfig(source=str(demo_src), workers=2), str(root))
    validate_catalog.fn(str(root), ing.ingest_id, cfg.quality)
    res = write_shards.fn(
        ShardsConfig(bucket_step=8, workers=2), str(root), ing.ingest_id, [64], bucket_stages=[64]
    )
    stage_dir = root / "shards" / res.dataset_version / "64"
    bucket_of = {}
    for b in json.loads((stage_dir / "buckets.json").read_text())["buckets"]:
        ds = StreamingDataset(local=str(stage_dir / b["name"]), batch_size=1)
        bucket_of.update({ds[i]["key"]: b["name"] for i in range(len(ds))})
    stages = [
        cfg.train.stages[2].model_copy(
            update={"max_steps": 6, "batch_size": 2, "gradient_accumulation_steps": 1}
        )
    ]
    opts = {"stages": stages, "checkpoint_every": 3, "log_every": 1, "log_sample_keys": True}
    full, crashed = tmp_path / "full", tmp_path / "crashed"
    _launch(_stage(cfg_path, root, res.dataset_version, full, **opts))
    steps = _keys(full, 0)
    assert len(steps) == 6
    seen = {bucket_of[k] for s in steps for k in s["keys"]}
    for s in steps:
        assert len({bucket_of[k] for k in s["keys"]}) == 1, f"step {s['step']} mixes buckets"
    assert len(seen) >= 2, "several buckets are trained on"
    assert any(name != "64x64" for name in seen), "non-square batches went through the UNet"
    # A copy of the run, rolled back to the state a crash right after step 3 leaves.
    shutil.copytree(full, crashed)
    spec = yaml.safe_load((crashed / "stage.yaml").read_text())
    spec["output_dir"] = str(crashed)
    (crashed / "stage.yaml").write_text(yaml.safe_dump(spec))
    for name in ("final", "final-raw", "manifest.json", "checkpoints/step-00000006"):
        p = crashed / name
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    lines = (crashed / "samples-rank0.jsonl").read_text().splitlines()[:3]
    (crashed / "samples-rank0.jsonl").write_text("\n".join(lines) + "\n")
    proc = _launch(crashed / "stage.yaml")
    assert "resumed from" in proc.stdout + proc.stderr
    assert _keys(crashed, 0) == steps, "the resumed run sees exactly the same batches"


# -- failure modes: divergence, kills at the last step and in the export, rank desync ---------

EXPORT_POINTS = ["after_raw", "after_final_tmp", "after_final", "after_manifest_tmp"]


def _short_stage(cfg_path, root, version, out, faults=None, **opts):
    stages = [
        load_config(cfg_path).train.stages[0].model_copy(update={"max_steps": 4, "batch_size": 4})
    ]
    return _stage(
        cfg_path,
        root,
        version,
        out,
        stages=stages,
        checkpoint_every=2,
        log_every=1,
        run_opts={"faults": faults or {}},
        **opts,
    )


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory, tiny_shards):
    """An uninterrupted 4-step stage (EMA on) to compare the recovered ones with."""
    out = tmp_path_factory.mktemp("clean") / "stage"
    _launch(_short_stage(*tiny_shards, out))
    return out


def _same_export(a, b):
    for sub in ("final/unet", "final-raw/unet"):
        wa = load_file(a / sub / "diffusion_pytorch_model.safetensors")
        wb = load_file(b / sub / "diffusion_pytorch_model.safetensors")
        assert wa.keys() == wb.keys()
        assert all(torch.equal(wa[k], wb[k]) for k in wa), f"{sub} differs"


@pytest.mark.integration
def test_gradient_checkpointing_trains_the_same_losses(tmp_path, tiny_shards, clean_run):
    """The clean 4-step stage again with train.gradient_checkpointing: every block's
    activations recomputed in the backward pass give the same losses (1e-6 relative) and
    weights within float32 rounding."""
    out = tmp_path / "ckpt"
    _launch(_short_stage(*tiny_shards, out, gradient_checkpointing=True))
    for d, on in ((out, True), (clean_run, False)):
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        assert next(r for r in rows if r.get("event") == "perf")["gradient_checkpointing"] is on
    on, off = (json.loads((d / "manifest.json").read_text())["losses"] for d in (out, clean_run))
    assert len(on) == len(off) == 4
    assert on == pytest.approx(off, rel=1e-6)
    wa = load_file(out / "final-raw" / "unet" / "diffusion_pytorch_model.safetensors")
    wb = load_file(clean_run / "final-raw" / "unet" / "diffusion_pytorch_model.safetensors")
    assert all(torch.allclose(wa[k], wb[k], rtol=1e-5, atol=1e-6) for k in wa)


@pytest.mark.integration
def test_diverged_stage_fails_and_stays_failed(tmp_path, tiny_shards):
    """The loss goes NaN at step 4 (a checkpoint step): the launch fails naming the step and
    the last finite loss, exports nothing, checkpoints nothing of the NaN state, and a
    relaunch fails the same way at once instead of resuming."""
    cfg_path, root, version = tiny_shards
    out = tmp_path / "nan"
    stage_yaml = _short_stage(cfg_path, root, version, out, {"nan_at_step": 4})
    first = _launch(stage_yaml, ok=False)
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    last = next(x["loss"] for x in logged if x.get("step") == 3)
    marker = json.loads((out / "DIVERGED.json").read_text())
    assert marker["step"] == 4 and marker["last_finite_loss"] == last
    msg = marker["message"]
    assert msg.startswith("training diverged at step 4: ") and f"last finite loss {last!r}" in msg
    assert msg in first.stderr
    for name in ("final", "final-raw", "manifest.json", "checkpoints/step-00000004"):
        assert not (out / name).exists(), f"{name} written by a diverged stage"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002"]
    again = _launch(stage_yaml, ok=False)
    assert msg in again.stderr
    assert "resumed" not in (out / "metrics.jsonl").read_text(), "the relaunch trained again"
    assert not (out / "manifest.json").exists() and not (out / "final").exists()


@pytest.mark.integration
def test_completed_stage_is_not_retrained(clean_run):
    """A relaunch of a finished stage (as a Prefect retry after the export does) trains
    nothing and leaves its manifest as it was."""
    before = (clean_run / "manifest.json").stat().st_mtime_ns
    proc = _launch(clean_run / "stage.yaml")
    assert "already complete" in proc.stdout + proc.stderr
    assert (clean_run / "manifest.json").stat().st_mtime_ns == before


@pytest.mark.integration
def test_ema_export_and_start_step(tmp_path, tiny_shards, clean_run):
    """The export holds the EMA weights; before `ema.start_step` the EMA just tracks the raw
    weights (MosaicML started EMA late in the last stage to save compute). `clean_run` is the
    same stage with EMA from step 0."""
    cfg = load_config(tiny_shards[0])
    assert cfg.train.ema.enabled and cfg.train.ema.start_step == 0  # clean_run's EMA
    late = tmp_path / "late"
    _launch(
        _short_stage(*tiny_shards, late, ema=cfg.train.ema.model_copy(update={"start_step": 100}))
    )
    f = "diffusion_pytorch_model.safetensors"
    weights = {
        out.name: (load_file(out / "final" / "unet" / f), load_file(out / "final-raw" / "unet" / f))
        for out in (late, clean_run)
    }
    assert json.loads((late / "manifest.json").read_text())["ema"] is True
    exported, raw = weights["late"]
    for k in raw:  # before start_step the EMA copies the raw weights (s - (s - p), to 1 ulp)
        torch.testing.assert_close(exported[k], raw[k], atol=1e-6, rtol=1e-6)
    exported, raw = weights[clean_run.name]
    assert any(not torch.equal(exported[k], raw[k]) for k in raw), "export holds EMA weights"
    assert all(torch.equal(raw[k], weights["late"][1][k]) for k in raw), "EMA never feeds back"


@pytest.mark.integration
def test_kills_at_the_last_step_and_anywhere_in_the_export_then_relaunch_completes(
    tmp_path, tiny_shards, clean_run
):
    """SIGKILLed right after the last step's checkpoint, then at each point of the export, one
    launch each: every relaunch resumes at max_steps and trains nothing, gets past what the
    previous one left (a stale final/ included), and the last one completes with every
    window's loss and the last metrics, as the uninterrupted run."""
    from diffusers import StableDiffusionPipeline

    out = tmp_path / "killed"
    faults = {"kill_at_steps": [4], "kill_in_export": EXPORT_POINTS}
    stage_yaml = _short_stage(*tiny_shards, out, faults)
    _launch(stage_yaml, ok=False)
    assert (out / ".fault-fired-4").exists() and (out / "checkpoints" / "step-00000004").is_dir()
    assert not (out / "final-raw").exists() and not (out / "manifest.json").exists()
    left_behind = {
        "after_raw": "final-raw",
        "after_final_tmp": ".final.tmp",
        "after_final": "final",
        "after_manifest_tmp": ".manifest.json.tmp",
    }
    for point in EXPORT_POINTS:
        _launch(stage_yaml, ok=False)
        assert (out / f".fault-fired-export-{point}").exists(), f"not killed at {point}"
        assert (out / left_behind[point]).exists(), point
        assert not (out / "manifest.json").exists(), f"complete after a kill at {point}"
    _launch(stage_yaml)
    manifest = json.loads((out / "manifest.json").read_text())
    clean = json.loads((clean_run / "manifest.json").read_text())
    assert manifest["final_step"] == 4 and len(clean["losses"]) == 4
    assert manifest["losses"] == clean["losses"], "the loss history survives every relaunch"
    assert manifest["metrics"]["loss"] == clean["metrics"]["loss"] == clean["losses"][-1]
    assert manifest["metrics"].keys() == clean["metrics"].keys()
    events = [json.loads(x).get("event") for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert events.count("resumed") == 5, "each relaunch resumed at step 4"
    assert not list(out.glob(".*.tmp")), "temporary folders left behind"
    _same_export(clean_run, out)
    pipe = StableDiffusionPipeline.from_pretrained(out / "final")
    image = pipe("a red disc", num_inference_steps=1, output_type="np").images
    assert image.shape == (1, 32, 32, 3) and np.isfinite(image).all()


@pytest.mark.integration
def test_ddp_ranks_with_different_weights_fail_the_export(tmp_path, tiny_shards):
    """Two CPU processes over gloo; rank 1's weights are nudged right before the export."""
    cfg_path, root, version = tiny_shards
    out = tmp_path / "desync"
    stages = [
        load_config(cfg_path).train.stages[0].model_copy(update={"max_steps": 1, "batch_size": 2})
    ]
    stage_yaml = _stage(
        cfg_path, root, version, out, stages=stages, run_opts={"faults": {"desync_rank": 1}}
    )
    proc = _launch(stage_yaml, "cpu-ddp-2.yaml", ok=False)
    assert "the 2 ranks hold different UNet weights at export (rank 0: " in proc.stderr
    assert not (out / "final").exists() and not (out / "manifest.json").exists()


def test_weight_checksums_must_match_exactly():
    from models.components.export import check_identical_weights

    check_identical_weights([1.5, 1.5])
    check_identical_weights([2.0])
    for bad in ([1.5, 1.5000000000000002], [float("nan"), float("nan")]):
        with pytest.raises(RuntimeError, match="rank 1: "):
            check_identical_weights(bad)


def test_optimizer_state_is_released_before_the_export():
    """The final grid and export need only the weights: AdamW's moments (twice the UNet) and
    the gradients go first, so the export is not the stage's memory peak."""
    from accelerate import Accelerator

    from models.train import release_optimizer_state

    model = torch.nn.Linear(8, 8)
    accelerator = Accelerator(cpu=True)
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    assert len(opt.state) == 2
    release_optimizer_state(opt)
    assert len(opt.state) == 0 and all(p.grad is None for p in model.parameters())
