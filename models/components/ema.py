"""The UNet's exponential moving average, kept in float32 or bfloat16 (`train.ema_dtype`).

diffusers' `EMAModel` holds its shadow weights in the parameters' dtype: for SD2-base's 865M
fp32 parameters that is 3.5 GB beside 3.5 GB of weights, 3.5 GB of gradients and 6.9 GB of
AdamW state, more than a 24 GB machine holds with the frozen encoders and activations.
In bfloat16 the copy takes 1.7 GB.

bfloat16 has 8 significant bits, so rounding each update to the nearest value loses it: with
decay 0.9995 a step moves a weight by 0.0005 x (ema - weight), far below half a bfloat16 ulp
(0.2 % of the weight) unless the two differ by 4x, and the average would stay at its start.
Each update is therefore computed in float32, one tensor at a time, and rounded
*stochastically* to bfloat16: up or down with probabilities that make the stored value right
in expectation, as in low-precision training (Gupta et al. 2015, "Deep Learning with Limited
Numerical Precision"). The random bits come from a generator seeded with the EMA's seed and
step, so a resumed run rounds exactly as an uninterrupted one did.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from diffusers.training_utils import EMAModel

__all__ = ["EMA_DTYPES", "KilnEMA", "stochastic_round_bf16"]

EMA_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """`x` (float32) rounded to bfloat16, up or down at random in proportion to its distance
    from each neighbour, so the expected result is `x` itself."""
    bits = x.contiguous().view(torch.int32).clone()
    # bfloat16 is float32's upper 16 bits: add uniform noise below them, then truncate. For a
    # negative value the bits are its magnitude's, so the rounding is symmetric.
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, generator=generator)
    bits.add_(noise.to(bits.device)).bitwise_and_(-65536)  # -65536 == 0xFFFF0000
    return bits.view(torch.float32).to(torch.bfloat16)


class KilnEMA(EMAModel):
    """diffusers' `EMAModel` with its shadow weights in `dtype` (see the module docstring).

    Args:
        parameters: The UNet's parameters.
        dtype: float32 (diffusers' own update) or bfloat16 (fp32 math per tensor, stochastic
            rounding).
        seed: Seeds the rounding's random bits (with the step).
        **kwargs: `EMAModel`'s (decay, update_after_step, model_cls, model_config).
    """

    def __init__(
        self,
        parameters: Iterable[torch.nn.Parameter],
        *,
        dtype: torch.dtype,
        seed: int = 0,
        **kwargs,
    ) -> None:
        super().__init__(parameters, **kwargs)
        self.dtype, self.seed = dtype, seed
        self.to(dtype=dtype)

    def to(self, device=None, dtype=None, non_blocking=False) -> None:
        """Move the shadow weights to `device`; they keep the EMA's dtype unless one is given."""
        super().to(
            device=device, dtype=dtype or getattr(self, "dtype", None), non_blocking=non_blocking
        )

    @torch.no_grad()
    def step(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """One EMA update towards `parameters` (the step's decay as diffusers computes it)."""
        if self.dtype == torch.float32:
            super().step(parameters)
            return
        self.optimization_step += 1
        decay = self.get_decay(self.optimization_step)
        self.cur_decay_value = decay
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.optimization_step)
        for s_param, param in zip(self.shadow_params, parameters, strict=True):
            if not param.requires_grad:
                s_param.copy_(param)
                continue
            s32 = s_param.float()
            s32.sub_((1 - decay) * (s32 - param.float()))
            s_param.copy_(stochastic_round_bf16(s32, gen))

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a checkpoint's EMA into the shadow tensors in place (cast to this EMA's
        dtype): diffusers deep-copies the state first, a transient copy of every weight."""
        state_dict = dict(state_dict)
        shadow = state_dict.pop("shadow_params", None)
        super().load_state_dict(state_dict)
        if shadow is None:
            return
        if len(shadow) != len(self.shadow_params):
            raise ValueError(
                f"the checkpoint's EMA holds {len(shadow)} tensors, the UNet "
                f"{len(self.shadow_params)}"
            )
        for dst, src in zip(self.shadow_params, shadow, strict=True):
            dst.copy_(src)
