"""The training loop's side concerns, called at named events (`base`). Each is a thin adapter
over an engine of its own folder, so a script outside the loop imports the engine:

- `log_heldout_loss`: the held-out validation loss and conditioning gap (`HeldOutLoss`, over
  `models.evaluation.heldout`);
- `log_sample_grids`: sample grids of fixed prompts and seeds (`SampleGrids`, over
  `models.evaluation.sample_grid`);
- `divergence_check`: a non-finite loss or gradient norm fails the stage (`DivergenceCheck`,
  over `models.training.divergence`);
- `due_checkpoint`: the due checkpoint (`DueCheckpoint`, over `models.training.checkpoint`);
- `step_faults`: a kill or stall after a step, from the stage file's test seams (`StepFaults`,
  over `models.training.faults`).
"""

from models.callbacks.base import Callback, Callbacks, StepEnd

__all__ = ["Callback", "Callbacks", "StepEnd"]
