from pathlib import Path

import pytest
import torch

from kiln_config import TokenizerConfig, load_config
from models.components.factory import (
    build_components,
    build_tokenizer,
    build_unet,
    encoder_mismatch,
    schedule_mismatch,
    vae_scale_factor,
)

REPO = Path(__file__).resolve().parents[3]


def test_byte_tokenizer_is_offline_and_lossless():
    tok = build_tokenizer(TokenizerConfig(builtin="bytes", model_max_length=77))
    ids = tok("a red circle above a small blue square").input_ids
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "a red circle above a small blue square"
    assert len(tok) == 514


def test_listed_words_are_single_tokens_and_every_byte_keeps_its_id(tmp_path):
    from transformers import CLIPTokenizerFast

    words = ["red", "green", "blue", "black", "background", "of", "on"]
    plain = build_tokenizer(TokenizerConfig(builtin="bytes", model_max_length=77))
    tok = build_tokenizer(TokenizerConfig(builtin="bytes", model_max_length=77, words=words))
    text = "a red circle on a black background left of green"
    pieces = tok.convert_ids_to_tokens(tok(text).input_ids)
    for w in ("red", "black", "background", "on", "of", "green"):
        assert f"{w}</w>" in pieces, pieces
    # Unlisted words are bytes, as before; so are listed ones at the start of other words.
    assert tok("circle reddish").input_ids == plain("circle reddish").input_ids
    # A listed word that ends a longer one is its token there too (BPE with only an
    # end-of-word marker cannot tell): documented in TokenizerConfig.
    assert tok.tokenize("bored") == ["b", "o", "red</w>"]
    assert tok.decode(tok(text).input_ids, skip_special_tokens=True) == text
    assert plain.bos_token_id == tok.bos_token_id and plain.eos_token_id == tok.eos_token_id
    # The exported pipeline saves the tokenizer: it must load back the same.
    tok.save_pretrained(tmp_path / "tok")
    again = CLIPTokenizerFast.from_pretrained(tmp_path / "tok")
    assert again(text).input_ids == tok(text).input_ids


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"builtin": "bytes", "words": ["Red"]}, "lower-case letters"),
        ({"builtin": "bytes", "words": [True]}, 'quote it \\("on"\\)'),  # YAML's bare `on`
        ({"pretrained": "x", "words": ["red"]}, "pretrained one has its own"),
    ],
)
def test_bad_tokenizer_words_are_clear_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        TokenizerConfig(**spec)


def test_a_tokenizer_without_words_dumps_as_before():
    """The dump is hashed into dataset versions and encoder keys: configs that list no words
    (sd2-base's) must keep their versions and precomputed latents."""
    cfg = load_config(REPO / "configs" / "sd2-base.yaml").train.model
    assert "words" not in cfg.tokenizer.model_dump()
    assert "words" not in cfg.model_dump(mode="json")["tokenizer"]
    assert TokenizerConfig(builtin="bytes").model_dump() == {
        "builtin": "bytes",
        "pretrained": None,
        "subfolder": None,
        "model_max_length": 77,
    }


def test_tiny_preset_tokenizer_spells_its_demo_words_as_words():
    """The tiny preset's captions reach the UNet as one token per word (docs/architecture.md,
    "The tiny preset's text encoder") and its text encoder has a row for every token."""
    cfg = load_config(REPO / "configs" / "tiny.yaml").train.model
    tok = build_tokenizer(cfg.tokenizer)
    ids = tok("a red circle above a small blue square on a white background").input_ids
    assert len(ids) == 12 + 2  # 12 words, BOS and EOS
    assert cfg.text_encoder.config["vocab_size"] >= len(tok)


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

    from models.components.export import write_pipeline

    cfg = load_config(REPO / "configs" / "tiny.yaml").train.model
    old = cfg.model_copy(
        update={
            "noise_scheduler": {
                k: v
                for k, v in cfg.noise_scheduler.items()
                if k not in ("prediction_type", "rescale_betas_zero_snr")
            }
        }
    )
    comps = build_components(old, seed=0)
    write_pipeline(comps, comps.unet, tmp_path / "old")
    saved = json.loads((tmp_path / "old" / "scheduler" / "scheduler_config.json").read_text())
    assert saved["timestep_spacing"] == "trailing", "the export samples as the config says"
    assert schedule_mismatch(str(tmp_path / "old"), old) == []
    diffs = schedule_mismatch(str(tmp_path / "old"), cfg)
    assert diffs == [
        "prediction_type: 'epsilon' there, 'v_prediction' here",
        "rescale_betas_zero_snr: False there, True here",
    ]
    with caplog.at_level("WARNING", logger="kiln.factory"):
        build_unet(cfg, str(tmp_path / "old"))
    assert any("trained with another objective" in r.getMessage() for r in caplog.records)


def test_a_unet_trained_on_another_text_encoder_loads_with_a_warning(tmp_path, caplog):
    """A warm start from a model of the previous tiny preset (byte tokens, 2 random layers)."""
    from models.components.export import write_pipeline

    cfg = load_config(REPO / "configs" / "tiny.yaml").train.model
    te = {**cfg.text_encoder.config, "num_hidden_layers": 2, "vocab_size": 514}
    old = cfg.model_copy(
        update={
            "text_encoder": cfg.text_encoder.model_copy(update={"config": te}),
            "tokenizer": cfg.tokenizer.model_copy(update={"words": []}),
        }
    )
    comps = build_components(old, seed=0)
    write_pipeline(comps, comps.unet, tmp_path / "old")
    assert encoder_mismatch(str(tmp_path / "old"), old) == []
    assert encoder_mismatch(str(tmp_path / "old"), cfg) == [
        "text_encoder.vocab_size: 514 there, 600 here",
        "text_encoder.num_hidden_layers: 2 there, 0 here",
        "tokenizer: 514 tokens there, 592 here",
    ]
    with caplog.at_level("WARNING", logger="kiln.factory"):
        build_unet(cfg, str(tmp_path / "old"))
    assert any("trained on another text encoder" in r.getMessage() for r in caplog.records)
