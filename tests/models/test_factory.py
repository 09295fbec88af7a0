from pathlib import Path

import pytest
import torch

from flows.config import load_config
from models.config import TokenizerConfig
from models.factory import (
    build_components,
    build_tokenizer,
    build_unet,
    schedule_mismatch,
    vae_scale_factor,
)

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


def test_a_unet_trained_with_another_objective_loads_with_a_warning(tmp_path, caplog):
    """A warm start from a model of the older tiny preset (epsilon, SD2's schedule)."""
    import json

    from models.export import write_pipeline

    cfg = load_config(REPO / "configs" / "tiny.yaml").train.model
    old = cfg.model_copy(update={"noise_scheduler": {
        k: v for k, v in cfg.noise_scheduler.items()
        if k not in ("prediction_type", "rescale_betas_zero_snr")}})  # fmt: skip
    comps = build_components(old, seed=0)
    write_pipeline(comps, comps.unet, tmp_path / "old")
    saved = json.loads((tmp_path / "old" / "scheduler" / "scheduler_config.json").read_text())
    assert saved["timestep_spacing"] == "trailing", "the export samples as the config says"
    assert schedule_mismatch(str(tmp_path / "old"), old) == []
    diffs = schedule_mismatch(str(tmp_path / "old"), cfg)
    assert diffs == ["prediction_type: 'epsilon' there, 'v_prediction' here",
                     "rescale_betas_zero_snr: False there, True here"]  # fmt: skip
    with caplog.at_level("WARNING", logger="kiln.factory"):
        build_unet(cfg, str(tmp_path / "old"))
    assert any("trained with another objective" in r.getMessage() for r in caplog.records)
