"""The GPU check's training steps: the tiny preset through `accelerate launch`, and a study.

Run by `benchmarks/gpu_check.py`, each step in its own process with a time box:

    python benchmarks/gpu_check_train.py train --work DIR --result FILE [--toy]
    python benchmarks/gpu_check_train.py fsdp --work DIR --result FILE [--toy]
    python benchmarks/gpu_check_train.py study --work DIR --result FILE [--toy]

`train` writes one synthetic MDS dataset per tiny stage (random JPEGs with captions, through
`models.measure_throughput.write_synthetic_shards`) and trains the three stages, each a real
`accelerate launch -m models.train` in bf16, every stage starting from the previous one's
export. The first stage runs twice: straight through, and killed by `SIGKILL` right after a
checkpoint (the stage file's fault seam) and relaunched with the same command; the two runs'
batches, losses and weights are compared. The third stage runs with `train.compile` on. The
result file is rewritten after each part, with the last export so far.
`fsdp` trains the first stage under `configs/accelerate/fsdp.yaml` (`SHARD_GRAD_OP`, one
process per GPU). `study` generates the evaluation study of the last export with
`accelerate launch -m models.study_images` on the preset's own prompts.

With `--toy` (no CUDA), the first two stages take a few steps on tiny batches, on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KILL_STEP = {True: 2, False: 20}  # checkpoint and kill after this step (toy / GPU)
STEPS = {True: (4, 2, 2), False: (60, 30, 30)}  # optimizer steps per tiny stage


def _env() -> dict:
    """This process's environment with the repository first on PYTHONPATH (the device
    machine has Kiln's dependencies as carried wheels, not Kiln itself installed)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def _launch(args: list[str], log: Path, topology: str = "single.yaml") -> tuple[int, float]:
    """One `accelerate launch` in bf16; returns (exit code, seconds). Output goes to `log`."""
    import torch

    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "configs" / "accelerate" / topology),
        "--num_processes",
        "1",
        "--mixed_precision",
        "bf16",
        *([] if torch.cuda.is_available() else ["--cpu"]),
        *args,
    ]
    t = time.perf_counter()
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env()).returncode
    return rc, round(time.perf_counter() - t, 2)


def _require(rc: int, what: str, log: Path) -> None:
    if rc != 0:
        tail = log.read_text()[-2000:]
        raise RuntimeError(f"{what} exited with {rc}; the end of its log:\n{tail}")


def _tiny_train(toy: bool):
    """The tiny preset's `train` section, its VAE built from the config dict (random weights:
    the check proves the mechanics; `kiln train` first fits the VAE on the data)."""
    from kiln_config import VaeComponent, load_config

    train = load_config(REPO / "configs" / "tiny.yaml").train
    train.model.vae = VaeComponent(config=train.model.vae.config)
    batch = 4 if toy else None
    train.stages = [
        s.model_copy(
            update={"max_steps": n, "warmup_steps": 0, **({"batch_size": batch} if batch else {})}
        )
        for s, n in zip(train.stages, STEPS[toy], strict=True)
    ]
    return train.model_copy(
        update={
            "log_every": 1 if toy else 10,
            "eval_every": 10**6,
            "val_timesteps": 2,
            "val_max_samples": 8,
            "sample_steps": 2 if toy else 4,
            "num_workers": 0 if toy else 4,
            "log_sample_keys": True,
        }
    )


def _fresh(work: Path, *names: str) -> None:
    """Remove what an earlier run of the check left under `work` (a rerun on the same
    machine): MDS writers refuse a folder that is not empty, and a stage folder holding
    checkpoints would resume instead of starting."""
    for name in names:
        path = work / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def _write_stage_file(train, index: int, shards: Path, out: Path, **run) -> Path:
    import yaml

    from kiln_config import StageRun

    res = train.stages[index].resolution
    stage = StageRun(
        train=train,
        stage_index=index,
        shards=str(shards / str(res)),
        val_shards=str(shards / f"{res}-val"),
        output_dir=str(out),
        **run,
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "stage.yaml").write_text(yaml.safe_dump(stage.model_dump(mode="json")))
    return out / "stage.yaml"


