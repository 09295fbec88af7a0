"""Sample grids of the intermediate steps while a stage trains, drawn by the grid engine
(`models.evaluation.sample_grid.sample_grid`) every `train.sample_every` steps.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from models.callbacks.base import Callback, StepEnd
from models.evaluation.sample_grid import sample_grid

if TYPE_CHECKING:
    from models.training.metrics import MetricsWindow
    from models.training.state import TrainContext, TrainState

__all__ = ["SampleGrids"]


class SampleGrids(Callback):
    """The grid of every `train.sample_every`-th intermediate step, on every rank; its seconds
    stay off the metrics window's step time. The stage's last step is left to the training
    script's end-of-stage grid, drawn once the optimizer state is released."""

    def on_step_end(
        self, ctx: TrainContext, state: TrainState, window: MetricsWindow, step: StepEnd
    ) -> None:
        run, every = ctx.run, ctx.run.train.sample_every
        if every is None or state.step % every or state.step >= run.stage.max_steps:
            return
        t0 = time.perf_counter()
        sample_grid(run, ctx.accelerator, ctx.comps, ctx.ema, state.step, ctx.sink)
        window.exclude(time.perf_counter() - t0)
