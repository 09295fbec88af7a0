"""The data sections: `ingest`, `quality` (the rules a catalog is held to) and `shards`.

Quality defaults follow common practice for from-scratch text-to-image sets: MosaicML's SD2
run kept LAION images with an aesthetic score of at least 4.5; a caption that is mostly
non-ASCII is dropped for English-only training (set `min_ascii_ratio: null` for
multilingual sets).
"""

from __future__ import annotations

from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from kiln_config.base import EnvPath, Strict

# The columns ingest writes for every row: `ingest.metadata_columns` may not reuse them.
CATALOG_COLUMNS = [
    "key",
    "source",
    "object",
    "offset",
    "length",
    "sha256",
    "phash",
    "width",
    "height",
    "format",
    "mode",
    "bytes",
    "conversion",
    "caption",
    "unit",
    "unit_version",
    "ingest_id",
    "ingest_seq",
]

__all__ = ["CATALOG_COLUMNS", "SOURCE_FORMATS", "IngestConfig", "QualityConfig", "ShardsConfig"]

SOURCE_FORMATS = ("imagefolder", "img2dataset", "webdataset")
"""The formats of a source's files that ingest reads (tasks/ingest/sources.py)."""


class IngestConfig(Strict):
    source: EnvPath | None = Field(None, description="Local folder or s3://bucket/prefix.")
    layout: Literal[("auto", *SOURCE_FORMATS)] = Field(
        "auto", description="Format of the source's files; auto detects it from the listing."
    )
    metadata_file: EnvPath | None = Field(
        None, description="imagefolder manifest; default metadata.jsonl, .csv or .parquet."
    )
    caption_column: str = "text"
    metadata_columns: list[str] = Field(
        default_factory=list,
        description="Pass-through columns kept in the catalog (license, contributor, ...).",
    )
    image_extensions: list[str] = Field(
        default_factory=lambda: [".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"]
    )
    workers: int = Field(0, ge=0, description="Decode processes; 0 means one per CPU core.")
    max_pixels: int = Field(
        89_478_485, gt=0, description="Images over this pixel count are quarantined unread."
    )
    max_bytes: int = Field(
        256 * 2**20,
        gt=0,
        description="An image file, sidecar or tar member over this many bytes is quarantined "
        "unread (reason too_large), so one object (a zero-filled gzip member) cannot run a "
        "decode worker out of memory. Default 256 MiB.",
    )
    partition_size: int = Field(1000, gt=0, description="Items per decode task.")
    compact_every: int = Field(
        10,
        ge=0,
        description="Compact and vacuum the catalog's tables (as `kiln catalog compact` does) "
        "after every ingest whose ingest_seq is a multiple of this; 0: never.",
    )
    compact_retain_hours: float = Field(
        168,
        ge=0,
        description="Vacuum keeps every table version younger than this (and every version a "
        "registered model's dataset was cut from); the default of `kiln catalog compact "
        "--retain-hours`.",
    )


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
    # Content rules (data_quality/content/): scores stored once per image content hash and
    # per caption, so a changed threshold re-decides without recomputing.
    max_unsafe: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Quarantine images whose unsafe probability (NudeNet's packaged detector: "
        "the highest score of an exposed-body class) is above this; null: off.",
    )
    allowed_languages: list[str] | None = Field(
        None,
        description="ISO 639-1 codes a caption's language (Lingua's packaged models) must be "
        "one of; a caption whose language is not clear (quality.min_language_confidence) "
        "passes. Replaces min_ascii_ratio when set. Null: off.",
    )
    min_language_confidence: float = Field(
        0.25,
        ge=0,
        le=1,
        description="Below this confidence in its top language (Lingua's share among about 30 "
        "candidates) a caption's language is 'und' (undetermined) and passes the language "
        "rule: short captions are often ambiguous ('a cat': Romanian at 0.18).",
    )
    min_language_words: int = Field(
        3,
        ge=1,
        description="A caption of fewer words passes the language rule whatever its top "
        "language: a short caption is mostly names, and a name reads as its own language "
        "('finland flag': Swedish).",
    )
    max_allowed_language_confidence: float = Field(
        0.04,
        ge=0,
        le=1,
        description="A caption fails the language rule only when no allowed language has more "
        "confidence than this (Lingua spreads about 0.033 over each of its ~30 candidates when "
        "a caption says nothing either way): evidence against every allowed language, not "
        "another language's first guess.",
    )
    min_language_ratio: float = Field(
        6.0,
        gt=0,
        description="Or, in a caption of 5 words or more, its top language is at least this many "
        "times as likely as the best allowed one.",
    )
    clip_model: EnvPath | None = Field(
        None,
        description="Local folder of a CLIP model (transformers save_pretrained: config, "
        "weights, processor files) whose embeddings the clip_score, aesthetic and "
        "semantic-duplicate rules read; computed by an accelerate launch (launch.*).",
    )
    min_clip_score: float | None = Field(
        None,
        ge=-1,
        le=1,
        description="Image-caption cosine similarity below which a row is quarantined "
        "(DataComp and LAION-2B: 0.28 with ViT-B/32); needs clip_model.",
    )
    aesthetic_head: EnvPath | None = Field(
        None,
        description="Local file (.safetensors or .pt) of a LAION-style linear aesthetic head "
        "(weight [1, D], bias [1]) on clip_model's normalised image embedding; fills the "
        "aesthetic column where the source has none, for min_aesthetic.",
    )
    semantic_duplicate_similarity: float | None = Field(
        None,
        gt=0,
        le=1,
        description="SemDeDup: an image whose CLIP embedding has at least this cosine "
        "similarity with an earlier image's of its k-means cluster is quarantined "
        "(semantic_duplicate); the earliest ingested is kept. Needs clip_model.",
    )
    semantic_clusters: int | None = Field(
        None,
        gt=0,
        description="k-means clusters of SemDeDup; null: about sqrt(rows / 4), at least 1.",
    )
    embed_batch_size: int = Field(64, gt=0, description="Images per forward pass of the embedder.")

    @field_validator("allowed_languages")
    @classmethod
    def _iso_codes(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return v
        bad = [c for c in v if not (isinstance(c, str) and len(c) == 2 and c.isalpha())]
        if bad or not v:
            raise ValueError(f"expected ISO 639-1 codes such as ['en', 'de'] (received {v!r})")
        return [c.lower() for c in v]

    @property
    def needs_clip(self) -> bool:
        """Whether a rule reads CLIP embeddings."""
        return (
            self.min_clip_score is not None
            or self.semantic_duplicate_similarity is not None
            or (self.aesthetic_head is not None and self.min_aesthetic is not None)
        )

    @model_validator(mode="after")
    def _bounds(self) -> QualityConfig:
        if self.needs_clip and self.clip_model is None:
            raise ValueError(
                "quality.min_clip_score, semantic_duplicate_similarity and aesthetic_head read "
                "CLIP embeddings: set quality.clip_model to a local CLIP folder"
            )
        if self.max_caption_chars < self.min_caption_chars:
            raise ValueError(
                f"max_caption_chars ({self.max_caption_chars}) is below min_caption_chars "
                f"({self.min_caption_chars})"
            )
        return self


class ShardsConfig(Strict):
    min_side_factor: float = Field(
        1.0, gt=0, description="A stage takes images whose short side >= resolution * factor."
    )
    jpeg_quality: int = Field(90, ge=1, le=100, description="JPEG or WebP quality.")
    image_format: Literal["jpeg", "webp", "png"] = Field("jpeg", description="Stored encoding.")
    partition_size: int = Field(2000, gt=0, description="Images per conversion task.")
    size_limit: int = Field(1 << 26, gt=0, description="Bytes per MDS shard before a new one.")
    workers: int = Field(0, ge=0, description="Resize processes; 0 means one per CPU core.")
    token_ids: bool = Field(
        True,
        description="Store each caption's token ids (the model's tokenizer) in the image shards, "
        "so the loader does not tokenize; the tokenizer becomes part of the dataset version.",
    )
    precompute: bool = Field(
        False, description="Also write VAE latents and text states per stage (models.precompute)."
    )
    precompute_text: bool = Field(
        True, description="With precompute: store text-encoder states (else token ids only)."
    )
    aspect_buckets: bool = Field(
        False,
        description="SDXL-style aspect-ratio buckets instead of centre crops for bucket_stages; "
        "each bucket is its own stream, and every batch comes from one bucket.",
    )
    bucket_stages: list[int] | None = Field(
        None, description="Stage resolutions that use buckets; default the largest stage."
    )
    bucket_step: int = Field(
        64, gt=0, description="Bucket sides are multiples of this (64 for SD2: VAE x UNet)."
    )
    bucket_max_aspect: float = Field(2.0, ge=1.0, description="Widest aspect ratio either way.")
    remote: EnvPath | None = Field(
        None,
        description="s3://bucket/prefix (or a shared folder) to publish dataset versions to; "
        "training then streams them from there through cache_dir.",
    )
    cache_dir: EnvPath | None = Field(
        None,
        description="Local cache of streamed shards on each training machine (fast local "
        "disk); default <root>/cache.",
    )
    val_fraction: float = Field(
        0.01,
        ge=0,
        lt=1,
        description="Share of images held out as each stage's validation split, chosen by a "
        "hash of the image key; 0: no split.",
    )
    val_max: int = Field(2000, ge=0, description="Cap on the validation split's images.")

    @field_validator("remote")
    @classmethod
    def _remote(cls, v: str | None) -> str | None:
        if v is not None and "://" in v and not v.startswith("s3://"):
            raise ValueError(f"must be s3://bucket/prefix or a folder (received {v!r})")
        if v is not None and v.startswith("s3://") and not v[5:].split("/")[0]:
            raise ValueError(f"names no bucket (received {v!r})")
        return v.rstrip("/") if v else v