def _write_shards(train, shards: Path, toy: bool) -> float:
    from models.measure_throughput import write_synthetic_shards

    t = time.perf_counter()
    for s in train.stages:
        n = s.batch_size * (s.max_steps + 2) if toy else 512
        write_synthetic_shards(shards / str(s.resolution), s.resolution, n, size_limit=1 << 20)
        write_synthetic_shards(shards / f"{s.resolution}-val", s.resolution, 8, seed=1)
    return round(time.perf_counter() - t, 2)


def _stage_summary(out: Path, seconds: float) -> dict:
    m = json.loads((out / "manifest.json").read_text())
    metrics = m["metrics"]
    return {
        "final_step": m["final_step"],
        "launch_s": seconds,
        "last_loss": m["losses"][-1] if m["losses"] else None,
        "samples_per_s": metrics.get("samples_per_s"),
        "mfu": metrics.get("mfu"),
        "gpu_mem_peak_gb": metrics.get("gpu_mem_peak_gb"),
        "val_loss": (m["val"] or {}).get("ema/val/loss"),
        "export": m["export"],
    }


def _keys(out: Path) -> list:
    lines = (out / "samples-rank0.jsonl").read_text().splitlines()
    return [json.loads(x)["keys"] for x in lines]


def _resume_check(train, shards: Path, work: Path, log: Path, toy: bool) -> dict:
    """Stage 0 straight through, and killed after a checkpoint then relaunched: compared."""
    k = KILL_STEP[toy]
    straight = _write_stage_file(
        train.model_copy(update={"checkpoint_every": k}), 0, shards, work / "stage0-straight"
    )
    rc, straight_s = _launch(["-m", "models.train", "--config", str(straight)], log)
    _require(rc, "stage 0 (straight)", log)
    killed = _write_stage_file(
        train.model_copy(update={"checkpoint_every": k}),
        0,
        shards,
        work / "stage0-killed",
        faults={"kill_at_steps": [k]},
    )
    rc_kill, killed_s = _launch(["-m", "models.train", "--config", str(killed)], log)
    if rc_kill == 0:
        raise RuntimeError(f"the launch with a SIGKILL after step {k} exited 0")
    rc, relaunch_s = _launch(["-m", "models.train", "--config", str(killed)], log)
    _require(rc, "stage 0 (relaunched after the kill)", log)
    a = json.loads((straight.parent / "manifest.json").read_text())
    b = json.loads((killed.parent / "manifest.json").read_text())
    return {
        "kill_after_step": k,
        "killed_exit_code": rc_kill,
        "killed_launch_s": killed_s,
        "relaunch_s": relaunch_s,
        "same_batches": _keys(straight.parent) == _keys(killed.parent),
        "same_losses": a["losses"] == b["losses"],
        "max_loss_rel_diff": max(
            (
                abs(x - y) / max(abs(x), 1e-12)
                for x, y in zip(a["losses"], b["losses"], strict=True)
            ),
            default=0.0,
        ),
        "same_weights": a["param_checksums"] == b["param_checksums"],
        "straight": _stage_summary(straight.parent, straight_s),
    }


def train_step(work: Path, toy: bool, save=lambda out: None) -> dict:
    """Shards, stage 0 with the kill-and-resume comparison, then stages 1 and 2 (compiled,
    last: compiling is the slowest part, so a step stopped by its box has the rest).
    `save` gets the result so far after each part, so that a step stopped by its time box
    still reports what it finished."""
    import torch

    train = _tiny_train(toy)
    shards, log = work / "shards", work / "train.log"
    _fresh(work, "shards", "stage0-straight", "stage0-killed", "stage1", "stage2", "train.log")
    out = {"shards_s": _write_shards(train, shards, toy), "log": str(log)}
    save(out)
    out["resume"] = _resume_check(train, shards, work, log, toy)
    prev = out["export"] = out["resume"]["straight"]["export"]
    save(out)
    # Compiling costs minutes of CPU per stage; the CPU path proves the same code uncompiled
    # (tests/models/test_train.py compiles on CPU).
    compiled = torch.cuda.is_available() and not toy
    # Toy: one stage transition; the third stage runs the same code at 64 px.
    for i in (1,) if toy else (1, 2):
        cfg = train.model_copy(update={"compile": compiled and i == 2})
        stage = _write_stage_file(cfg, i, shards, work / f"stage{i}", init_from_dir=prev)
        rc, secs = _launch(["-m", "models.train", "--config", str(stage)], log)
        _require(rc, f"stage {i}", log)
        out[f"stage{i}"] = _stage_summary(stage.parent, secs) | {"compile": cfg.compile}
        prev = out["export"] = out[f"stage{i}"]["export"]
        save(out)
    return out


