"""The divergence check after every optimizer step: a non-finite window loss or gradient norm
fails the stage (`models.training.divergence`), before anything of the diverged state is
evaluated or checkpointed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from models.callbacks.base import Callback, StepEnd
from models.training.divergence import divergence, fail_diverged

if TYPE_CHECKING:
    from models.training.metrics import MetricsWindow
    from models.training.state import TrainContext, TrainState

__all__ = ["DivergenceCheck"]


class DivergenceCheck(Callback):
    """Fails the stage (`fail_diverged`) at the first optimizer step that diverged; first in
    the step's callbacks, so nothing of the diverged state is evaluated or checkpointed."""

    def on_step_end(
        self, ctx: TrainContext, state: TrainState, window: MetricsWindow, step: StepEnd
    ) -> None:
        skipped = ctx.accelerator.optimizer_step_was_skipped
        cause = divergence(step.grad_norm, skipped, step.mean_loss)
        if cause is not None:
            fail_diverged(ctx.accelerator, ctx.out, ctx.sink, state, cause)
