"""The evaluation sections: `evaluate` (the study and its metrics), `human_eval` (the blind
A/B rating app) and the promotion gate (`registry.gate`).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import (
    Field,
    field_validator,
)

from kiln_config.base import EnvPath, SecretUri, Strict

__all__ = [
    "GUIDANCE_SCALE",
    "INFERENCE_STEPS",
    "EvalMetricsConfig",
    "EvaluateConfig",
    "GateConfig",
    "HumanEvalConfig",
]

INFERENCE_STEPS = 25
"""Denoising steps of a generated image: the study's (`evaluate.num_inference_steps`) and the
sample grid's (`train.sample_steps`) default."""
GUIDANCE_SCALE = 7.5
"""Classifier-free guidance of a generated image: `evaluate.guidance_scale` and
`train.sample_guidance_scale` by default."""


class EvalMetricsConfig(Strict):
    """Automated image metrics of `kiln evaluate`; each is skipped (and says so) when its
    weights are not configured or not found."""

    clip_model: EnvPath | None = Field(
        None,
        description="CLIP model for CLIP score: a local folder or a hub id (transformers); "
        "default quality.clip_model, the CLIP that curated the data.",
    )
    inception_weights: EnvPath | None = Field(
        None, description="Local path of the FID Inception weights (torch-fidelity's .pth)."
    )
    fid_max_images: int = Field(
        2000, gt=0, description="Validation images (and as many generated) for FID."
    )


class EvaluateConfig(Strict):
    prompts_csv: EnvPath | None = Field(
        None,
        description="CSV with columns Prompts,Category. Unset: KILN_DRAWBENCH_CSV, else the 200 "
        "DrawBench prompts fetched once from the Hugging Face Hub (tasks/evaluation/prompts.py).",
    )
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    num_inference_steps: int = Field(INFERENCE_STEPS, gt=0)
    guidance_scale: float = Field(GUIDANCE_SCALE, ge=0)
    batch_size: int = Field(8, gt=0)
    limit: int | None = Field(None, gt=0, description="Use only the first N prompts.")
    metrics: EvalMetricsConfig = Field(default_factory=EvalMetricsConfig)


class GateConfig(Strict):
    """What `kiln promote` needs before `champion` moves to a candidate
    (tasks/registry/promotion.py)."""

    min_votes_per_pair: int = Field(
        3, ge=1, description="Fewest human votes every compared pair must have, per question."
    )
    min_pref_ci_low: float = Field(
        0.5, ge=0, le=1, description="Lower 95% CI bound of the candidate's preference rate."
    )
    min_category_pref: float = Field(
        0.4, ge=0, le=1, description="No prompt category's preference may be below this."
    )
    max_val_loss_increase: float = Field(
        0.02, ge=0, description="Validation loss may exceed the champion's by this fraction."
    )


class HumanEvalConfig(Strict):
    """The blind A/B rating app and its report (`kiln compare`, `kiln rate ...`)."""

    database_url: SecretUri | None = Field(
        None,
        description="SQLAlchemy URL of the ratings store (e.g. postgresql://... for a shared "
        "server). Default: sqlite:///<root>/human_eval/ratings.db (WAL).",
    )
    host: str = Field("127.0.0.1", description="Address `kiln rate serve` listens on.")
    port: int = Field(8765, gt=0, lt=65536, description="Port of `kiln rate serve`.")
    public_url: str | None = Field(
        None,
        description="Where raters reach the app, for the links `kiln rate invite` and "
        "`kiln rate admin-link` print: https://rate.example.com behind a TLS proxy. Default: "
        "http://HOST:PORT.",
    )
    bad_links_per_minute: int = Field(
        60,
        ge=1,
        description="Unknown or revoked links one address may send a minute; past it, the app "
        "answers 429 to that address until the minute is over.",
    )
    raters_per_pair: int = Field(5, ge=1, description="Votes collected per pair (K).")
    gold_per_rater: int = Field(10, ge=0, description="Attention checks shown to each rater.")
    min_gold_accuracy: float = Field(
        0.8, ge=0, le=1, description="Raters below this gold accuracy are left out of results."
    )
    bootstrap_resamples: int = Field(2000, ge=100, description="Prompt-level bootstrap draws.")
    seed: int = Field(0, description="Seed of the bootstrap and of the gold pairs' choice.")

    @field_validator("public_url")
    @classmethod
    def _public_url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("expected http(s)://host[:port][/path]")
        if parts.query or parts.fragment or parts.username or parts.password:
            raise ValueError("a link base has no query, fragment or login")
        return v.rstrip("/")