def fsdp_step(work: Path, toy: bool) -> dict:
    """Stage 0 under FSDP SHARD_GRAD_OP (the test skipped without a GPU, made a check)."""
    import torch
    from safetensors.torch import load_file

    if not torch.cuda.is_available():
        return {
            "skipped": "Accelerate's FSDP needs an accelerator (on CPU it raises 'no "
            "available devices found'); the UNet step measures torch FSDP on CPU"
        }
    train = _tiny_train(toy)
    train.stages = [train.stages[0].model_copy(update={"max_steps": 3})]
    train = train.model_copy(
        update={"checkpoint_every": 2, "ema": train.ema.model_copy(update={"enabled": False})}
    )
    shards, log = work / "shards", work / "fsdp.log"
    if not (shards / "32").is_dir():
        _write_shards(train, shards, toy)
    _fresh(work, "stage0-fsdp", "fsdp.log")
    stage = _write_stage_file(train, 0, shards, work / "stage0-fsdp")
    rc, secs = _launch(["-m", "models.train", "--config", str(stage)], log, "fsdp.yaml")
    _require(rc, "stage 0 under FSDP", log)
    weights = load_file(stage.parent / "final" / "unet" / "diffusion_pytorch_model.safetensors")
    return _stage_summary(stage.parent, secs) | {
        "weights_finite": all(bool(torch.isfinite(w).all()) for w in weights.values()),
        "checkpoint": (stage.parent / "checkpoints" / "step-00000002").is_dir(),
    }


def study_step(work: Path, toy: bool, export: str) -> dict:
    """One evaluation study of `export` on the tiny preset's prompts."""
    log, study = work / "study.log", work / "study"
    _fresh(work, "study", "study.log")
    from kiln_config import EvaluateConfig, StudyRun, write_run_file

    evaluate = EvaluateConfig(
        prompts_csv=str(REPO / "configs" / "prompts" / "tiny.csv"),
        num_inference_steps=2 if toy else 20,
        guidance_scale=4.0,
        batch_size=2 if toy else 36,
        limit=2 if toy else None,
    )
    run = write_run_file(
        StudyRun(pipeline=export, out_dir=str(study), evaluate=evaluate), work / "study-run.yaml"
    )
    args = ["-m", "models.study_images", "--config", str(run)]
    rc, secs = _launch(args, log)
    _require(rc, "the study", log)
    meta = json.loads((study / "study.json").read_text())
    n = len(list((study / "images").glob("*.png")))
    return {
        "images": n,
        "launch_s": secs,
        "generated_s": meta.get("generated_s"),
        "study": str(study / "study.json"),
    }


def _write_result(path: Path, result: dict) -> None:
    """Write the step's result whole or not at all (a time box can kill the step mid-write)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("step", choices=["train", "fsdp", "study"])
    p.add_argument("--work", required=True, help="Scratch folder (shards, stages, logs)")
    p.add_argument("--result", required=True, help="JSON file this step writes")
    p.add_argument("--toy", action="store_true", help="A few CPU steps on tiny batches")
    p.add_argument("--export", help="study: the exported pipeline folder")
    a = p.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    if a.step == "train":
        result = train_step(work, a.toy, lambda out: _write_result(Path(a.result), out))
    elif a.step == "fsdp":
        result = fsdp_step(work, a.toy)
    else:
        result = study_step(work, a.toy, a.export)
    _write_result(Path(a.result), result)


if __name__ == "__main__":
    main()
