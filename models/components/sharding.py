"""Sharded training of the UNet with PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`),
for a stage whose `train.sharding` is `shard_grad_op` or `full_shard`.

Kiln shards the UNet itself rather than through Accelerate's FSDP plugin: Accelerate 1.15 sets
FSDP up only on top of a GPU state, so on CPU (gloo) its plugin silently gives DDP. Owning the
`fully_shard` call makes one code path run on CPU over gloo and on GPUs over NCCL:

- each down, mid and up block is its own FSDP unit, then the UNet; `shard_grad_op` keeps the
  gathered parameters from the forward to the backward pass (ZeRO-2: gradients and AdamW state
  sharded), `full_shard` frees them after each unit's forward and gathers them again for the
  backward (ZeRO-3: parameters sharded too);
- in bf16 the units gather parameters and reduce gradients in bf16 (`MixedPrecisionPolicy`),
  beside fp32 master shards, and the forward runs under autocast, as Accelerate's plugin has
  it (norms and softmax in fp32);
- with gradient accumulation, gradients are reduce-scattered on the micro-batch that steps
  only (`set_requires_gradient_sync`);
- the sharded UNet, its AdamW and LR schedule are not `prepare`d (Accelerate would wrap the
  UNet in DDP): the training step gates the optimizer on `sync_gradients` itself;
- the EMA keeps a whole copy of the UNet, updated from the gathered weights after each step
  (an fp32 all-gather per step, parameter by parameter);
- a checkpoint holds the gathered (whole) UNet, AdamW state and LR schedule in
  `sharded_state.pt` beside Accelerate's RNG states and EMA; every rank loads it and keeps its
  shards, so a resume needs the same world size; a stage resumes under the sharding it was
  checkpointed with (DDP or sharded), and says so otherwise;
- validation, sample grids and the export work on a whole UNet gathered from the shards, so
  the export is the same diffusers pipeline as under DDP and a stage trained one way starts
  the next stage trained the other.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

__all__ = [
    "STATE_FILE",
    "full_parameters",
    "is_sharded",
    "load_sharded_state",
    "local_tensor",
    "plain_class",
    "save_sharded_state",
    "shard_unet",
    "whole_unet",
]

STATE_FILE = "sharded_state.pt"


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether `module` was sharded by `shard_unet`."""
    return isinstance(module, FSDPModule)


def shard_unet(unet, strategy: str, device: torch.device, weight_dtype: torch.dtype) -> None:
    """Shard `unet` in place over every process (see the module docstring).

    Args:
        unet: The UNet, on `device`, with the same weights on every rank.
        strategy: `shard_grad_op` or `full_shard`.
        device: This process's device (its type picks the mesh: cpu for gloo, cuda for NCCL).
        weight_dtype: The compute dtype (float32: no mixed precision).
    """
    world = torch.distributed.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    half = None if weight_dtype == torch.float32 else weight_dtype
    mp = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=half)
    reshard = strategy == "full_shard"
    for block in [*unet.down_blocks, unet.mid_block, *unet.up_blocks]:
        if block is not None:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(unet, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)


def plain_class(module: torch.nn.Module) -> type:
    """The UNet's own class: FSDP2 swaps a sharded module's class for a subclass."""
    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This process's part of `t` (its shard of a DTensor, else `t`)."""
    return t.to_local() if isinstance(t, DTensor) else t


def full_parameters(unet: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter gathered whole, in `parameters()` order (a collective)."""
    return [p.full_tensor() if isinstance(p, DTensor) else p for p in unet.parameters()]


def whole_unet(unet: torch.nn.Module, everywhere: bool = True) -> torch.nn.Module | None:
    """A plain (unsharded) copy of the sharded UNet, in fp32 on its device (default attention
    processors and memory layout), the global RNG left where it was. A collective: every rank
    calls it. With `everywhere` every rank gets one, else the main process only (the others
    get None)."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=not everywhere)
    state = get_model_state_dict(unet, options=opts)
    if not state:
        return None
    device = next(iter(local_tensor(p) for p in unet.parameters())).device
    # Built on the meta device (no initial weights drawn: the training RNG does not move),
    # then given the gathered tensors.
    with torch.device("meta"):
        plain = plain_class(unet).from_config(unet.config)
    plain.load_state_dict(state, assign=True)
    return plain.to(device)


def save_sharded_state(folder: Path, unet, optimizer, lr_scheduler, is_main: bool) -> None:
    """Write the whole UNet, AdamW state and LR schedule to `folder/STATE_FILE` (a collective:
    every rank calls it; the main process writes)."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model, optim = get_state_dict(unet, optimizer, options=opts)
    if is_main:
        torch.save(
            {"model": model, "optimizer": optim, "lr_scheduler": lr_scheduler.state_dict()},
            folder / STATE_FILE,
        )


def load_sharded_state(folder: Path, unet, optimizer, lr_scheduler) -> None:
    """Restore `save_sharded_state`'s file into the sharded UNet, AdamW and LR schedule
    (every rank reads it and keeps its own shards).

    Read weights-only: the file holds tensors, numbers and strings, and unpickling anything
    else would run code that whoever could write the checkpoint folder chose.

    Raises:
        RuntimeError: naming the file, where it holds anything else.
    """
    path = folder / STATE_FILE
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0]
        raise RuntimeError(
            f"{path}: not loaded, it holds more than tensors and numbers ({first}); a "
            "checkpoint Kiln wrote never does: replace it or resume from an earlier step"
        ) from None
    set_state_dict(
        unet,
        optimizer,
        model_state_dict=saved["model"],
        optim_state_dict=saved["optimizer"],
        options=StateDictOptions(full_state_dict=True),
    )
    lr_scheduler.load_state_dict(saved["lr_scheduler"])
