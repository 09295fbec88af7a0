"""Train one resolution stage of the text-to-image UNet. Runs on its own under Accelerate:

    accelerate launch --config_file configs/accelerate/single.yaml \
        -m models.train --config stage.yaml

The stage file (a resolved :class:`models.config.StageRun`) is the only input. The script
resumes from the newest complete checkpoint in `<output_dir>/checkpoints/` by itself, so a
crashed launch is restarted with the same command. When done it exports a diffusers
`StableDiffusionPipeline` to `<output_dir>/final/` (EMA weights when EMA is on) and writes
`<output_dir>/manifest.json` last. `manifest.json` is the only completion marker: if it
exists the stage is complete and the script exits; a launch killed anywhere in the export
(a stale `final/` or temporary folders) redoes the export on relaunch.

A diverged stage fails and stays failed. When a logged (rank-averaged) window loss or an
optimizer step's gradient norm is non-finite, the script writes `<output_dir>/DIVERGED.json`
(the step, the last finite loss and the message), exits non-zero, and exports nothing and
checkpoints nothing of the diverged state. Every relaunch (a Prefect retry) then fails at once
with the same message, before it resumes anything. To train the stage again, fix the cause
(a lower learning rate, say) and delete `DIVERGED.json` (docs/operations.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel

from models.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from models.config import DIVERGED, StageRun, load_yaml_model
from models.export import export_unet, write_pipeline
from models.factory import Components, build_components, vae_scale_factor
from models.faults import kill_in_export, nan_loss, perturb_weights, step_fault
from models.flops import device_peak_flops, device_stats, train_flops_per_sample
from models.loader import build_loader, precomputed_columns
from models.loss import denoising_loss
from models.metrics import MetricsSink, system_metrics
from models.samples import maybe_sample_grid, sample_grid, sample_grids
from models.stale_streaming_files import clean_stale_streaming
from models.validation import build_validator

__all__ = [
    "DIVERGED",
    "TrainingDiverged",
    "build_dataloader",
    "build_models",
    "check_identical_weights",
    "main",
    "save_and_export",
    "train_loop",
]

log = logging.getLogger("kiln.train")


class TrainingDiverged(FloatingPointError):
    """The loss or the gradient norm went non-finite. The message names the step and the last
    finite loss; `<output_dir>/DIVERGED.json` keeps it for every relaunch."""


@dataclass
class TrainState:
    step: int = 0
    loader_state: dict | None = None
    losses: list[float] = field(default_factory=list)  # logged window means, over all launches
    last_log_step: int = 0  # the step of losses[-1]
    elapsed_s: float = 0.0  # training wall time over every launch of the stage (logged windows)
    val: list[dict] = field(default_factory=list)  # each validation's metrics, over all launches


def build_models(run: StageRun, accelerator: Accelerator):
    """Components, optimizer, LR schedule and EMA; the UNet and optimizer are `prepare`d."""
    stage, cfg = run.stage, run.train
    comps = build_components(cfg.model, seed=cfg.seed, init_unet_from=run.init_from_dir)
    # Default sampling size of the export: this stage's resolution.
    comps.unet.register_to_config(sample_size=stage.resolution // vae_scale_factor(comps.vae))
    comps.unet.train()
    if cfg.attention == "eager":
        # Plain matmul-softmax attention; the default processor calls torch's SDPA kernels.
        from diffusers.models.attention_processor import AttnProcessor

        comps.unet.set_attn_processor(AttnProcessor())
    if cfg.channels_last:
        comps.unet.to(memory_format=torch.channels_last)
    weight_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
        accelerator.mixed_precision, torch.float32
    )
    # The frozen encoders run in the training dtype; only the UNet holds fp32 master weights.
    comps.vae.to(accelerator.device, dtype=weight_dtype)
    comps.text_encoder.to(accelerator.device, dtype=weight_dtype)
    optimizer = torch.optim.AdamW(
        comps.unet.parameters(),
        lr=stage.learning_rate,
        weight_decay=cfg.weight_decay,
        fused=accelerator.device.type == "cuda",
    )
    # Prepared schedulers step once per process per optimizer step, hence the scaling.
    lr_scheduler = get_scheduler(
        "cosine" if stage.lr_scheduler == "cosine" else "constant_with_warmup",
        optimizer=optimizer,
        num_warmup_steps=stage.warmup_steps * accelerator.num_processes,
        num_training_steps=stage.max_steps * accelerator.num_processes,
    )
    ema = None
    if cfg.ema.enabled and accelerator.distributed_type == DistributedType.FSDP:
        raise ValueError(
            "train.ema.enabled is not supported with an FSDP topology: the EMA would track "
            "each rank's parameter shards. Disable EMA for FSDP, or use DDP (multi-gpu.yaml)."
        )
    if cfg.ema.enabled:
        ema = EMAModel(
            comps.unet.parameters(),
            decay=cfg.ema.decay,
            update_after_step=cfg.ema.start_step,
            model_cls=type(comps.unet),
            model_config=comps.unet.config,
        )
        ema.to(accelerator.device)
        accelerator.register_for_checkpointing(ema)
    if accelerator.is_main_process:  # lineage: the weights this stage starts from, exactly
        init = {"init_from": run.init_from_dir, "unet_sha256": weights_sha256(comps.unet)}
        Path(run.output_dir, "init.json").write_text(json.dumps(init, indent=2))
    comps.unet, optimizer, lr_scheduler = accelerator.prepare(comps.unet, optimizer, lr_scheduler)
    return comps, optimizer, lr_scheduler, ema, weight_dtype


def weights_sha256(module: torch.nn.Module) -> str:
    """sha256 over a module's state dict (names, dtypes, shapes and bytes, in order): equal
    digests mean bit-identical tensors."""
    h = hashlib.sha256()
    for name, t in module.state_dict().items():
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def build_dataloader(run: StageRun, comps: Components):
    """The stage's streaming loader. Deliberately not passed to `accelerator.prepare`."""
    cfg = run.train
    mix = [(path, m.proportion) for path, m in zip(run.mix_shards, cfg.mix, strict=True)]
    local, remote = run.shards, None
    if run.shards_remote:  # stream the published copy through a local cache
        local, remote = run.shards_cache, run.shards_remote
        mix = [(cache, p, rem) for (_, p), cache, rem
               in zip(mix, run.mix_caches, run.mix_remotes, strict=True)]  # fmt: skip
    return build_loader(cfg, local, comps.tokenizer, run.stage.resolution, run.stage.batch_size,
                        stage_index=run.stage_index, remote=remote, mix=mix)  # fmt: skip


