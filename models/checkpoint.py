"""Atomic, resumable checkpoints on top of `accelerator.save_state`.

A checkpoint is `checkpoints/step-NNNNNNNN/`: Accelerate's state (model, optimizer, LR
scheduler, registered objects such as EMA, per-rank RNG) plus `kiln_state.json` (step, the
streaming loader state, and the training script's own extras: the loss history and the last
logged metrics, which the manifest needs even when a launch resumes at the last step). It is
written under a temporary name and renamed only when complete, and `kiln_state.json` is the
last file written, so a folder without it is never resumed from.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from accelerate import Accelerator

__all__ = ["latest_checkpoint", "load_checkpoint", "save_checkpoint"]

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
    accelerator: Accelerator, ckpt_root: Path, step: int, extra: dict, keep: int
) -> Path:
    """Save on every rank (each writes its own RNG state), publish on the main one."""
    final = ckpt_root / f"step-{step:08d}"
    tmp = ckpt_root / f"step-{step:08d}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, **extra}))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in _step_dirs(ckpt_root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator: Accelerator, path: Path) -> dict:
    """Restore Accelerate's state from `path` and return the Kiln state (step, loader, extras)."""
    accelerator.load_state(str(path))
    return json.loads((path / STATE_FILE).read_text())
