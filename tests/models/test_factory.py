from pathlib import Path

import pytest
import torch

from flows.config import load_config
from models.config import TokenizerConfig
from models.factory import build_components, build_tokenizer, vae_scale_factor

REPO = Path(__file__).resolve().parents[2]


def test_byte_tokenizer_is_offline_and_lossless():
    tok = build_tokenizer(TokenizerConfig(builtin="bytes", model_max_length=77))
    ids = tok("a red circle above a small blue square").input_ids
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "a red circle above a small blue square"
    assert len(tok) == 514


def test_tiny_components_are_seeded_and_consistent():
    cfg = load_config(REPO / "configs" / "tiny.yaml").train.model
    a = build_components(cfg, seed=0)
    b = build_components(cfg, seed=0)
    for pa, pb in zip(a.unet.parameters(), b.unet.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert not any(p.requires_grad for p in a.vae.parameters())
    assert vae_scale_factor(a.vae) == 4
    latents = torch.randn(2, 4, 8, 8)
    ids = a.tokenizer(["x", "y"], padding="max_length", return_tensors="pt").input_ids
    out = a.unet(latents, torch.tensor([1, 500]), a.text_encoder(ids)[0]).sample
    assert out.shape == latents.shape


def test_cross_attention_mismatch_is_a_clear_error():
    cfg = load_config(REPO / "configs" / "tiny.yaml").train.model
    cfg.unet = {**cfg.unet, "cross_attention_dim": 48}
    with pytest.raises(ValueError, match="cross_attention_dim"):
        build_components(cfg)