def train_loop(
    run, accelerator, comps, optimizer, lr_scheduler, ema, loader, weight_dtype, sink,
    checkpoints: bool = True,
):  # fmt: skip
    """Optimizer steps until `max_steps`, checkpointing and resuming through `checkpoints/`.

    `checkpoints=False` (throughput measurement only) neither resumes nor saves nor samples.
    """
    cfg, stage = run.train, run.stage
    out = Path(run.output_dir)
    ckpt_root = out / "checkpoints"
    state = TrainState()
    perf = _perf_setup(run, accelerator, comps, sink)
    val = build_validator(run, accelerator, comps, ema, weight_dtype)  # None: no val split
    resume = latest_checkpoint(ckpt_root) if checkpoints else None
    if resume is not None:
        saved = load_checkpoint(accelerator, resume)
        state.step, state.loader_state = saved["step"], saved["loader"]
        state.elapsed_s = saved.get("elapsed_s", 0.0)
        # The loss history and the last window's metrics feed the manifest (final loss, plan
        # vs actual); a launch that resumes at max_steps logs nothing new.
        state.losses = list(saved.get("losses", []))
        state.last_log_step = saved.get("last_log_step", 0)
        state.val = list(saved.get("val", []))
        sink.last = dict(saved.get("metrics", {}))
        loader.load_state_dict(state.loader_state)
        log.info("resumed from %s at step %d", resume, state.step)
        sink.event("resumed", step=state.step, checkpoint=str(resume))
    keys_file = None
    if cfg.log_sample_keys:
        # Line-buffered: a SIGKILL must not lose the lineage of steps already trained.
        path = out / f"samples-rank{accelerator.process_index}.jsonl"
        keys_file = open(path, "a", buffering=1)  # noqa: SIM115
    samples_per_step = (
        stage.batch_size * stage.gradient_accumulation_steps * accelerator.num_processes
    )
    grad_norm, norm_known = float("nan"), False
    # Per logging window: wall time, data wait, loss sum, micro-batches, optimizer steps.
    t_last, wait_s, loss_sum, loss_n, window_steps = time.perf_counter(), 0.0, 0.0, 0, 0
    empty_epochs = 0
    if val is not None and checkpoints and state.step == 0:
        # The starting point of the curve: the weights the stage begins from (random, the
        # previous stage's or a warm start's), comparable with every later evaluation.
        t_last += val.run(state, sink)
    while state.step < stage.max_steps:
        got_batch = False
        t_fetch = time.perf_counter()
        for batch in loader:
            got_batch = True
            wait_s += time.perf_counter() - t_fetch
            with accelerator.accumulate(comps.unet):
                loss = denoising_loss(comps, batch, weight_dtype, accelerator.device, cfg)
                loss = nan_loss(run.faults, state.step + 1, loss)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(comps.unet.parameters(), cfg.max_grad_norm)
                    norm_known = norm is not None
                    grad_norm = float(norm) if norm_known else float("nan")
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach().float().item()
            loss_n += 1
            if keys_file:
                keys_file.write(json.dumps({"step": state.step, "keys": batch["key"]}) + "\n")
            if accelerator.sync_gradients:
                if ema is not None:
                    ema.step(comps.unet.parameters())
                state.step += 1
                window_steps += 1
                sink.heartbeat(state.step)
                # The norm is of the all-reduced gradients (FSDP: a global norm), so every rank
                # agrees, and float(norm) above already waited for it: a check per step at no
                # extra sync. A NaN loss on any rank makes it NaN, and the weights with it.
                # fp16's loss scaler skips an overflowing step by itself: not a divergence.
                diverged = None
                skipped = accelerator.optimizer_step_was_skipped
                if norm_known and not math.isfinite(grad_norm) and not skipped:
                    diverged = f"gradient norm {grad_norm}"
                log_now = state.step % cfg.log_every == 0 or state.step == stage.max_steps
                if log_now:
                    mean_loss = accelerator.reduce(
                        torch.tensor(loss_sum / loss_n, device=accelerator.device), "mean"
                    ).item()
                    now = time.perf_counter()
                    dt = now - t_last
                    state.elapsed_s += dt
                    steps = window_steps  # fewer than log_every right after a resume
                    rate = samples_per_step * steps / dt
                    dev_hours = state.elapsed_s * accelerator.num_processes / 3600
                    sink.log(
                        state.step,
                        loss=mean_loss,
                        lr=lr_scheduler.get_last_lr()[0],
                        grad_norm=grad_norm,
                        step_time_s=dt / steps,
                        samples_per_s=rate,
                        samples_per_s_per_device=rate / accelerator.num_processes,
                        data_wait_frac=min(1.0, wait_s / dt),
                        mfu=rate * perf["flops_per_sample"] / perf["peak_flops_total"],
                        gpu_hours=dev_hours,
                        cost_usd=dev_hours * run.gpu_hour_usd,
                        **device_stats(accelerator.device),
                    )
                    t_last, wait_s, loss_sum, loss_n, window_steps = now, 0.0, 0.0, 0, 0
                    # Reduced across ranks: every rank takes the same branch.
                    if not math.isfinite(mean_loss):
                        diverged = f"window loss {mean_loss}"
                    else:
                        state.losses.append(mean_loss)
                        state.last_log_step = state.step
                if diverged is not None:  # before the checkpoint: the NaN state is never saved
                    _diverge(accelerator, out, sink, state, diverged)
                if val is not None and val.due(state.step):  # before the checkpoint, which keeps it
                    t_last += val.run(state, sink)  # kept out of the next window's step time
                if checkpoints:  # before the checkpoint, so a resume never skips a grid
                    t_last += maybe_sample_grid(run, accelerator, comps, ema, state.step, sink)
                if checkpoints and (
                    state.step % cfg.checkpoint_every == 0 or state.step == stage.max_steps
                ):
                    extra = {
                        "loader": loader.state_dict(),
                        "elapsed_s": state.elapsed_s,
                        "losses": state.losses,
                        "last_log_step": state.last_log_step,
                        "metrics": sink.last,
                        "val": state.val,
                    }
                    save_checkpoint(accelerator, ckpt_root, state.step, extra, cfg.keep_checkpoints)
                step_fault(run.faults, state.step, out)
                if state.step >= stage.max_steps:
                    break
            t_fetch = time.perf_counter()
        empty_epochs = 0 if got_batch else empty_epochs + 1
        if empty_epochs >= 2:
            raise RuntimeError(
                f"the stage's dataset {run.shards} yields no full batch of {stage.batch_size} "
                f"per process on {accelerator.num_processes} processes"
            )
    if keys_file:
        keys_file.close()
    if val is not None:
        val.finish(state, sink)
        val.evalset.close()
    return state


