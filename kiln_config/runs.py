"""The run files of the launched processes other than training: one resolved file each.

A launched module reads one YAML file given by `--config FILE` and nothing else, as
`models.train` reads its stage file (`kiln_config.StageRun`): the launch task writes it
(`write_run_file`), the module loads it with `load_yaml_model`. Settings the pipeline config
declares (the evaluation seeds, the precompute's text mode) come in as that config's values,
so each default stays declared once, in its section.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import Field, model_validator

from kiln_config.base import Strict, write_private
from kiln_config.evaluate import EvaluateConfig
from kiln_config.train import StageConfig, TrainConfig

__all__ = ["EmbedRun", "HealthCheckRun", "PrecomputeRun", "StudyRun", "write_run_file"]


class EmbedRun(Strict):
    """Everything one `accelerate launch -m models.embed_content` needs."""

    clip_model: str = Field(description="Local CLIP folder (quality.clip_model).")
    images: str = Field(
        description="Parquet of the images to embed: key (sha256) and image (JPEG bytes at the "
        "CLIP's input side), one row group per batch."
    )
    captions: str = Field(description="Parquet of the captions to embed: key (sha256), caption.")
    out_dir: str = Field(description="Folder of the embedding parts, one per batch.")
    batch_size: int = Field(64, ge=1, description="Captions per forward pass.")


class PrecomputeRun(Strict):
    """Everything one `accelerate launch -m models.precompute` needs."""

    train: TrainConfig = Field(description="The frozen encoders and the seed they are built with.")
    stage_index: int = Field(ge=0, description="The stage whose resolution the images decode at.")
    shards: str = Field(description="Local folder of the stage's MDS image dataset.")
    out_dir: str = Field(description="Output folder of the latents dataset.")
    val_shards: str | None = Field(
        None, description="Local folder of the stage's held-out split, encoded in the same launch."
    )
    val_out_dir: str | None = Field(None, description="Output folder of the split's latents.")
    text: bool = Field(description="Store text-encoder states (`shards.precompute_text`), not ids.")
    batch_size: int = Field(32, ge=1, description="Samples encoded per forward pass.")

    @property
    def stage(self) -> StageConfig:
        return self.train.stages[self.stage_index]

    @model_validator(mode="after")
    def _split_and_its_output(self) -> PrecomputeRun:
        if (self.val_shards is None) != (self.val_out_dir is None):
            raise ValueError(
                f"val_out_dir: set it with val_shards, or neither (received "
                f"val_shards={self.val_shards!r}, "
                f"val_out_dir={self.val_out_dir!r})"
            )
        if self.stage_index >= len(self.train.stages):
            raise ValueError(
                f"stage_index {self.stage_index} out of range for {len(self.train.stages)} stages"
            )
        return self


class StudyRun(Strict):
    """Everything one `accelerate launch -m models.study_images` needs."""

    pipeline: str = Field(description="Exported StableDiffusionPipeline folder.")
    out_dir: str = Field(description="Study folder: images/ and study.json.")
    evaluate: EvaluateConfig = Field(
        description="Seeds, inference steps, guidance, batch size and prompt limit; "
        "`prompts_csv` is the resolved prompts file."
    )
    model_ref: str = Field("", description="The model's identity, recorded in study.json.")

    @model_validator(mode="after")
    def _prompts_resolved(self) -> StudyRun:
        if not self.evaluate.prompts_csv:
            raise ValueError(
                "evaluate.prompts_csv: a study run needs the resolved prompts file (received None)"
            )
        return self


class HealthCheckRun(Strict):
    """Everything one `accelerate launch -m models.collective_check` needs."""

    out_dir: str = Field(description="Folder for health.json.")


def write_run_file(run: Strict, path: Path) -> Path:
    """Write a launched process's run file (a `StageRun`, `PrecomputeRun`, ...) atomically,
    readable by its owner alone; the module loads it back with `load_yaml_model` to the same
    values."""
    # Owner-only, as the run's config snapshot: a run file names the tracking store, whose
    # URI can hold a database password.
    return write_private(path, yaml.safe_dump(run.model_dump(mode="json"), sort_keys=False))
