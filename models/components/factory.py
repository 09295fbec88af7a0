"""Build the UNet, VAE, text encoder, tokenizer and noise scheduler from a :class:`ModelConfig`.

The UNet is always built from its config dict (Kiln trains it from scratch). The VAE and text
encoder are frozen: built from a dict for the `tiny` preset (whose VAE the flows first fit on the
data, `models/components/vae_fit.py`, and then load from its folder), or loaded from a local path or
hub id (`stabilityai/stable-diffusion-2-base` subfolders) for real runs. The `tiny` tokenizer is a
byte-level CLIP BPE, written locally (so nothing is downloaded), whose only merges make the
configured `words` single tokens.
"""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from diffusers import AutoencoderKL, DDIMScheduler, DDPMScheduler, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizerFast

from kiln_config import Component, ModelConfig, TokenizerConfig
from kiln_config.errors import InputError
from models.data.tokenization import CaptionTokenizer

log = logging.getLogger("kiln.factory")

__all__ = [
    "Components",
    "build_components",
    "build_tokenizer",
    "caption_tokenizer",
    "build_unet",
    "sampling_scheduler",
    "vae_scale_factor",
]


@dataclass
class Components:
    unet: UNet2DConditionModel
    vae: AutoencoderKL
    text_encoder: CLIPTextModel
    tokenizer: CLIPTokenizerFast
    noise_scheduler: DDPMScheduler


def _bytes_to_unicode() -> dict[int, str]:
    # The GPT-2/CLIP reversible byte -> printable-unicode table.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def _suffix_merges(words: tuple[str, ...], chars: dict[int, str]) -> list[tuple[str, str]]:
    """BPE merges that make each of `words` one token: built from the word's end ("e d</w>",
    then "r ed</w>"). Every merged token ends a word, so in any word only its last two tokens
    can merge, and a listed word always ends as one token whatever the merges' order."""
    merges: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    for word in words:
        sym = [chars[b] for b in word.encode("utf-8")]
        suffix = sym[-1] + "</w>"
        for c in reversed(sym[:-1]):
            pair = (c, suffix)
            if pair not in seen:
                seen.add(pair)
                merges.append(pair)
            suffix = c + suffix
    return merges


@lru_cache(maxsize=8)
def _byte_vocab_dir(words: tuple[str, ...] = ()) -> str:
    """Write a byte-level CLIP vocab once per process and word list; returns its folder.

    Every byte is a token (and every byte ending a word); `words` (lower case, no spaces) are
    single tokens on top, with ids after the two special tokens, so that adding words keeps
    every byte's id."""
    table = _bytes_to_unicode()
    chars = list(table.values())
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": i + len(chars) for i, c in enumerate(chars)})
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    merges = _suffix_merges(words, table)
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    d = Path(tempfile.mkdtemp(prefix="kiln-tokenizer-"))
    (d / "vocab.json").write_text(json.dumps(vocab))
    lines = ["#version: 0.2", *(f"{a} {b}" for a, b in merges)]
    (d / "merges.txt").write_text("\n".join(lines) + "\n")
    return str(d)


def build_tokenizer(cfg: TokenizerConfig) -> CLIPTokenizerFast:
    """The CLIP tokenizer, always the Rust ("fast") one: the loader tokenizes whole batches
    with it, and the exported pipeline saves the same one, so training and inference agree.
    A hub tokenizer without `tokenizer.json` (SD2's) is converted from its vocab and merges."""
    if cfg.pretrained:
        return CLIPTokenizerFast.from_pretrained(cfg.pretrained, subfolder=cfg.subfolder or "")
    d = _byte_vocab_dir(tuple(cfg.words))
    return CLIPTokenizerFast(
        vocab_file=f"{d}/vocab.json",
        merges_file=f"{d}/merges.txt",
        model_max_length=cfg.model_max_length,
        pad_token="<|endoftext|>",
    )


def caption_tokenizer(cfg: TokenizerConfig) -> CaptionTokenizer:
    """The loader's caption tokenizer for `cfg`: the shard step stores the ids it makes."""
    return CaptionTokenizer(build_tokenizer(cfg))


def _load(cls, comp: Component, default_subfolder: str):
    if comp.pretrained:
        return cls.from_pretrained(comp.pretrained, subfolder=comp.subfolder or default_subfolder)
    if cls is CLIPTextModel:
        return CLIPTextModel(CLIPTextConfig(**comp.config))
    return cls.from_config(comp.config)


def vae_scale_factor(vae: AutoencoderKL) -> int:
    return 2 ** (len(vae.config.block_out_channels) - 1)


# The schedule settings that change what a UNet's output means, with diffusers' defaults.
_OBJECTIVE_KEYS = {"prediction_type": "epsilon", "rescale_betas_zero_snr": False}


