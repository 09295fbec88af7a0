"""The held-out validation loss while a stage trains: at step 0 of a fresh stage, every
`train.eval_every` steps and at the stage's end, through the evaluation engine
(`models.evaluation.heldout.Validator`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from models.callbacks.base import Callback, StepEnd
from models.evaluation.heldout import Validator

if TYPE_CHECKING:
    from models.training.metrics import MetricsWindow
    from models.training.state import TrainContext, TrainState

__all__ = ["HeldOutLoss"]


class HeldOutLoss(Callback):
    """The training loop's validations; their seconds stay off the metrics window's step time.

    Args:
        validator: The stage's Validator (`build_validator`).
        at_start: Evaluate the weights a fresh stage starts from (step 0) too.
    """

    def __init__(self, validator: Validator, at_start: bool = True):
        self.validator, self.at_start = validator, at_start

    def on_fit_start(self, ctx: TrainContext, state: TrainState, window: MetricsWindow) -> None:
        if self.at_start and state.step == 0:
            # The starting point of the curve: the weights the stage begins from (random, the
            # previous stage's or a warm start's), comparable with every later evaluation.
            window.exclude(self.validator.run(state, ctx.sink))

    def on_step_end(
        self, ctx: TrainContext, state: TrainState, window: MetricsWindow, step: StepEnd
    ) -> None:
        if self.validator.due(state.step):
            window.exclude(self.validator.run(state, ctx.sink))

    def on_fit_end(self, ctx: TrainContext, state: TrainState) -> None:
        self.validator.finish(state, ctx.sink)
        self.validator.evalset.close()
