"""The `train.model` section: UNet, VAE (built, loaded or fitted), text encoder, tokenizer."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_serializer,
    model_validator,
)

from kiln_config.base import EnvPath, Strict

__all__ = ["Component", "ModelConfig", "TokenizerConfig", "VaeComponent", "VaeFitConfig"]


class Component(Strict):
    """A model component: built from a config dict, or loaded from a local path or hub id."""

    config: dict[str, Any] | None = None
    pretrained: EnvPath | None = None
    subfolder: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> Component:
        if (self.config is None) == (self.pretrained is None):
            raise ValueError("set exactly one of 'config' (build from a dict) or 'pretrained'")
        return self


class VaeFitConfig(Strict):
    """Train the VAE built from `config` once on the dataset's own images, before anything
    encodes with it (the `tiny` preset: a randomly initialised VAE gives noise-like latents,
    and a diffusion model trained on them samples noise). See `models/components/vae_fit.py`."""

    steps: int = Field(
        800, gt=0, description="Optimizer steps (AdamW); 400 lost colours (docs/architecture.md)."
    )
    batch_size: int = Field(16, gt=0, description="Random crops per step.")
    resolution: int = Field(32, gt=0, description="Side of the square training crops.")
    learning_rate: float = Field(3.0e-3, gt=0)
    kl_weight: float = Field(
        1.0e-4, ge=0, description="Weight of the KL term (per pixel value, like the MSE term)."
    )
    seed: int = Field(0, description="Seeds the initial weights, the crops and the sampling.")


class VaeComponent(Component):
    """The VAE: a :class:`Component`, optionally fitted once on the data (`fit`).

    The train and shard flows resolve a `fit` to `pretrained: <root>/vae/<key>` (the fitted
    weights, cached) before any process encodes, so every consumer loads the same weights.
    """

    fit: VaeFitConfig | None = None

    @model_validator(mode="after")
    def _fit_needs_config(self) -> VaeComponent:
        if self.fit is not None and self.config is None:
            raise ValueError(
                "'fit' trains a VAE built from 'config'; a 'pretrained' VAE is "
                "used as it is (remove 'fit' or use 'config')"
            )
        return self


class TokenizerConfig(Strict):
    """`builtin: bytes` builds a byte-level CLIP tokenizer offline; else load `pretrained`.

    `words` (builtin only): words that become single tokens on top of the bytes, as a real BPE
    vocabulary has its common words (the tiny preset lists the demo captions' words). The merges are
    built from each word's end (`models.components.factory`), so a listed word is one token wherever
    it stands alone, and also where it ends a longer word ("bored" is "b", "o", "red"), as in any
    BPE vocabulary with only an end-of-word marker; elsewhere bytes stay bytes."""

    builtin: Literal["bytes"] | None = None
    pretrained: EnvPath | None = None
    subfolder: str | None = None
    model_max_length: int = Field(77, gt=1)
    words: list[str] = Field(default_factory=list)

    @field_validator("words", mode="before")
    @classmethod
    def _no_yaml_booleans(cls, v: Any) -> Any:
        if isinstance(v, list) and any(isinstance(w, bool) for w in v):
            raise ValueError('YAML reads a bare on, off, yes or no as true/false: quote it ("on")')
        return v

    @model_validator(mode="after")
    def _one_source(self) -> TokenizerConfig:
        if (self.builtin is None) == (self.pretrained is None):
            raise ValueError("set exactly one of 'builtin' or 'pretrained'")
        if self.words and self.pretrained is not None:
            raise ValueError("'words' extends the builtin tokenizer; a pretrained one has its own")
        bad = [w for w in self.words if not re.fullmatch(r"[a-z]{2,}", w)]
        if bad:
            raise ValueError(f"tokenizer words must be lower-case letters, 2 or more: {bad}")
        return self

    @model_serializer(mode="wrap")
    def _without_empty_words(self, handler) -> dict[str, Any]:
        """No `words` key when there are none: the dump is hashed into dataset versions and
        encoder keys, which must not change for configs written before `words` existed."""
        data = handler(self)
        if not self.words:
            data.pop("words", None)
        return data


class ModelConfig(Strict):
    unet: dict[str, Any]
    vae: VaeComponent
    text_encoder: Component
    tokenizer: TokenizerConfig
    noise_scheduler: dict[str, Any] = Field(
        default_factory=lambda: {
            "num_train_timesteps": 1000,
            "beta_schedule": "scaled_linear",
            "beta_start": 0.00085,
            "beta_end": 0.012,
            "prediction_type": "epsilon",
            "clip_sample": False,
            "set_alpha_to_one": False,
            "steps_offset": 1,
        }
    )

    @model_validator(mode="after")
    def _zero_snr_needs_v_prediction(self) -> ModelConfig:
        s = self.noise_scheduler
        v_pred = s.get("prediction_type", "epsilon") == "v_prediction"
        if s.get("rescale_betas_zero_snr") and not v_pred:
            raise ValueError(
                "train.model.noise_scheduler: rescale_betas_zero_snr needs prediction_type "
                "v_prediction (at zero SNR the noise is the input, so an epsilon target "
                "teaches nothing and min-SNR weights divide by zero; Lin et al. 2024); "
                f"received prediction_type {s.get('prediction_type', 'epsilon')!r}"
            )
        return self
