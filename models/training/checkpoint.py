"""Atomic, resumable checkpoints on top of `accelerator.save_state`.

A checkpoint is `checkpoints/step-NNNNNNNN/`: Accelerate's state (model, optimizer, LR
scheduler, registered objects such as EMA, per-rank RNG) plus `kiln_state.json` (step, the
streaming loader state, and the training script's own extras: the loss history and the last
logged metrics, which the manifest needs even when a launch resumes at the last step). It is
written under a temporary name and renamed only when complete, and `kiln_state.json` is the
last file written, so a folder without it is never resumed from.

The training loop resumes with `resume` at the start of a launch and saves through the
`DueCheckpoint` callback (`models.callbacks.due_checkpoint`) after an optimizer step; the
`TrainState` (`models.training.state`) is what they carry from one launch of a stage to the next.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from accelerate import Accelerator

from kiln_config.errors import InputError
from models.components.sharding import STATE_FILE as SHARDED_FILE
from models.components.sharding import is_sharded, load_sharded_state, save_sharded_state
from models.training.state import TrainContext, TrainState

__all__ = [
    "STATE_FILE",
    "checkpoint_extra",
    "latest_checkpoint",
    "load_checkpoint",
    "resume",
    "save_checkpoint",
    "sharded_parts",
]

log = logging.getLogger(__name__)
STATE_FILE = "kiln_state.json"


def _step_dirs(ckpt_root: Path) -> list[Path]:
    return sorted(p for p in ckpt_root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp"))


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The newest complete checkpoint; incomplete or unreadable ones are skipped with a warning."""
    for path in reversed(_step_dirs(ckpt_root)):
        try:
            json.loads((path / STATE_FILE).read_text())
            return path
        except (OSError, ValueError) as e:
            log.warning("skipping incomplete checkpoint %s: %s", path, e)
    return None


def save_checkpoint(
    accelerator: Accelerator,
    ckpt_root: Path,
    step: int,
    extra: dict,
    keep: int,
    sharded: tuple | None = None,
) -> Path:
    """Save on every rank (each writes its own RNG state), publish on the main one.
    `sharded`: the sharded UNet, its optimizer and LR schedule, which Accelerate does not hold
    (`models.components.sharding`): gathered whole into the same folder."""
    final = ckpt_root / f"step-{step:08d}"
    tmp = ckpt_root / f"step-{step:08d}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    if sharded is not None:
        save_sharded_state(tmp, *sharded, is_main=accelerator.is_main_process)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, **extra}))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in _step_dirs(ckpt_root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator: Accelerator, path: Path, sharded: tuple | None = None) -> dict:
    """Restore Accelerate's state from `path` (and the sharded UNet, optimizer and LR schedule
    of `sharded`) and return the Kiln state (step, loader, extras)."""
    written = "train.sharding" if (path / SHARDED_FILE).is_file() else "DDP"
    now = "train.sharding" if sharded is not None else "DDP"
    if written != now:
        raise InputError(
            f"{path} was written under {written} and this launch trains the stage under {now}: "
            "finish the stage with the sharding it started with (train.sharding, or the "
            "stage's own), or remove its checkpoints/ folder to start it again"
        )
    accelerator.load_state(str(path))
    if sharded is not None:
        load_sharded_state(path, *sharded)
    return json.loads((path / STATE_FILE).read_text())


def sharded_parts(ctx: TrainContext) -> tuple | None:
    """The UNet, optimizer and LR schedule a checkpoint saves itself when the UNet is sharded
    (`models.components.sharding`); None when Accelerate holds them."""
    if not is_sharded(ctx.comps.unet):
        return None
    return ctx.comps.unet, ctx.optimizer, ctx.lr_scheduler


def resume(ctx: TrainContext) -> TrainState:
    """The state of the newest complete checkpoint in `checkpoints/`, restored into the
    models, optimizer, RNGs, loader and metrics sink; a fresh state when there is none."""
    path = latest_checkpoint(ctx.out / "checkpoints")
    if path is None:
        return TrainState()
    saved = load_checkpoint(ctx.accelerator, path, sharded_parts(ctx))
    # The loss history and the last window's metrics feed the manifest (final loss, plan vs
    # actual); a launch that resumes at max_steps logs nothing new.
    state = TrainState(
        step=saved["step"],
        loader_state=saved["loader"],
        losses=list(saved.get("losses", [])),
        last_log_step=saved.get("last_log_step", 0),
        elapsed_s=saved.get("elapsed_s", 0.0),
        val=list(saved.get("val", [])),
    )
    ctx.sink.last = dict(saved.get("metrics", {}))
    ctx.loader.load_state_dict(state.loader_state)
    log.info("resumed from %s at step %d", path, state.step)
    ctx.sink.event("resumed", step=state.step, checkpoint=str(path))
    return state


def checkpoint_extra(ctx: TrainContext, state: TrainState) -> dict:
    """What a checkpoint keeps beside Accelerate's state: the loader position and the
    histories the manifest needs (`resume` reads them back)."""
    return {
        "loader": ctx.loader.state_dict(),
        "elapsed_s": state.elapsed_s,
        "losses": state.losses,
        "last_log_step": state.last_log_step,
        "metrics": ctx.sink.last,
        "val": state.val,
    }
