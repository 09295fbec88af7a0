"""The EMA in bfloat16: stochastic rounding keeps small updates, deterministically."""

import pytest
import torch

from kiln_config import TrainConfig
from models.components.ema import EMA_DTYPES, KilnEMA, stochastic_round_bf16


def _ema(dtype, seed=0, start=1.0):
    p = torch.nn.Parameter(torch.full((4096,), start))
    return p, KilnEMA([p], dtype=EMA_DTYPES[dtype], seed=seed, decay=0.9995, update_after_step=0)


def _track(ema, p, target, steps):
    with torch.no_grad():
        p.fill_(target)
    for _ in range(steps):
        ema.step([p])
    return ema.shadow_params[0].float()


def test_stochastic_rounding_is_unbiased_and_lands_on_neighbours():
    x = torch.full((200_000,), 1.0 + 2**-10)  # a quarter of the way from 1.0 to the next bf16
    r = stochastic_round_bf16(x, torch.Generator().manual_seed(0))
    assert r.dtype == torch.bfloat16
    assert set(r.float().unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert abs(r.float().mean().item() - x[0].item()) < 2e-5
    neg = stochastic_round_bf16(-x, torch.Generator().manual_seed(0))
    assert torch.equal(neg, -r), "rounding is symmetric in sign"


def test_bf16_ema_follows_small_updates_that_nearest_rounding_would_lose():
    # decay 0.9995 towards weights 1 % away: each update is ~5e-6, 0.1 % of a bf16 ulp at 1.0.
    p32, ema32 = _ema("float32")
    p16, ema16 = _ema("bfloat16")
    for ema, p in ((ema32, p32), (ema16, p16)):
        _track(ema, p, 1.0, 50)  # past diffusers' decay warm-up, still at 1.0
    ref = _track(ema32, p32, 1.01, 2000)
    got = _track(ema16, p16, 1.01, 2000)
    moved = ref.mean().item() - 1.0
    assert 0.003 < moved < 0.01
    assert abs(got.mean().item() - ref.mean().item()) < 0.05 * moved
    assert ema16.shadow_params[0].dtype == torch.bfloat16


def test_bf16_ema_is_deterministic_and_resumes_exactly():
    pa, a = _ema("bfloat16", seed=3)
    pb, b = _ema("bfloat16", seed=3)
    _track(a, pa, 1.3, 10)
    state = {k: (list(v) if isinstance(v, list) else v) for k, v in a.state_dict().items()}
    state["shadow_params"] = [t.clone() for t in state["shadow_params"]]
    _track(a, pa, 1.3, 10)
    _track(b, pb, 0.0, 3)  # b is elsewhere, then takes a's checkpoint
    ptr = b.shadow_params[0].data_ptr()
    b.load_state_dict(state)
    assert b.shadow_params[0].data_ptr() == ptr, "restored in place, not as a copy"
    assert b.optimization_step == 10
    _track(b, pb, 1.3, 10)
    assert torch.equal(a.shadow_params[0], b.shadow_params[0])


def test_ema_dtype_is_validated():
    with pytest.raises(ValueError, match="ema_dtype"):
        TrainConfig.model_validate(
            {
                "model": {
                    "unet": {},
                    "vae": {"config": {}},
                    "text_encoder": {"config": {}},
                    "tokenizer": {"builtin": "bytes"},
                },
                "stages": [
                    {"resolution": 32, "batch_size": 1, "learning_rate": 1e-4, "max_steps": 1}
                ],
                "ema_dtype": "float16",
            }
        )
