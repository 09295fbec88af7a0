"""Train one resolution stage of the text-to-image UNet. Runs on its own under Accelerate:

    accelerate launch --config_file configs/accelerate/single.yaml \
        -m models.train --config stage.yaml

The stage file (a resolved :class:`models.config.StageRun`) is the only input. The script
resumes from the newest complete checkpoint in `<output_dir>/checkpoints/` by itself, so a
crashed launch is restarted with the same command. When done it exports a diffusers
`StableDiffusionPipeline` to `<output_dir>/final/` (EMA weights when EMA is on) and writes
`<output_dir>/manifest.json`. If `final/` already exists the stage is complete and it exits.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from diffusers import StableDiffusionPipeline
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel, compute_snr

from models.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from models.config import StageRun, load_yaml_model
from models.data import build_loader, device_pixels, normalize_pixels, precomputed_columns
from models.factory import Components, build_components, sampling_scheduler, vae_scale_factor
from models.leftovers import clean_stale_streaming
from models.metrics import MetricsSink
from models.perf import device_peak_flops, device_stats, train_flops_per_sample

__all__ = ["build_dataloader", "build_models", "main", "save_and_export", "train_loop"]

log = logging.getLogger("kiln.train")


@dataclass
class TrainState:
    step: int = 0
    loader_state: dict | None = None
    losses: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0  # training wall time over every launch of the stage (logged windows)


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
    comps.unet, optimizer, lr_scheduler = accelerator.prepare(comps.unet, optimizer, lr_scheduler)
    return comps, optimizer, lr_scheduler, ema, weight_dtype


def build_dataloader(run: StageRun, comps: Components):
    """The stage's streaming loader. Deliberately not passed to `accelerator.prepare`."""
    cfg = run.train
    mix = [(path, m.proportion) for path, m in zip(run.mix_shards, cfg.mix, strict=True)]
    local, remote = run.shards, None
    if run.shards_remote:  # stream the published copy through a local cache
        local, remote = run.shards_cache, run.shards_remote
        mix = [(cache, p, rem) for (_, p), cache, rem
               in zip(mix, run.mix_caches, run.mix_remotes, strict=True)]  # fmt: skip
    return build_loader(
        local,
        comps.tokenizer,
        run.stage.resolution,
        run.stage.batch_size,
        shuffle_seed=cfg.shuffle_seed + run.stage_index,
        seed=cfg.seed,
        caption_dropout=cfg.caption_dropout,
        hflip=cfg.hflip,
        num_workers=cfg.num_workers,
        remote=remote,
        mix=mix,
        shuffle_algo=cfg.shuffle_algo,
        predownload=cfg.predownload,
        cache_limit=cfg.cache_limit,
    )


def _loss(
    comps: Components, batch: dict, weight_dtype: torch.dtype, device, cfg=None
) -> torch.Tensor:
    scale = comps.vae.config.scaling_factor
    with torch.no_grad():
        if "latent_mean" in batch:
            # Precomputed: sample the VAE's diagonal Gaussian as latent_dist.sample() does.
            mean = batch["latent_mean"].to(device, dtype=weight_dtype, non_blocking=True)
            std = batch["latent_std"].to(device, dtype=weight_dtype, non_blocking=True)
            latents = (mean + std * torch.randn_like(mean)) * scale
        else:
            # The loader's batch has channels-last strides (see KilnCollate); the model
            # gets the standard layout, transposed here on the device (and flipped, hflip).
            pixels = device_pixels(batch, device)
            if pixels.dtype == torch.uint8:  # the loader ships uint8; normalise on the device
                pixels = normalize_pixels(pixels)
            pixels = pixels.to(weight_dtype)
            latents = comps.vae.encode(pixels).latent_dist.sample() * scale
        if "text_hidden" in batch:
            encoder_hidden = batch["text_hidden"].to(device, dtype=weight_dtype)
            drop = batch["drop"].to(device)
            if drop.any():  # caption dropout: the empty caption's states
                empty = comps.tokenizer(
                    "", padding="max_length", max_length=comps.tokenizer.model_max_length,
                    return_tensors="pt",
                ).input_ids.to(device)  # fmt: skip
                encoder_hidden[drop] = comps.text_encoder(empty)[0].to(weight_dtype)
        else:
            ids = batch["input_ids"].to(device, non_blocking=True)
            encoder_hidden = comps.text_encoder(ids)[0]
    noise = torch.randn_like(latents)
    sched = comps.noise_scheduler
    t = torch.randint(0, sched.config.num_train_timesteps, (latents.shape[0],), device=device)
    noisy = sched.add_noise(latents, noise, t)
    v_pred = sched.config.prediction_type == "v_prediction"
    target = sched.get_velocity(latents, noise, t) if v_pred else noise
    if cfg is not None and cfg.channels_last:
        noisy = noisy.contiguous(memory_format=torch.channels_last)
    pred = comps.unet(noisy, t, encoder_hidden).sample
    if cfg is None or cfg.snr_gamma is None:
        return F.mse_loss(pred.float(), target.float())
    # Min-SNR-gamma (Hang et al. 2023): weight each timestep by min(SNR, gamma) / SNR (eps) or
    # / (SNR + 1) (v), so that easy low-noise steps stop dominating the gradient.
    snr = compute_snr(sched, t)
    weight = torch.clamp(snr, max=cfg.snr_gamma) / (snr + 1 if v_pred else snr)
    per_sample = F.mse_loss(pred.float(), target.float(), reduction="none").mean(dim=(1, 2, 3))
    return (per_sample * weight).mean()


