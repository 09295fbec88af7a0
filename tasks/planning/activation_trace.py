"""The UNet's activation memory for one training step, traced on the meta device.

The UNet is built from its config dict on PyTorch's meta device (shapes, no storage) and run
forward in training mode at the stage's per-GPU batch and latent size, inside
`torch.autograd.graph.saved_tensors_hooks`. Every tensor autograd saves for the backward pass
is recorded once per storage (views share it), parameters excluded: that is what the step holds
between its forward and backward passes. Nothing is allocated, so the real-size UNet at 1024 px
traces in about a second.

Attention is traced the way training runs it:

- `memory_efficient` (`train.attention: sdpa`, PyTorch's flash and memory-efficient kernels,
  also on CPU): each attention saves its query, key, value, output and a log-sum-exp per
  query, never the (query x key) score matrix;
- `math` (`train.attention: eager`): the score matrix's softmax is saved, per head.

At the step's peak, early in the backward pass, the saved tensors are joined by the backward's
working set, taken as twice the largest saved tensor (its gradient and its producer's). With
gradient checkpointing (`enable_gradient_checkpointing`: each ResNet and transformer block
recomputed in the backward pass), the step holds the blocks' inputs plus the largest single
block's activations, recomputed, plus the largest tensor's gradient.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import astuple, dataclass
from functools import lru_cache
from typing import Any

import torch

__all__ = ["ActivationTrace", "trace_activations", "unet_parameter_count"]

# Modules that run their input in fp32 under bf16/fp16 autocast (torch's autocast fp32 list):
# what they save stays 4 bytes per element in mixed precision; everything else halves.
_FP32_UNDER_AUTOCAST = ("GroupNorm", "LayerNorm")
# The blocks diffusers recomputes under gradient checkpointing.
_CHECKPOINT_UNITS = ("ResnetBlock2D", "Transformer2DModel")


@dataclass(frozen=True)
class ActivationTrace:
    """Bytes autograd saves in one forward pass, traced in fp32 (see `peak_bytes`)."""

    saved_fp32: int  # every saved tensor, as traced in fp32
    saved_in_norms: int  # the part saved inside GroupNorm/LayerNorm (stays fp32 in autocast)
    largest_unit: int  # the largest ResNet/transformer block's own saved bytes (fp32)
    checkpointed_fp32: int  # saved with gradient checkpointing on (the blocks' inputs)
    largest_tensor: int  # the largest single saved tensor (fp32)

    def peak_bytes(self, mixed_precision: str, checkpointing: bool, fp32_norms: bool = True) -> int:
        """Activation memory at the step's peak, in a precision ('no', 'bf16' or 'fp16').

        The saved tensors plus the backward pass's working set: the gradients of the largest
        saved tensor and of the one that produced it (twice the largest). With checkpointing:
        the blocks' inputs, plus the largest block recomputed (which holds one of those two),
        plus the largest tensor once more. Both are calibrated against the measured CPU peaks
        of tests/tasks/planning/test_memory_model.py.

        Under autocast, matmul and convolution outputs take 2 bytes per element. CUDA's
        autocast runs GroupNorm and LayerNorm in fp32, so what they save keeps 4 bytes
        (`fp32_norms`); CPU's autocast runs them in bf16 (`fp32_norms=False`).
        """
        half = mixed_precision in ("bf16", "fp16")
        share = self.saved_in_norms / max(1, self.saved_fp32) if fp32_norms else 0.0

        def scaled(total: int) -> int:
            norms = round(total * share)
            return (total - norms) // 2 + norms if half else total

        big = scaled(self.largest_tensor)
        if not checkpointing:
            return scaled(self.saved_fp32) + 2 * big
        return scaled(self.checkpointed_fp32) + scaled(self.largest_unit) + big


def _meta_unet(unet_cfg: dict[str, Any]):
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        return UNet2DConditionModel.from_config(unet_cfg)


def unet_parameter_count(unet_cfg: dict[str, Any]) -> int:
    """Exact parameter count of the UNet built from `unet_cfg`, on the meta device."""
    return sum(p.numel() for p in _meta_unet(unet_cfg).parameters())


@lru_cache(maxsize=16)
def _fsdp_units(unet_json: str) -> tuple[int, int]:
    unet = _meta_unet(json.loads(unet_json))
    blocks = [b for b in (*unet.down_blocks, unet.mid_block, *unet.up_blocks) if b is not None]
    in_blocks = sum(p.numel() for b in blocks for p in b.parameters())
    total = sum(p.numel() for p in unet.parameters())
    return total - in_blocks, max(sum(p.numel() for p in b.parameters()) for b in blocks)


def fsdp_units(unet_cfg: dict[str, Any]) -> tuple[int, int]:
    """(parameters outside the blocks, parameters of the largest block) of the UNet as Kiln's
    FSDP wraps it (models/components/sharding.py: each down, mid and up block a unit)."""
    return _fsdp_units(json.dumps(unet_cfg, sort_keys=True))


class _EfficientAttention(torch.autograd.Function):
    """What a flash / memory-efficient kernel keeps for backward: q, k, v, out, log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - the trace never runs backward
        raise NotImplementedError("a meta trace only")


