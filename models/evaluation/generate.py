"""Images from an exported pipeline, as evaluation draws them: the prompts file, the pipeline
loaded as `kiln evaluate` loads it, and one seeded generator per (prompt, seed) pair.

The study script (`models.study_images`) and the training loop's sample grids
(`models.evaluation.sample_grid`) draw through these, so a grid shows what a study of the same
prompts and seeds shows; `kiln generate` draws with `generate_images` from the pipeline the
served model loads (`kiln_pyfunc.load_pipeline`).
"""

from __future__ import annotations

import csv
from pathlib import Path

import torch
from diffusers import StableDiffusionPipeline

from kiln_config.errors import InputError, MissingInput
from models.data.tokenization import truncate_prompts

__all__ = ["generate_images", "load_pipeline", "read_prompts"]


def read_prompts(path: str | Path, limit: int | None = None) -> list[dict]:
    """Rows of a prompts CSV (columns `Prompts`, `Category`, as DrawBench's) as
    {prompt, category}."""
    path = Path(path)
    if not path.is_file():
        raise MissingInput(f"evaluate.prompts_csv not found: {path}")
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        cols = reader.fieldnames or []
        if "Prompts" not in cols:
            raise InputError(
                f"{path} must have a 'Prompts' column (and optionally 'Category'); got {cols}"
            )
        rows = [
            {"prompt": r["Prompts"].strip(), "category": (r.get("Category") or "").strip()}
            for r in reader
            if (r.get("Prompts") or "").strip()
        ]
    if not rows:
        raise InputError(f"{path} holds no prompts")
    return rows[:limit] if limit else rows


def load_pipeline(path: str | Path, device: torch.device | str) -> StableDiffusionPipeline:
    """Load an exported pipeline folder as evaluation does; the training script's sample grids
    load their export with this too, so an export bug shows in the grid first."""
    pipe = StableDiffusionPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def generate_images(
    pipe: StableDiffusionPipeline,
    prompts: list[str],
    seeds: list[int],
    steps: int,
    guidance: float,
) -> list:
    """One PIL image per (prompt, seed) pair, `prompts[i]` with `seeds[i]`.

    Each pair gets its own CPU generator, so an image depends on its prompt and seed only,
    never on the batch around it or the device; the global RNG is not drawn from.
    """
    gens = [torch.Generator(device="cpu").manual_seed(seed) for seed in seeds]
    # What the text encoder reads of each prompt (truncated to its window, with a warning).
    fed = truncate_prompts(pipe.tokenizer, prompts)
    return pipe(fed, num_inference_steps=steps, guidance_scale=guidance, generator=gens).images
