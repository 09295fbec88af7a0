"""The training loop's callbacks: side concerns it calls at named events.

As in Composer and mosaicml/diffusion's `callbacks/`, `train_loop` (`models.train`) stays a
loop over batches and optimizer steps; what else happens while a stage trains (the held-out
loss, sample grids, the divergence check, checkpoints, fault injection) is a `Callback` that
acts at the events it cares about:

- `on_fit_start`: once per launch, after the resume, before the first batch;
- `on_step_end`: after every optimizer step (once the metrics window is logged), in the
  order of the list: nothing after a divergence check runs on a diverged state, and the
  checkpoint comes after every hook whose result it keeps;
- `on_fit_end`: once the stage's last step is done (or a resumed launch found it done).

Every rank calls every event at the same step: a callback that runs a collective (an
evaluation, a grid under FSDP, a checkpoint) relies on it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from models.training.metrics import MetricsWindow
    from models.training.state import TrainContext, TrainState

__all__ = ["Callback", "Callbacks", "StepEnd"]


@dataclass(frozen=True)
class StepEnd:
    """What one optimizer step leaves for the callbacks.

    Attributes:
        grad_norm: The gradient norm before clipping; None when the accelerator reports none.
        mean_loss: The logged window's loss when a window ended at this step, else None.
    """

    grad_norm: float | None
    mean_loss: float | None


class Callback:
    """A side concern of the training loop. Every event does nothing unless overridden.

    The events get the stage's context, its training state (theirs to update: a validation
    appends to `state.val`) and the current metrics window, whose step time a callback keeps
    its own seconds out of (`window.exclude`).
    """

    def on_fit_start(self, ctx: TrainContext, state: TrainState, window: MetricsWindow) -> None:
        """Once per launch, before the first batch."""

    def on_step_end(
        self, ctx: TrainContext, state: TrainState, window: MetricsWindow, step: StepEnd
    ) -> None:
        """After optimizer step `state.step`."""

    def on_fit_end(self, ctx: TrainContext, state: TrainState) -> None:
        """Once the stage's last step is done."""


class Callbacks(Callback):
    """Callbacks run in order, as one."""

    def __init__(self, callbacks: Iterable[Callback]):
        self.callbacks = list(callbacks)

    def on_fit_start(self, ctx: TrainContext, state: TrainState, window: MetricsWindow) -> None:
        for cb in self.callbacks:
            cb.on_fit_start(ctx, state, window)

    def on_step_end(
        self, ctx: TrainContext, state: TrainState, window: MetricsWindow, step: StepEnd
    ) -> None:
        for cb in self.callbacks:
            cb.on_step_end(ctx, state, window, step)

    def on_fit_end(self, ctx: TrainContext, state: TrainState) -> None:
        for cb in self.callbacks:
            cb.on_fit_end(ctx, state)
