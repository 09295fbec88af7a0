"""A diverged stage fails and stays failed.

When a logged (rank-averaged) window loss or an optimizer step's gradient norm is non-finite,
the training script writes `<output_dir>/DIVERGED.json` (the step, the last finite loss and
the message) and raises on every rank, before anything of the diverged state is checkpointed
or exported. Every relaunch (a Prefect retry) then fails at once with the same message, until
someone fixes the cause and deletes the file (docs/operations.md). `DivergenceCheck` is the
training loop's callback that checks every optimizer step.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from kiln_config.errors import KilnError

if TYPE_CHECKING:
    from accelerate import Accelerator


# In a stage folder: the stage diverged and stays failed (the training script writes it; the
# launch task reads it and does not retry).
DIVERGED = "DIVERGED.json"

__all__ = [
    "DIVERGED",
    "TrainingDiverged",
    "divergence",
    "fail_diverged",
    "raise_if_diverged",
]

log = logging.getLogger("kiln.train")


class TrainingDiverged(KilnError, FloatingPointError):
    """The loss or the gradient norm went non-finite. The message names the step and the last
    finite loss; `<output_dir>/DIVERGED.json` keeps it for every relaunch."""


def raise_if_diverged(out: Path) -> None:
    """Fail with the recorded message when the stage in `out` diverged in an earlier launch.

    Raises:
        TrainingDiverged: when `out/DIVERGED.json` exists.
    """
    if (out / DIVERGED).is_file():
        raise TrainingDiverged(json.loads((out / DIVERGED).read_text())["message"])


def divergence(grad_norm: float | None, step_skipped: bool, mean_loss: float | None) -> str | None:
    """What diverged at this optimizer step, or None when nothing did.

    The norm is of the all-reduced gradients (FSDP: a global norm), so every rank agrees, and
    reading it already waited for it: a check per step at no extra sync. A NaN loss on any
    rank makes it NaN, and the weights with it. fp16's loss scaler skips an overflowing step
    by itself (`step_skipped`): not a divergence. The window loss is reduced across ranks, so
    every rank takes the same branch too.

    Args:
        grad_norm: The step's gradient norm; None when the accelerator does not report it.
        step_skipped: Whether the optimizer skipped the step (fp16 overflow).
        mean_loss: The logged window's loss when a window ended at this step, else None.
    """
    if mean_loss is not None and not math.isfinite(mean_loss):
        return f"window loss {mean_loss}"
    if grad_norm is not None and not math.isfinite(grad_norm) and not step_skipped:
        return f"gradient norm {grad_norm}"
    return None


def fail_diverged(accelerator: Accelerator, out: Path, sink, state, cause: str) -> NoReturn:
    """Mark the stage failed (DIVERGED.json, written atomically) and raise on every rank.

    Raises:
        TrainingDiverged: always, naming the step, `cause` and the last finite loss.
    """
    if state.losses:
        last = f"last finite loss {state.losses[-1]!r} (step {state.last_log_step})"
    else:
        last = "no finite loss was logged before it"
    msg = (
        f"training diverged at step {state.step}: {cause}; {last}. Nothing was exported and "
        f"the diverged state was not checkpointed. Every relaunch fails with this message "
        f"until {out / DIVERGED} is deleted: fix the cause (a lower learning rate, say) first."
    )
    if accelerator.is_main_process:
        record = {
            "step": state.step,
            "cause": cause,
            "last_finite_loss": state.losses[-1] if state.losses else None,
            "last_finite_step": state.last_log_step if state.losses else None,
            "message": msg,
        }
        tmp = out / f".{DIVERGED}.tmp"
        tmp.write_text(json.dumps(record, indent=2))
        tmp.replace(out / DIVERGED)
        sink.event("diverged", step=state.step, message=msg)
    log.error(msg)
    # Every rank got here at the same step (see `divergence`): wait for the marker, so that a
    # rank raising first cannot have the launcher tear the main process down before it.
    accelerator.wait_for_everyone()
    raise TrainingDiverged(msg)
