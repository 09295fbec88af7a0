"""The training loop's fault injection: a kill or a stall after an optimizer step.

`StepFaults` fires the stage file's `"step_end"` fault point (`models.training.faults`) last among
the step's callbacks, so a kill at step N leaves the checkpoint of step N behind when one was due,
as a real crash right after it would.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from models.callbacks.base import Callback, StepEnd

if TYPE_CHECKING:
    from models.training.metrics import MetricsWindow
    from models.training.state import TrainContext, TrainState

__all__ = ["StepFaults"]


class StepFaults(Callback):
    """A SIGKILL or an endless stall after the steps the stage file names, once."""

    def on_step_end(
        self, ctx: TrainContext, state: TrainState, window: MetricsWindow, step: StepEnd
    ) -> None:
        ctx.faults.at("step_end", step=state.step)