def schedule_mismatch(init_from: str, cfg: ModelConfig) -> list[str]:
    """How the noise schedule saved with the pipeline at `init_from` differs from `cfg`'s in
    what the UNet predicts (prediction type, zero terminal SNR); [] when it does not, or when
    no scheduler config is saved there."""
    path = Path(init_from) / "scheduler" / "scheduler_config.json"
    if not path.is_file():
        return []
    saved = json.loads(path.read_text())
    return [
        f"{k}: {saved.get(k, d)!r} there, {cfg.noise_scheduler.get(k, d)!r} here"
        for k, d in _OBJECTIVE_KEYS.items()
        if saved.get(k, d) != cfg.noise_scheduler.get(k, d)
    ]


# The text-encoder settings that change what the UNet's cross-attention reads.
_ENCODER_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings")


def encoder_mismatch(init_from: str, cfg: ModelConfig) -> list[str]:
    """How the text encoder and tokenizer saved with the pipeline at `init_from` differ from
    the ones `cfg` builds from its dicts (the tiny preset's: a warm start from a model of an
    older preset); [] when they agree, when nothing is saved there, or when `cfg` loads a
    pretrained encoder (whose config is not read here)."""
    out = []
    saved_cfg = Path(init_from) / "text_encoder" / "config.json"
    if cfg.text_encoder.config is not None and saved_cfg.is_file():
        saved = json.loads(saved_cfg.read_text())
        here = CLIPTextConfig(**cfg.text_encoder.config).to_dict()
        out += [
            f"text_encoder.{k}: {saved.get(k)!r} there, {here.get(k)!r} here"
            for k in _ENCODER_KEYS
            if saved.get(k) != here.get(k)
        ]
    saved_tok = Path(init_from) / "tokenizer"
    if cfg.tokenizer.builtin is not None and saved_tok.is_dir():
        there = len(CLIPTokenizerFast.from_pretrained(saved_tok))
        here = len(build_tokenizer(cfg.tokenizer))
        if there != here:
            out.append(f"tokenizer: {there} tokens there, {here} here")
    return out


def build_unet(cfg: ModelConfig, init_from: str | None = None) -> UNet2DConditionModel:
    """A fresh UNet from its dict, or the previous stage's weights from `init_from`/unet.

    A UNet trained with another objective (a warm start from a model of an older preset) is
    loaded with a warning: training goes on with this config's objective and re-learns the
    output, as SD 2's 768-v model was fine-tuned from an epsilon one. So is one trained on
    another text encoder's states (an older tiny preset's, say): its text
    conditioning is learned again.
    """
    if init_from:
        for mismatch, what, consequence in (
            (
                schedule_mismatch,
                "with another objective",
                "train.model.noise_scheduler's, so its first steps re-learn the output",
            ),
            (
                encoder_mismatch,
                "on another text encoder",
                "train.model's, so its text conditioning is learned again",
            ),
        ):
            diffs = mismatch(init_from, cfg)
            if diffs:
                log.warning(
                    "the UNet at %s was trained %s (%s); training continues with %s",
                    init_from,
                    what,
                    "; ".join(diffs),
                    consequence,
                )
        return UNet2DConditionModel.from_pretrained(init_from, subfolder="unet")
    return UNet2DConditionModel.from_config(cfg.unet)


def build_components(
    cfg: ModelConfig, *, seed: int = 0, init_unet_from: str | None = None
) -> Components:
    """Build every component. Random initialisation is seeded, so every rank gets the same."""
    torch.manual_seed(seed)
    tokenizer = build_tokenizer(cfg.tokenizer)
    text_encoder = _load(CLIPTextModel, cfg.text_encoder, "text_encoder")
    if text_encoder.config.vocab_size < len(tokenizer):
        raise InputError(
            f"model.text_encoder vocab_size {text_encoder.config.vocab_size} is smaller than "
            f"the tokenizer's {len(tokenizer)} tokens"
        )
    if getattr(cfg.vae, "fit", None) is not None:
        # The train and shard flows resolve a `fit` to its fitted folder before any launch;
        # here (a unit test, a hand-written stage.yaml) only the architecture is known.
        log.warning(
            "train.model.vae.fit is not resolved: the VAE has random weights (run "
            "`kiln train`/`kiln shard`, which fit it, or set vae.pretrained to the "
            "fitted folder <root>/vae/<key>)"
        )
    vae = _load(AutoencoderKL, cfg.vae, "vae")
    unet = build_unet(cfg, init_unet_from)
    if unet.config.cross_attention_dim != text_encoder.config.hidden_size:
        raise InputError(
            f"model.unet.cross_attention_dim ({unet.config.cross_attention_dim}) must equal the "
            f"text encoder's hidden size ({text_encoder.config.hidden_size})"
        )
    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    return Components(
        unet, vae, text_encoder, tokenizer, DDPMScheduler.from_config(cfg.noise_scheduler)
    )


def sampling_scheduler(noise_scheduler: DDPMScheduler) -> DDIMScheduler:
    """The exported pipeline samples with DDIM over the training noise schedule."""
    return DDIMScheduler.from_config(noise_scheduler.config)