def _perf_setup(run: StageRun, accelerator: Accelerator, comps: Components, sink) -> dict:
    """FLOPs per sample (counted once, on meta copies) and the peak of the devices in use.

    Runs under `fork_rng`: measuring the CPU peak draws random matrices, and the global RNG
    must be exactly where set_seed or the checkpoint left it, or a resumed run diverges.
    """
    with torch.random.fork_rng(devices=[]):
        return _perf_measure(run, accelerator, comps, sink)


def _perf_measure(run: StageRun, accelerator: Accelerator, comps: Components, sink) -> dict:
    pre = precomputed_columns(run.shards)  # precomputed work is not training FLOPs
    flops = train_flops_per_sample(
        dict(accelerator.unwrap_model(comps.unet).config),
        vae=None if "latent_mean" in pre else comps.vae,
        text_encoder=None if "text_hidden" in pre else comps.text_encoder,
        resolution=run.stage.resolution,
        latent_channels=comps.vae.config.latent_channels,
        vae_scale=vae_scale_factor(comps.vae),
        seq_len=comps.tokenizer.model_max_length,
    )
    peak, source = device_peak_flops(accelerator.device, run.train.peak_tflops)
    perf = {
        "flops_per_sample": flops,
        "peak_flops_per_device": peak,
        "peak_flops_total": peak * accelerator.num_processes,
        "peak_source": source,
        "precision": accelerator.mixed_precision,
    }
    sink.event("perf", **perf)
    log.info(
        "%.3g TFLOPs per training sample; device peak %.3g TFLOP/s (%s)",
        flops / 1e12, peak / 1e12, source,
    )  # fmt: skip
    return perf


