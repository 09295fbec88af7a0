"""The training loop's checkpoints: every `train.checkpoint_every` steps and at the last.

`DueCheckpoint` saves Accelerate's state (models, optimizer, LR schedule, EMA, every rank's RNG) and
the loader position and histories (`models.training.checkpoint.checkpoint_extra`) through the atomic
`models.training.checkpoint.save_checkpoint`. It comes last among the step's callbacks but the fault
injection: the checkpoint holds the validation of its step (a resume does not redo it) and follows
the step's sample grid (a resume never skips one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from models.callbacks.base import Callback, StepEnd
from models.training.checkpoint import checkpoint_extra, save_checkpoint, sharded_parts

if TYPE_CHECKING:
    from models.training.metrics import MetricsWindow
    from models.training.state import TrainContext, TrainState

__all__ = ["DueCheckpoint"]


class DueCheckpoint(Callback):
    """Checkpoints every `checkpoint_every` steps and at the stage's last step."""

    def on_step_end(
        self, ctx: TrainContext, state: TrainState, window: MetricsWindow, step: StepEnd
    ) -> None:
        cfg = ctx.run.train
        if state.step % cfg.checkpoint_every and state.step != ctx.run.stage.max_steps:
            return
        save_checkpoint(
            ctx.accelerator,
            ctx.out / "checkpoints",
            state.step,
            checkpoint_extra(ctx, state),
            cfg.keep_checkpoints,
            sharded_parts(ctx),
        )
