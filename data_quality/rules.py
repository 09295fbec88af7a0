"""The quality rules a catalog is held to: one typed config, read by the suite and the gate.

Defaults follow common practice for from-scratch text-to-image sets: MosaicML's SD2 run kept
LAION images with an aesthetic score of at least 4.5; a caption that is mostly non-ASCII is
dropped for English-only training (set `min_ascii_ratio: null` for multilingual sets).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["QualityConfig"]


class QualityConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min_side: int = Field(32, gt=0, description="Short side below this is rejected.")
    max_aspect_ratio: float = Field(
        4.0, ge=1, description="Long side / short side above this is rejected."
    )
    min_caption_chars: int = Field(1, ge=1, description="Shorter captions are rejected.")
    max_caption_chars: int = Field(1000, gt=0, description="Longer captions are rejected.")
    min_ascii_ratio: float | None = Field(
        0.8, ge=0, le=1, description="Share of ASCII characters a caption needs; null: off."
    )
    allowed_licenses: list[str] | None = Field(
        None, description="When set, the license column must hold one of these values."
    )
    license_column: str = "license"
    license_end_column: str = Field(
        "license_end",
        description="ISO date after which a row's license has ended; rows past it at "
        "validation time are quarantined (`license_expired`). Skipped without the column.",
    )
    contributor_column: str = Field(
        "contributor",
        description="Who licensed the image: what `kiln takedown add "
        "--contributor` matches and the revenue-share report groups by.",
    )
    min_aesthetic: float | None = Field(
        None, description="When set and the column exists, lower scores are rejected."
    )
    aesthetic_column: str = "aesthetic"
    near_duplicate_distance: int = Field(
        4, ge=0, le=32, description="pHash Hamming distance at or below which two images match."
    )
    drop_near_duplicates: bool = Field(
        False, description="Quarantine near-duplicates (else they are only flagged)."
    )
    max_reject_fraction: float = Field(0.2, ge=0, le=1)

    @model_validator(mode="after")
    def _bounds(self) -> QualityConfig:
        if self.max_caption_chars < self.min_caption_chars:
            raise ValueError(
                f"max_caption_chars ({self.max_caption_chars}) is below min_caption_chars "
                f"({self.min_caption_chars})"
            )
        return self