def _diverge(accelerator: Accelerator, out: Path, sink, state: TrainState, what: str) -> NoReturn:
    """Mark the stage failed (DIVERGED.json, written atomically) and raise on every rank."""
    if state.losses:
        last = f"last finite loss {state.losses[-1]!r} (step {state.last_log_step})"
    else:
        last = "no finite loss was logged before it"
    msg = (
        f"training diverged at step {state.step}: {what}; {last}. Nothing was exported and "
        f"the diverged state was not checkpointed. Every relaunch fails with this message "
        f"until {out / DIVERGED} is deleted: fix the cause (a lower learning rate, say) first."
    )
    if accelerator.is_main_process:
        record = {
            "step": state.step,
            "cause": what,
            "last_finite_loss": state.losses[-1] if state.losses else None,
            "last_finite_step": state.last_log_step if state.losses else None,
            "message": msg,
        }
        tmp = out / f".{DIVERGED}.tmp"
        tmp.write_text(json.dumps(record, indent=2))
        tmp.replace(out / DIVERGED)
        sink.event("diverged", step=state.step, message=msg)
    log.error(msg)
    # Every rank got here at the same step (see train_loop): wait for the marker, so that a
    # rank raising first cannot have the launcher tear the main process down before it.
    accelerator.wait_for_everyone()
    raise TrainingDiverged(msg)


def _param_checksum(module: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum().item() for p in module.parameters()))


def check_identical_weights(checksums: list[float]) -> None:
    """Raise unless every DDP rank's weight checksum is the same, bit for bit.

    Exact, not within a tolerance: DDP starts every rank from rank 0's weights and all-reduces
    the gradients, so each rank applies the same update to the same values and the same
    float64 sum over them gives the same bits. Any difference means a rank trained apart.

    Raises:
        RuntimeError: naming each rank's checksum.
    """
    if any(c != checksums[0] for c in checksums):  # NaN != NaN: NaN weights fail too
        ranks = ", ".join(f"rank {i}: {c!r}" for i, c in enumerate(checksums))
        raise RuntimeError(
            f"the {len(checksums)} ranks hold different UNet weights at export ({ranks}); "
            "DDP keeps them identical, so a rank trained apart from the others. Nothing was "
            "exported."
        )


def _replace_dir(src: Path, dst: Path) -> None:
    # A kill between the two leaves `src` only; the relaunch rewrites it and comes back here.
    shutil.rmtree(dst, ignore_errors=True)
    src.rename(dst)


