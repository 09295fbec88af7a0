"""Prompts cut before a real tiny pipeline sees them: no CLIP truncation warning in the log."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest
from diffusers import StableDiffusionPipeline

from kiln_config import load_config
from models.components.factory import build_components, sampling_scheduler
from models.data.tokenization import truncate_prompts

REPO = Path(__file__).resolve().parents[3]
# Mostly words the tiny tokenizer does not list, so they are mostly bytes and the cut falls
# inside "crimson" (the listed demo words are one token each, also where one ends a longer
# word: "crimson" ends in "on"; kiln_config.TokenizerConfig).
LONG = "a crimson circle beside a small cobalt square on a grassy meadow " * 4


@pytest.fixture(scope="module")
def tiny_pipe() -> StableDiffusionPipeline:
    c = build_components(load_config(REPO / "configs" / "tiny.yaml").train.model, seed=0)
    pipe = StableDiffusionPipeline(
        vae=c.vae,
        text_encoder=c.text_encoder,
        tokenizer=c.tokenizer,
        unet=c.unet,
        scheduler=sampling_scheduler(c.noise_scheduler),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pipeline_log(pipe, prompts: list[str]) -> str:
    """What diffusers logs while the pipeline encodes `prompts` (its logger does not
    propagate to the root logger, so caplog alone would see nothing)."""
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    logger = logging.getLogger("diffusers")
    logger.addHandler(handler)
    try:
        pipe(prompts, num_inference_steps=1, height=32, width=32, output_type="latent")
    finally:
        logger.removeHandler(handler)
    return buf.getvalue()


def test_long_prompts_are_cut_so_the_pipeline_warns_nothing(tiny_pipe, caplog):
    tok = tiny_pipe.tokenizer
    prompts = [LONG, "a cat"]
    assert "was truncated" in _pipeline_log(tiny_pipe, prompts), "the warning this prevents"
    with caplog.at_level(logging.INFO, logger="kiln.pyfunc"):
        cut = truncate_prompts(tok, prompts)
    assert _pipeline_log(tiny_pipe, cut) == ""
    assert cut[1] == "a cat", "a prompt that fits is unchanged"
    ids = tok(cut[0]).input_ids
    assert len(ids) <= tok.model_max_length
    kept = tok(LONG, truncation=True, max_length=tok.model_max_length).input_ids
    assert cut[0].endswith("meadow a cr"), "byte tokens: the cut falls inside a word"
    assert ids[:-2] == kept[:-2], "the tokens the pipeline would have kept, but for the last"
    assert [r.getMessage() for r in caplog.records if r.name == "kiln.pyfunc"] == [
        "1 of 2 prompts cut to the text encoder's 77 tokens"
    ]


def test_prompts_that_fit_are_returned_as_written(tiny_pipe, caplog):
    tok = tiny_pipe.tokenizer
    exact = "x" * (tok.model_max_length - 2)  # start and end tokens fill the rest
    prompts = ["A Red  Circle", exact, ""]
    with caplog.at_level(logging.INFO, logger="kiln.pyfunc"):
        assert truncate_prompts(tok, prompts) == prompts
    assert not [r for r in caplog.records if r.name.startswith(("kiln", "models", "transformers"))]
