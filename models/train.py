"""Train one resolution stage of the text-to-image UNet. Runs on its own under Accelerate:

    accelerate launch --config_file configs/accelerate/single.yaml \
        -m models.train --config stage.yaml

The stage file (a resolved :class:`kiln_config.StageRun`) is the only input. The script
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
import contextlib
import gc
import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from diffusers.optimization import get_scheduler
from torch.distributed.tensor import DTensor

from kiln_config import StageRun, load_yaml_model, sharding_conflict
from kiln_config.errors import InputError
from models.callbacks import Callbacks, StepEnd
from models.callbacks.divergence_check import DivergenceCheck
from models.callbacks.due_checkpoint import DueCheckpoint
from models.callbacks.log_heldout_loss import HeldOutLoss
from models.callbacks.log_sample_grids import SampleGrids
from models.callbacks.step_faults import StepFaults
from models.components.ema import EMA_DTYPES, KilnEMA
from models.components.export import export_stage, state_dict_sha256
from models.components.factory import Components, build_components, vae_scale_factor
from models.components.sharding import full_parameters, is_sharded, shard_unet
from models.data.loader import build_loader, precomputed_columns
from models.data.stale_streaming_files import clean_stale_streaming
from models.evaluation.heldout import build_validator
from models.evaluation.sample_grid import sample_grid, sample_grids
from models.training.checkpoint import resume
from models.training.divergence import raise_if_diverged
from models.training.faults import Faults
from models.training.flops import device_peak_flops, train_flops_per_sample
from models.training.loss import denoising_loss
from models.training.metrics import MetricsSink, MetricsWindow, system_metrics
from models.training.state import TrainContext, TrainState

__all__ = [
    "build_callbacks",
    "build_dataloader",
    "build_models",
    "log_window",
    "main",
    "release_optimizer_state",
    "save_and_export",
    "train_and_export",
    "train_loop",
    "train_step",
]

log = logging.getLogger("kiln.train")


def fused_adamw(accelerator, channels_last: bool) -> bool:
    """Whether AdamW runs its fused CUDA kernel. Not under FSDP with channels_last: FSDP keeps
    the original channels_last parameters but hands them contiguous gradient views, and the
    fused kernel refuses tensors of different strides ("params, grads, exp_avgs, and
    exp_avg_sqs must have same dtype, device, and layout"); the foreach kernel takes them."""
    if accelerator.device.type != "cuda":
        return False
    return not (channels_last and accelerator.distributed_type == DistributedType.FSDP)


def build_models(run: StageRun, accelerator: Accelerator):
    """Components, optimizer, LR schedule and EMA. Under DDP the UNet, optimizer and schedule
    are `prepare`d; under `train.sharding` the UNet is sharded instead and none of them is
    (models/components/sharding.py)."""
    stage, cfg = run.stage, run.train
    comps = build_components(cfg.model, seed=cfg.seed, init_unet_from=run.init_from_dir)
    # Default sampling size of the export: this stage's resolution.
    comps.unet.register_to_config(sample_size=stage.resolution // vae_scale_factor(comps.vae))
    comps.unet.train()
    if cfg.checkpointing(run.stage_index):
        comps.unet.enable_gradient_checkpointing()
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
    sharding = _sharding(run, accelerator)
    ema = None
    if cfg.ema.enabled and accelerator.distributed_type == DistributedType.FSDP:
        raise InputError(
            "train.ema.enabled is not supported with an FSDP topology: the EMA would track "
            "each rank's parameter shards. Set train.sharding (Kiln's FSDP keeps a whole EMA) "
            "with a DDP topology (multi-gpu.yaml), or disable EMA."
        )
    if cfg.ema.enabled:  # from the whole weights, before any sharding
        ema = KilnEMA(
            comps.unet.parameters(),
            dtype=EMA_DTYPES[cfg.ema_dtype],
            seed=cfg.seed + run.stage_index,
            decay=cfg.ema.decay,
            update_after_step=cfg.ema.start_step,
            model_cls=type(comps.unet),
            model_config=comps.unet.config,
        )
        ema.to(accelerator.device)
        accelerator.register_for_checkpointing(ema)
    if accelerator.is_main_process:  # lineage: the weights this stage starts from, exactly
        init = {"init_from": run.init_from_dir, "unet_sha256": state_dict_sha256(comps.unet)}
        Path(run.output_dir, "init.json").write_text(json.dumps(init, indent=2))
    if sharding != "ddp":
        comps.unet.to(accelerator.device)
        shard_unet(comps.unet, sharding, accelerator.device, weight_dtype)
    optimizer = torch.optim.AdamW(
        comps.unet.parameters(),
        lr=stage.learning_rate,
        weight_decay=cfg.weight_decay,
        fused=fused_adamw(accelerator, cfg.channels_last) and sharding == "ddp",
    )
    # Prepared schedulers step once per process per optimizer step, hence the scaling; the
    # sharded path's is not prepared (models/components/sharding.py) and steps once.
    steps_per = accelerator.num_processes if sharding == "ddp" else 1
    lr_scheduler = get_scheduler(
        "cosine" if stage.lr_scheduler == "cosine" else "constant_with_warmup",
        optimizer=optimizer,
        num_warmup_steps=stage.warmup_steps * steps_per,
        num_training_steps=stage.max_steps * steps_per,
    )
    if sharding == "ddp":
        comps.unet, optimizer, lr_scheduler = accelerator.prepare(
            comps.unet, optimizer, lr_scheduler
        )
    return comps, optimizer, lr_scheduler, ema, weight_dtype


def _sharding(run: StageRun, accelerator: Accelerator) -> str:
    """The stage's `train.sharding`, as it applies: `ddp` on one process (nothing to shard)."""
    sharding = run.train.stage_sharding(run.stage_index)
    if sharding == "ddp" or accelerator.num_processes == 1:
        return "ddp"
    # The launch's own topology and precision (a launch flag may differ from the config's file).
    why = sharding_conflict(accelerator.distributed_type.value, accelerator.mixed_precision)
    if why is not None:
        raise InputError(f"train.sharding {sharding} {why}")
    if run.faults.desync_rank is not None:  # shards differ by design: nothing to compare
        raise InputError(f"faults.desync_rank is not supported with train.sharding {sharding}")
    return sharding


def build_dataloader(run: StageRun, comps: Components):
    """The stage's streaming loader. Deliberately not passed to `accelerator.prepare`."""
    cfg = run.train
    mix = [(path, m.proportion) for path, m in zip(run.mix_shards, cfg.mix, strict=True)]
    local, remote = run.shards, None
    if run.shards_remote:  # stream the published copy through a local cache
        local, remote = run.shards_cache, run.shards_remote
        mix = [
            (cache, p, rem)
            for (_, p), cache, rem in zip(mix, run.mix_caches, run.mix_remotes, strict=True)
        ]
    return build_loader(
        cfg,
        local,
        comps.tokenizer,
        run.stage.resolution,
        run.stage.batch_size,
        stage_index=run.stage_index,
        remote=remote,
        mix=mix,
    )


def build_callbacks(ctx: TrainContext, checkpoints: bool = True) -> Callbacks:
    """The training loop's side concerns, in the order they act after each optimizer step.

    The divergence check comes first, so nothing of a diverged state is evaluated or saved;
    the checkpoint comes after the validation it keeps and the grid a resume must not skip;
    the fault injection after it all. Without `checkpoints` (a throughput measurement) there
    are no grids, no checkpoints and no validation at step 0.
    """
    callbacks = [DivergenceCheck()]
    val = build_validator(ctx.run, ctx.accelerator, ctx.comps, ctx.ema, ctx.weight_dtype)
    if val is not None:  # None: the stage has no validation split
        callbacks.append(HeldOutLoss(val, at_start=checkpoints))
    if checkpoints:
        callbacks += [SampleGrids(), DueCheckpoint()]
    return Callbacks([*callbacks, StepFaults()])


def train_loop(ctx: TrainContext, checkpoints: bool = True) -> TrainState:
    """Optimizer steps until `max_steps`, resuming from `checkpoints/`; the side concerns
    (validation, sample grids, the divergence check, checkpoints, fault injection) are the
    callbacks of `build_callbacks`, called at each event.

    Args:
        ctx: The stage's models, loader and metrics sink.
        checkpoints: False (throughput measurement only) neither resumes nor saves nor
            draws sample grids.

    Returns:
        The training state at the stage's last step.
    """
    accelerator, max_steps = ctx.accelerator, ctx.run.stage.max_steps
    perf = _perf_setup(ctx)
    callbacks = build_callbacks(ctx, checkpoints)
    state = resume(ctx) if checkpoints else TrainState()
    window = _metrics_window(ctx, perf)
    callbacks.on_fit_start(ctx, state, window)
    with _sample_keys_log(ctx) as log_keys:
        for batch in _batches(ctx, state, window):
            loss, grad_norm = train_step(ctx, batch, state.step)
            window.add_loss(loss)
            log_keys(state.step, batch)
            if not accelerator.sync_gradients:
                continue  # a gradient-accumulation micro-batch: no optimizer step yet
            if ctx.ema is not None:  # a whole copy: from the gathered weights when sharded
                unet = ctx.comps.unet
                ctx.ema.step(full_parameters(unet) if is_sharded(unet) else unet.parameters())
            state.step += 1
            window.steps += 1
            ctx.sink.heartbeat(state.step)
            mean_loss = log_window(ctx, state, window, grad_norm)
            callbacks.on_step_end(ctx, state, window, StepEnd(grad_norm, mean_loss))
            if state.step >= max_steps:
                break
    callbacks.on_fit_end(ctx, state)
    return state


def train_step(ctx: TrainContext, batch: dict, step: int) -> tuple[torch.Tensor, float | None]:
    """One micro-batch: the loss, its backward, and on the micro-batch that ends a gradient
    accumulation, the clipped optimizer and LR-schedule step.

    Args:
        ctx: The stage's models.
        batch: The loader's batch, on the host.
        step: The optimizer steps done so far (the fault seams count from 1).

    Returns:
        The micro-batch's loss, and the gradient norm before clipping when this micro-batch
        stepped the optimizer and the accelerator reports it, else None.
    """
    accelerator, cfg, grad_norm = ctx.accelerator, ctx.run.train, None
    sharded = is_sharded(ctx.comps.unet)
    with accelerator.accumulate(ctx.comps.unet):
        if sharded:  # reduce-scatter on the micro-batch that steps only; autocast as prepare's
            ctx.comps.unet.set_requires_gradient_sync(accelerator.sync_gradients)
        with accelerator.autocast() if sharded else contextlib.nullcontext():
            loss = denoising_loss(ctx.comps, batch, ctx.weight_dtype, accelerator.device, cfg)
        loss = ctx.faults.at("loss", loss, step=step + 1)
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            norm = accelerator.clip_grad_norm_(ctx.comps.unet.parameters(), cfg.max_grad_norm)
            if isinstance(norm, DTensor):  # the sharded gradients' norm, reduced over ranks
                norm = norm.full_tensor()
            grad_norm = None if norm is None else float(norm)
        # Inside `accumulate`, Accelerate's prepared optimizer and scheduler only act on the
        # micro-batch that syncs the gradients; the sharded path's are not prepared.
        if accelerator.sync_gradients or not sharded:
            ctx.optimizer.step()
            ctx.lr_scheduler.step()
            ctx.optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm


def release_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Drop the gradients and AdamW's moments once the stage's last step is checkpointed.

    The final sample grid and the export need only the weights, and they are the stage's
    memory peak (an EMA copy of the UNet and a pipeline beside it): for SD2-base the moments
    are 6.9 GB, twice the UNet. A launch killed after this point resumes from the last
    checkpoint, which holds them.
    """
    optimizer.zero_grad(set_to_none=True)
    optimizer.state.clear()


def log_window(
    ctx: TrainContext, state: TrainState, window: MetricsWindow, grad_norm: float | None
) -> float | None:
    """Log the metrics window when it ends at `state.step` (every `log_every` steps and at the
    last); a finite window loss joins the loss history. Returns the window loss, or None when
    no window ended."""
    step, cfg = state.step, ctx.run.train
    if step % cfg.log_every and step != ctx.run.stage.max_steps:
        return None
    lr = ctx.lr_scheduler.get_last_lr()[0]
    mean_loss = window.log(state, lr, float("nan") if grad_norm is None else grad_norm)
    if math.isfinite(mean_loss):
        state.losses.append(mean_loss)
        state.last_log_step = step
    return mean_loss


def _batches(ctx: TrainContext, state: TrainState, window: MetricsWindow) -> Iterator[dict]:
    """The loader's batches, epoch after epoch while the stage has steps left; the wait for
    each batch goes to the metrics window.

    Raises:
        RuntimeError: when two epochs in a row yield no batch (the dataset is too small).
    """
    empty_epochs = 0
    while state.step < ctx.run.stage.max_steps:
        got_batch = False
        t_fetch = time.perf_counter()
        for batch in ctx.loader:
            got_batch = True
            window.add_wait(time.perf_counter() - t_fetch)
            yield batch
            t_fetch = time.perf_counter()  # the step, its hooks and checkpoint are not wait
        empty_epochs = 0 if got_batch else empty_epochs + 1
        if empty_epochs >= 2:
            raise RuntimeError(
                f"the stage's dataset {ctx.run.shards} yields no full batch of "
                f"{ctx.run.stage.batch_size} per process on {ctx.accelerator.num_processes} "
                "processes"
            )


@contextmanager
def _sample_keys_log(ctx: TrainContext) -> Iterator[Callable[[int, dict], None]]:
    """A function that records each batch's sample keys with its step, when
    `train.log_sample_keys` is on (`samples-rank<N>.jsonl`), else one that does nothing."""
    if not ctx.run.train.log_sample_keys:
        yield lambda step, batch: None
        return
    # Line-buffered: a SIGKILL must not lose the lineage of steps already trained.
    path = ctx.out / f"samples-rank{ctx.accelerator.process_index}.jsonl"
    with open(path, "a", buffering=1) as f:
        yield lambda step, batch: f.write(json.dumps({"step": step, "keys": batch["key"]}) + "\n")


# -- the metrics window's MFU -------------------------------------------------------------------


def _perf_setup(ctx: TrainContext) -> dict:
    """FLOPs per sample (counted once, on meta copies) and the peak of the devices in use.

    Runs under `fork_rng`: measuring the CPU peak draws random matrices, and the global RNG
    must be exactly where set_seed or the checkpoint left it, or a resumed run diverges.
    """
    with torch.random.fork_rng(devices=[]):
        return _perf_measure(ctx.run, ctx.accelerator, ctx.comps, ctx.sink)


def _metrics_window(ctx: TrainContext, perf: dict) -> MetricsWindow:
    """A metrics window with the stage's FLOPs per sample, device peak and price."""
    stage, num_processes = ctx.run.stage, ctx.accelerator.num_processes
    return MetricsWindow(
        ctx.accelerator,
        ctx.sink,
        flops_per_sample=perf["flops_per_sample"],
        peak_flops_total=perf["peak_flops_total"],
        samples_per_step=stage.global_batch(num_processes),
        gpu_hour_usd=ctx.run.gpu_hour_usd,
    )


def _perf_measure(run: StageRun, accelerator: Accelerator, comps: Components, sink) -> dict:
    pre = precomputed_columns(run.shards)  # precomputed work is not training FLOPs
    unet = accelerator.unwrap_model(comps.unet)
    flops = train_flops_per_sample(
        dict(unet.config),
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
        "gradient_checkpointing": unet.is_gradient_checkpointing,
        "sharding": run.train.stage_sharding(run.stage_index) if is_sharded(unet) else "ddp",
    }
    sink.event("perf", **perf)
    log.info(
        "%.3g TFLOPs per training sample; device peak %.3g TFLOP/s (%s)",
        flops / 1e12,
        peak / 1e12,
        source,
    )
    return perf


def save_and_export(run, accelerator, comps, ema, state, sink) -> None:
    """Export the finished stage (`models.components.export.export_stage`) with its manifest:
    what was trained, where the export is, and its metrics. Every rank calls it."""
    export_stage(
        Path(run.output_dir),
        accelerator,
        comps,
        ema,
        manifest=lambda checksums: _manifest(run, accelerator, ema, state, sink, checksums),
        faults=Faults.of(run),
    )


def _manifest(run, accelerator, ema, state, sink, checksums: list[float]) -> dict:
    """The stage's manifest: what was trained, where the export is, and its metrics."""
    out, stage = Path(run.output_dir), run.stage
    return {
        "resolution": stage.resolution,
        "final_step": state.step,
        "samples_seen": state.step * stage.global_batch(accelerator.num_processes),
        "export": str(out / "final"),
        "raw_unet": str(out / "final-raw" / "unet" if ema is not None else out / "final" / "unet"),
        "ema": ema is not None,
        "num_processes": accelerator.num_processes,
        "param_checksums": checksums,
        "losses": state.losses,
        "metrics": sink.last,
        "val": state.val[-1] if state.val else None,  # the stage's end: the model it exports
        "val_history": state.val,
        "samples": [str(p) for p in sample_grids(out)],
    }


def main(argv: list[str] | None = None) -> None:
    """Train, export and mark complete the stage of `--config` (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", required=True, help="Resolved stage.yaml (kiln_config.StageRun)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run: StageRun = load_yaml_model(StageRun, args.config)
    out = Path(run.output_dir)
    raise_if_diverged(out)  # checked first: a diverged stage never becomes a success
    if (out / "manifest.json").is_file():
        log.info("stage %dpx already complete: %s", run.stage.resolution, out / "final")
        return
    accelerator = _accelerator(run)
    sink = MetricsSink(
        out,
        run.tracking_uri,
        run.mlflow_run_id,
        f"stage{run.stage.resolution}",
        accelerator.is_main_process,
    )
    # CPU, memory (and GPU) use into the stage's MLflow run, stopped however the stage ends.
    with system_metrics(run.tracking_uri, run.mlflow_run_id, accelerator.is_main_process):
        train_and_export(run, accelerator, sink)
        accelerator.wait_for_everyone()
    # The sharded UNet, the optimizer and the hooks FSDP and DDP put on them can hold the
    # process group's work in reference cycles. Drop the accelerator's references to them
    # (free_memory collects before it drops them, hence the second collection) and collect
    # the cycles now, while the interpreter is whole and the group still up: left to the
    # interpreter's exit, a gloo rank can abort after its work is done ("terminate called
    # without an active exception", exit code -6).
    accelerator.free_memory()
    gc.collect()
    accelerator.end_training()


def train_and_export(run: StageRun, accelerator: Accelerator, sink: MetricsSink) -> None:
    """The stage's phases in order; what they build is freed when this returns."""
    comps, optimizer, lr_scheduler, ema, weight_dtype = build_models(run, accelerator)
    # After the (identically seeded) model build: each rank now draws its own noise and
    # timesteps. A resumed run restores these RNG states from the checkpoint instead.
    set_seed(run.train.seed + run.stage_index, device_specific=True)
    loader = build_dataloader(run, comps)
    ctx = TrainContext(
        run, accelerator, comps, optimizer, lr_scheduler, ema, weight_dtype, loader, sink
    )
    state = train_loop(ctx)
    release_optimizer_state(optimizer)
    sample_grid(run, accelerator, comps, ema, state.step, sink)  # listed in the manifest
    save_and_export(run, accelerator, comps, ema, state, sink)


def _accelerator(run: StageRun) -> Accelerator:
    """The stage's Accelerator, with the output folder made and stale streaming files gone."""
    accelerator = Accelerator(
        gradient_accumulation_steps=run.stage.gradient_accumulation_steps,
        # Without a GPU, Accelerate sets up gloo DDP only when told it runs on CPU; otherwise
        # each launched process silently trains alone at world size 1.
        cpu=not torch.cuda.is_available(),
        # torch.compile through Accelerate, which also unwraps the compiled UNet for saving.
        dynamo_backend="inductor" if run.train.compile else "no",
    )
    if accelerator.is_main_process:
        Path(run.output_dir).mkdir(parents=True, exist_ok=True)
    # A killed earlier launch may have left streaming's shared memory and lock files behind
    # (models/data/stale_streaming_files.py). One process per machine removes those no live
    # process holds.
    if accelerator.is_local_main_process:
        clean_stale_streaming()
    accelerator.wait_for_everyone()
    return accelerator


if __name__ == "__main__":
    main()
