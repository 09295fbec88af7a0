"""Tiny studies on disk, in the layout `kiln evaluate` writes (models/generate.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

PROMPTS = [
    ("A red circle above a blue square.", "Positional"),
    ("Two red circles.", "Counting"),
    ("A yellow colored circle.", "Colors"),
    ("A sign that says 'Kiln'.", "Text"),
]


def write_study(
    root: Path,
    study_id: str,
    prompts=PROMPTS,
    seeds=(0,),
    size: int = 32,
    colour=(200, 40, 40),
    model: str = "run-a",
) -> Path:
    """A study folder with one PNG per (prompt, seed) and its study.json."""
    folder = root / "eval" / study_id
    (folder / "images").mkdir(parents=True, exist_ok=True)
    items = []
    for i, (prompt, category) in enumerate(prompts):
        for seed in seeds:
            rel = f"images/{i:04d}-s{seed}.png"
            shade = tuple((c + 13 * i + seed) % 256 for c in colour)
            Image.new("RGB", (size, size), shade).save(folder / rel)
            items.append({"index": i, "prompt": prompt, "category": category, "seed": seed,
                          "path": rel})  # fmt: skip
    study = {
        "study_id": study_id,
        "model": {"pipeline": f"/models/{model}/final", "ref": model},
        "prompts_csv": "prompts.csv",
        "settings": {
            "seeds": list(seeds),
            "num_inference_steps": 2,
            "guidance_scale": 7.5,
            "resolution": size,
        },  # fmt: skip
        "items": items,
    }
    (folder / "study.json").write_text(json.dumps(study))
    return folder


def many_prompts(n: int) -> list[tuple[str, str]]:
    cats = ["Colors", "Counting", "Positional", "Text", "Rare Words"]
    return [(f"prompt number {i} with {cats[i % 5].lower()}", cats[i % 5]) for i in range(n)]


@pytest.fixture
def two_studies(tmp_path) -> tuple[Path, Path, Path]:
    """(root, study A folder, study B folder): 4 prompts x 2 seeds each."""
    root = tmp_path / "root"
    a = write_study(root, "run-a-1111", seeds=(0, 1), model="run-a")
    b = write_study(root, "run-b-2222", seeds=(0, 1), colour=(40, 40, 200), model="run-b")
    return root, a, b
