"""What one stage's training carries: its state across launches and its context within one.

`TrainState` is where the stage stands (step, loader position, loss and validation
histories); it is saved in every checkpoint and restored on resume (`models.training.checkpoint`).
`TrainContext` is everything the training steps and the loop's callbacks (`models.callbacks`)
use, built once by the training script's phases (`models.train`). Both live here, below the
loop and the checkpoints, so that neither of those imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from models.training.faults import Faults

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator
    from accelerate.scheduler import AcceleratedScheduler
    from diffusers.training_utils import EMAModel

    from kiln_config import StageRun
    from models.components.factory import Components
    from models.data.loader import KilnLoader
    from models.training.metrics import MetricsSink

__all__ = ["TrainContext", "TrainState"]


@dataclass
class TrainState:
    """Where the stage's training stands; checkpointed with the models, so it spans launches."""

    step: int = 0
    loader_state: dict | None = None
    losses: list[float] = field(default_factory=list)  # logged window means, over all launches
    last_log_step: int = 0  # the step of losses[-1]
    elapsed_s: float = 0.0  # training wall time over every launch of the stage (logged windows)
    val: list[dict] = field(default_factory=list)  # each validation's metrics, over all launches


@dataclass
class TrainContext:
    """Everything one stage's training steps use, built once by the script's phases."""

    run: StageRun
    accelerator: Accelerator
    comps: Components
    optimizer: torch.optim.Optimizer
    lr_scheduler: AcceleratedScheduler
    ema: EMAModel | None
    weight_dtype: torch.dtype
    loader: KilnLoader
    sink: MetricsSink

    @property
    def out(self) -> Path:
        """The stage's output folder."""
        return Path(self.run.output_dir)

    @property
    def faults(self) -> Faults:
        """The stage file's fault injection (test seams), at this stage's folder."""
        return Faults.of(self.run)
