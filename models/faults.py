"""Fault injection for the training script: the test seams of `StageRun.faults`.

Each seam is a parameter of the stage file (`kiln_config.FaultInjection`), never an
environment switch. Kills and stalls fire once per stage folder (a `.fault-fired-*` marker
remembers them), so the relaunch that follows runs through; a NaN loss and a weight desync
act on every launch, as the real faults would.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import torch

from kiln_config import FaultInjection

__all__ = ["kill_in_export", "nan_loss", "perturb_weights", "step_fault"]

log = logging.getLogger("kiln.train")


def _fire_once(out: Path, name: str) -> bool:
    marker = out / f".fault-fired-{name}"
    if marker.exists():
        return False
    marker.touch()
    return True


def step_fault(faults: FaultInjection, step: int, out: Path) -> None:
    """After optimizer step `step`: a SIGKILL (crash) or an endless stall (hang), once."""
    if step not in faults.kill_at_steps and step != faults.stall_at_step:
        return
    if not _fire_once(out, str(step)):
        return
    log.warning("fault injection at step %d", step)
    if step == faults.stall_at_step:
        while True:  # a hang: no more heartbeats until the watchdog kills us
            time.sleep(3600)
    os.kill(os.getpid(), signal.SIGKILL)


def kill_in_export(faults: FaultInjection, point: str, out: Path) -> None:
    """SIGKILL the (main) process at export point `point`, once."""
    if point in faults.kill_in_export and _fire_once(out, f"export-{point}"):
        log.warning("fault injection in the export: %s", point)
        os.kill(os.getpid(), signal.SIGKILL)


def nan_loss(faults: FaultInjection, step: int, loss: torch.Tensor) -> torch.Tensor:
    """The loss of a micro-batch of optimizer step `step`, NaN at `faults.nan_at_step`."""
    return loss * float("nan") if step == faults.nan_at_step else loss


def perturb_weights(faults: FaultInjection, module: torch.nn.Module, rank: int) -> None:
    """On rank `faults.desync_rank`, shift one parameter: ranks that no longer agree."""
    if rank == faults.desync_rank:
        log.warning("fault injection: perturbing rank %d's weights", rank)
        with torch.no_grad():
            next(module.parameters()).add_(1e-3)