def save_and_export(run, accelerator, comps, ema, state, sink) -> None:
    """Export the pipeline (EMA weights when enabled) to final/, the raw UNet beside it, and
    manifest.json last. Crash-safe at every point: folders are written under a temporary name
    and replace any stale copy; the manifest is renamed into place, and is the only marker of
    a complete stage, so a launch killed mid-export just exports again.

    Raises:
        RuntimeError: when DDP ranks hold different weights (nothing is exported).
    """
    out = Path(run.output_dir)
    accelerator.wait_for_everyone()
    unet = accelerator.unwrap_model(comps.unet)
    perturb_weights(run.faults, unet, accelerator.process_index)
    # Every rank reports a checksum of its weights: DDP must have kept them identical.
    sums = accelerator.gather(
        torch.tensor([_param_checksum(unet)], device=accelerator.device, dtype=torch.float64)
    )
    checksums = [float(x) for x in sums.cpu().tolist()]
    fsdp = accelerator.distributed_type == DistributedType.FSDP
    if not fsdp:  # FSDP ranks hold different shards; every rank checks, so all raise together
        check_identical_weights(checksums)
    # Under FSDP each rank holds shards: gather the full state dict (a collective, so every
    # rank calls it) and rebuild a plain UNet from it on the main process.
    full_state = accelerator.get_state_dict(comps.unet) if fsdp else None
    if not accelerator.is_main_process:
        return
    if fsdp:
        plain = type(unet).from_config(unet.config)
        plain.load_state_dict(full_state)
        unet = plain
    export = export_unet(unet, ema)
    if ema is not None:
        raw_tmp = out / ".final-raw.tmp"
        shutil.rmtree(raw_tmp, ignore_errors=True)
        unet.save_pretrained(raw_tmp / "unet")
        _replace_dir(raw_tmp, out / "final-raw")
        kill_in_export(run.faults, "after_raw", out)
    tmp = out / ".final.tmp"
    write_pipeline(comps, export, tmp)
    kill_in_export(run.faults, "after_final_tmp", out)
    _replace_dir(tmp, out / "final")
    kill_in_export(run.faults, "after_final", out)
    manifest = {
        "resolution": run.stage.resolution,
        "final_step": state.step,
        "samples_seen": state.step
        * run.stage.batch_size
        * run.stage.gradient_accumulation_steps
        * accelerator.num_processes,
        "export": str(out / "final"),
        "raw_unet": str(out / "final-raw" / "unet")
        if ema is not None
        else str(out / "final" / "unet"),
        "ema": ema is not None,
        "num_processes": accelerator.num_processes,
        "param_checksums": checksums,
        "losses": state.losses,
        "metrics": sink.last,
        "val": state.val[-1] if state.val else None,  # the stage's end: the model it exports
        "val_history": state.val,
        "samples": [str(p) for p in sample_grids(out)],
    }
    manifest_tmp = out / ".manifest.json.tmp"
    manifest_tmp.write_text(json.dumps(manifest, indent=2))
    kill_in_export(run.faults, "after_manifest_tmp", out)
    manifest_tmp.replace(out / "manifest.json")
    log.info("exported %s", out / "final")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", required=True, help="Resolved stage.yaml (models.config.StageRun)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run: StageRun = load_yaml_model(StageRun, args.config)
    out = Path(run.output_dir)
    if (out / DIVERGED).is_file():  # checked first: a diverged stage never becomes a success
        raise TrainingDiverged(json.loads((out / DIVERGED).read_text())["message"])
    if (out / "manifest.json").is_file():
        log.info("stage %dpx already complete: %s", run.stage.resolution, out / "final")
        return
    accelerator = Accelerator(
        gradient_accumulation_steps=run.stage.gradient_accumulation_steps,
        # Without a GPU, Accelerate sets up gloo DDP only when told it runs on CPU; otherwise
        # each launched process silently trains alone at world size 1.
        cpu=not torch.cuda.is_available(),
        # torch.compile through Accelerate, which also unwraps the compiled UNet for saving.
        dynamo_backend="inductor" if run.train.compile else "no",
    )
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
    # A killed earlier launch may have left streaming's shared memory and lock files behind
    # (models/stale_streaming_files.py). One process per machine removes those no live
    # process holds.
    if accelerator.is_local_main_process:
        clean_stale_streaming()
    accelerator.wait_for_everyone()
    sink = MetricsSink(
        out,
        run.tracking_uri,
        run.mlflow_run_id,
        f"stage{run.stage.resolution}",
        accelerator.is_main_process,
    )
    # CPU, memory (and GPU) use into the stage's MLflow run, stopped however the stage ends.
    with system_metrics(run.tracking_uri, run.mlflow_run_id, accelerator.is_main_process):
        comps, optimizer, lr_scheduler, ema, weight_dtype = build_models(run, accelerator)
        # After the (identically seeded) model build: each rank now draws its own noise and
        # timesteps. A resumed run restores these RNG states from the checkpoint instead.
        set_seed(run.train.seed + run.stage_index, device_specific=True)
        loader = build_dataloader(run, comps)
        state = train_loop(
            run, accelerator, comps, optimizer, lr_scheduler, ema, loader, weight_dtype, sink
        )
        sample_grid(run, accelerator, comps, ema, state.step, sink)  # listed in the manifest
        save_and_export(run, accelerator, comps, ema, state, sink)
        accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
