"""Fault injection for the training script: the test seams of `StageRun.faults`.

Each seam is a parameter of the stage file (`kiln_config.FaultInjection`), never an
environment switch, and the training script reaches every one through one hook,
`Faults.at(point, ...)`, at these named points:

- `"loss"`: a micro-batch's loss, NaN at optimizer step `nan_at_step` (a divergence);
- `"step_end"`: after an optimizer step, a SIGKILL (`kill_at_steps`) or an endless stall
  (`stall_at_step`; `models.callbacks.step_faults` calls it);
- `"weights"`: the UNet right before the export's checksum, shifted on rank `desync_rank`;
- `"export:<point>"`: a SIGKILL of the main process at an export point (`kill_in_export`).

Kills and stalls fire once per stage folder (a `.fault-fired-*` marker remembers them), so the
relaunch that follows runs through; a NaN loss and a weight desync act on every launch, as the
real faults would.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, get_args

from kiln_config import FaultInjection

if TYPE_CHECKING:
    import torch

    from kiln_config import StageRun

__all__ = ["EXPORT_POINTS", "POINTS", "Faults"]

log = logging.getLogger("kiln.train")

# The export's kill points, as the stage file's schema lists them.
EXPORT_POINTS: tuple[str, ...] = get_args(
    get_args(FaultInjection.model_fields["kill_in_export"].annotation)[0]
)
POINTS = ("loss", "step_end", "weights", *(f"export:{p}" for p in EXPORT_POINTS))

T = TypeVar("T")


class Faults:
    """The faults a stage file plans, fired at the training script's named points.

    Args:
        plan: The stage file's `faults` section.
        out: The stage's output folder (where the fire-once markers go).
    """

    def __init__(self, plan: FaultInjection, out: Path):
        self.plan, self.out = plan, Path(out)

    @classmethod
    def of(cls, run: StageRun) -> Faults:
        """The faults of stage file `run`, at its output folder."""
        return cls(run.faults, Path(run.output_dir))

    def at(
        self, point: str, value: T = None, *, step: int | None = None, rank: int | None = None
    ) -> T:
        """Fire the fault planned at `point`, if any.

        Args:
            point: One of `POINTS`.
            value: What the point passes through: the loss tensor at `"loss"` (returned NaN
                when the fault is due), the UNet at `"weights"` (perturbed in place).
            step: The optimizer step (`"loss"`: the one the micro-batch belongs to, from 1;
                `"step_end"`: the one just done).
            rank: The process index (`"weights"`).

        Returns:
            `value`, NaN at a due `"loss"` fault, else unchanged.

        Raises:
            ValueError: when `point` is not one of `POINTS`.
        """
        if point == "loss":
            return value * float("nan") if step == self.plan.nan_at_step else value
        if point == "step_end":
            self._step_end(step)
        elif point == "weights":
            self._perturb(value, rank)
        elif point in POINTS:  # an export point
            self._kill_in_export(point.removeprefix("export:"))
        else:
            raise ValueError(f"fault point {point!r} is not one of {', '.join(POINTS)}")
        return value

    def _fire_once(self, name: str) -> bool:
        marker = self.out / f".fault-fired-{name}"
        if marker.exists():
            return False
        marker.touch()
        return True

    def _step_end(self, step: int) -> None:
        """After optimizer step `step`: a SIGKILL (crash) or an endless stall (hang), once."""
        if step not in self.plan.kill_at_steps and step != self.plan.stall_at_step:
            return
        if not self._fire_once(str(step)):
            return
        log.warning("fault injection at step %d", step)
        if step == self.plan.stall_at_step:
            while True:  # a hang: no more heartbeats until the watchdog kills us
                time.sleep(3600)
        os.kill(os.getpid(), signal.SIGKILL)

    def _kill_in_export(self, point: str) -> None:
        """SIGKILL the (main) process at export point `point`, once."""
        if point in self.plan.kill_in_export and self._fire_once(f"export-{point}"):
            log.warning("fault injection in the export: %s", point)
            os.kill(os.getpid(), signal.SIGKILL)

    def _perturb(self, module: torch.nn.Module, rank: int) -> None:
        """On rank `desync_rank`, shift one parameter: ranks that no longer agree."""
        if rank == self.plan.desync_rank:
            import torch

            log.warning("fault injection: perturbing rank %d's weights", rank)
            with torch.no_grad():
                next(module.parameters()).add_(1e-3)
