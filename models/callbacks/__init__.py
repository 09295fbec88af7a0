"""The training loop's side concerns, one module each, called at named events (`base`):

- `heldout_loss`: the held-out validation loss and conditioning gap (`HeldOutLoss`);
- `sample_grid`: sample grids of fixed prompts and seeds (`SampleGrids`);
- `divergence`: a non-finite loss or gradient norm fails the stage (`DivergenceCheck`);
- `checkpoint`: the due checkpoint (`DueCheckpoint`);
- `faults`: a kill or stall after a step, from the stage file's test seams (`StepFaults`).

Only the base is imported here: the launch task reads `divergence.DIVERGED` without torch.
"""

from models.callbacks.base import Callback, Callbacks, StepEnd

__all__ = ["Callback", "Callbacks", "StepEnd"]