class _TraceAttnProcessor:
    """The default attention processor's computation for the trace, with the attention kernel
    replaced by `_EfficientAttention` (`memory_efficient`) or explicit softmax (`math`)."""

    def __init__(self, math: bool):
        self.math = math

    def __call__(
        self,
        attn,
        hidden_states,
        encoder_hidden_states=None,
        attention_mask=None,
        temb=None,
        *args,
        **kwargs,
    ):
        if attn.spatial_norm is not None or attn.group_norm is not None:
            raise ValueError("the trace supports the UNet's transformer attention only")
        b, n, _ = hidden_states.shape
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        q, k, v = attn.to_q(hidden_states), attn.to_k(context), attn.to_v(context)
        d = k.shape[-1] // attn.heads
        q, k, v = (t.view(b, -1, attn.heads, d).transpose(1, 2) for t in (q, k, v))
        if self.math:
            probs = (q @ k.transpose(-1, -2) * d**-0.5).softmax(dim=-1)
            out = probs @ v
        else:
            out = _EfficientAttention.apply(q, k, v)
        out = attn.to_out[1](attn.to_out[0](out.transpose(1, 2).reshape(b, n, attn.heads * d)))
        return (out + hidden_states if attn.residual_connection else out) / (
            attn.rescale_output_factor
        )


def _pop(stack: list) -> None:
    stack.pop()  # a forward hook that returns None leaves the module's output as it is


@contextmanager
def _module_stack(unet, names: tuple[str, ...]):
    """A list that holds the class names of the `names` modules the forward is inside."""
    stack: list[tuple[str, int]] = []
    handles = []
    for m in unet.modules():
        kind = type(m).__name__
        if kind in names:
            handles.append(
                m.register_forward_pre_hook(lambda mod, args, k=kind: stack.append((k, id(mod))))
            )
            handles.append(m.register_forward_hook(lambda mod, args, out: _pop(stack)))
    try:
        yield stack
    finally:
        for h in handles:
            h.remove()


def _saved_bytes(unet, batch: int, side: int, seq_len: int, checkpointing: bool) -> tuple:
    """(total, in norms, per checkpoint unit) bytes saved by one meta forward."""
    params = {p.untyped_storage()._cdata for p in unet.parameters()}
    seen: dict[int, torch.Tensor] = {}
    total, norms, units, largest = 0, 0, {}, 0
    with _module_stack(unet, _FP32_UNDER_AUTOCAST + _CHECKPOINT_UNITS) as stack:

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total, norms, largest
            key = t.untyped_storage()._cdata
            if key in params or key in seen:
                return t
            seen[key] = t  # held, so the storage key is not reused during the trace
            n = t.untyped_storage().nbytes()
            total += n
            largest = max(largest, n)
            if stack and stack[-1][0] in _FP32_UNDER_AUTOCAST:
                norms += n
            unit = next((i for k, i in reversed(stack) if k in _CHECKPOINT_UNITS), None)
            units[unit] = units.get(unit, 0) + n
            return t

        cfg = unet.config
        x = torch.empty(batch, cfg.in_channels, side, side, device="meta")
        text = torch.empty(batch, seq_len, cfg.cross_attention_dim, device="meta")
        t = torch.zeros(batch, dtype=torch.long, device="meta")
        if checkpointing:
            unet.enable_gradient_checkpointing()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            unet(x, t, text)
    units.pop(None, None)
    return total, norms, units, largest


def trace_activations(
    unet_cfg: dict[str, Any], batch: int, latent_side: int, seq_len: int, attention: str
) -> ActivationTrace:
    """Trace the UNet of `unet_cfg` at a per-GPU `batch` of `latent_side`² latents.

    Args:
        unet_cfg: The UNet's config dict (`train.model.unet`).
        batch: Samples per process per micro-batch.
        latent_side: Latent side (the stage's resolution over the VAE's downsampling).
        seq_len: Text tokens per caption (the tokenizer's `model_max_length`).
        attention: `sdpa` (memory-efficient kernels) or `eager` (explicit softmax).

    Returns:
        The saved bytes, in fp32, with and without gradient checkpointing.
    """
    # Every tensor autograd saves has the batch as its first dimension, so one sample's trace
    # times the batch is the batch's, byte for byte (tests/tasks/planning/test_memory_model.py);
    # a plan asks for many batch sizes and traces each resolution once.
    one = _trace(json.dumps(unet_cfg, sort_keys=True), 1, latent_side, seq_len, attention)
    return ActivationTrace(*(batch * v for v in astuple(one)))


@lru_cache(maxsize=64)
def _trace(unet_json: str, batch: int, latent_side: int, seq_len: int, attention: str):
    """`trace_activations`, once per distinct input (a plan asks for each stage's several
    times: every setup shares one trace)."""
    unet = _meta_unet(json.loads(unet_json))
    unet.train()
    unet.set_attn_processor(_TraceAttnProcessor(math=attention == "eager"))
    total, norms, units, largest = _saved_bytes(unet, batch, latent_side, seq_len, False)
    ckpt, _, _, _ = _saved_bytes(unet, batch, latent_side, seq_len, True)
    return ActivationTrace(total, norms, max(units.values(), default=0), ckpt, largest)