def train_loop(
    run, accelerator, comps, optimizer, lr_scheduler, ema, loader, weight_dtype, sink,
    checkpoints: bool = True,
):  # fmt: skip
    """Optimizer steps until `max_steps`, checkpointing and resuming through `checkpoints/`.

    `checkpoints=False` (throughput measurement only) neither resumes nor saves.
    """
    cfg, stage = run.train, run.stage
    out = Path(run.output_dir)
    ckpt_root = out / "checkpoints"
    state = TrainState()
    perf = _perf_setup(run, accelerator, comps, sink)
    resume = latest_checkpoint(ckpt_root) if checkpoints else None
    if resume is not None:
        saved = load_checkpoint(accelerator, resume)
        state.step, state.loader_state = saved["step"], saved["loader"]
        state.elapsed_s = saved.get("elapsed_s", 0.0)
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
    grad_norm = float("nan")
    # Per logging window: wall time, data wait, loss sum, micro-batches, optimizer steps.
    t_last, wait_s, loss_sum, loss_n, window_steps = time.perf_counter(), 0.0, 0.0, 0, 0
    empty_epochs = 0
    while state.step < stage.max_steps:
        got_batch = False
        t_fetch = time.perf_counter()
        for batch in loader:
            got_batch = True
            wait_s += time.perf_counter() - t_fetch
            with accelerator.accumulate(comps.unet):
                loss = _loss(comps, batch, weight_dtype, accelerator.device, cfg)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(comps.unet.parameters(), cfg.max_grad_norm)
                    grad_norm = float(norm) if norm is not None else float("nan")
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
                if state.step % cfg.log_every == 0 or state.step == stage.max_steps:
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
                    state.losses.append(mean_loss)
                    t_last, wait_s, loss_sum, loss_n, window_steps = now, 0.0, 0.0, 0, 0
                if checkpoints and (
                    state.step % cfg.checkpoint_every == 0 or state.step == stage.max_steps
                ):
                    save_checkpoint(
                        accelerator,
                        ckpt_root,
                        state.step,
                        {"loader": loader.state_dict(), "elapsed_s": state.elapsed_s},
                        cfg.keep_checkpoints,
                    )
                _inject_faults(run, state.step, out)
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


def _inject_faults(run: StageRun, step: int, out: Path) -> None:
    """Fire a configured fault once: a SIGKILL (crash) or an endless stall (hang)."""
    f = run.faults
    if step not in f.kill_at_steps and step != f.stall_at_step:
        return
    marker = out / f".fault-fired-{step}"
    if marker.exists():
        return
    marker.touch()
    log.warning("fault injection at step %d", step)
    if step == f.stall_at_step:
        while True:  # a hang: no more heartbeats until the watchdog kills us
            time.sleep(3600)
    os.kill(os.getpid(), signal.SIGKILL)


def _param_checksum(module: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum().item() for p in module.parameters()))


def save_and_export(run, accelerator, comps, ema, state, sink) -> None:
    """Export the pipeline (EMA weights when enabled) to final/, and the raw UNet beside it."""
    out = Path(run.output_dir)
    accelerator.wait_for_everyone()
    unet = accelerator.unwrap_model(comps.unet)
    # Every rank reports a checksum of its weights: DDP must have kept them identical.
    sums = accelerator.gather(
        torch.tensor([_param_checksum(unet)], device=accelerator.device, dtype=torch.float64)
    )
    fsdp = accelerator.distributed_type == DistributedType.FSDP
    # Under FSDP each rank holds shards: gather the full state dict (a collective, so every
    # rank calls it) and rebuild a plain UNet from it on the main process.
    full_state = accelerator.get_state_dict(comps.unet) if fsdp else None
    if not accelerator.is_main_process:
        return
    if fsdp:
        plain = type(unet).from_config(unet.config)
        plain.load_state_dict(full_state)
        unet = plain
    export_unet = unet
    if ema is not None:
        export_unet = copy.deepcopy(unet)
        ema.copy_to(export_unet.parameters())
        raw_tmp = out / ".final-raw.tmp"
        shutil.rmtree(raw_tmp, ignore_errors=True)
        unet.save_pretrained(raw_tmp / "unet")
        shutil.rmtree(out / "final-raw", ignore_errors=True)
        raw_tmp.rename(out / "final-raw")
    pipe = StableDiffusionPipeline(
        vae=comps.vae.to(torch.float32),
        text_encoder=comps.text_encoder.to(torch.float32),
        tokenizer=comps.tokenizer,
        unet=export_unet.to(torch.float32),
        scheduler=sampling_scheduler(comps.noise_scheduler),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    tmp = out / ".final.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp)
    tmp.rename(out / "final")
    manifest = {
        "resolution": run.stage.resolution,
        "final_step": state.step,
        "export": str(out / "final"),
        "raw_unet": str(out / "final-raw" / "unet")
        if ema is not None
        else str(out / "final" / "unet"),
        "ema": ema is not None,
        "num_processes": accelerator.num_processes,
        "param_checksums": [float(x) for x in sums.cpu().tolist()],
        "losses": state.losses,
        "metrics": sink.last,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
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
    # (models/leftovers.py). One process per machine removes those no live process holds.
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
    comps, optimizer, lr_scheduler, ema, weight_dtype = build_models(run, accelerator)
    # After the (identically seeded) model build: each rank now draws its own noise and
    # timesteps. A resumed run restores these RNG states from the checkpoint instead.
    set_seed(run.train.seed + run.stage_index, device_specific=True)
    loader = build_dataloader(run, comps)
    state = train_loop(
        run, accelerator, comps, optimizer, lr_scheduler, ema, loader, weight_dtype, sink
    )
    save_and_export(run, accelerator, comps, ema, state, sink)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    if not math.isfinite(state.losses[-1] if state.losses else 0.0):
        raise FloatingPointError(f"training diverged: final loss {state.losses[-1]}")


if __name__ == "__main__":
    main()
