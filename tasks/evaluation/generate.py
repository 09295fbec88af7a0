"""`kiln generate`: PNG files from any registered version, alias or exported pipeline.

A consumer's command, not a pipeline step, so no Prefect flow run: it resolves the model
(`models:/NAME@ALIAS`, `models:/NAME/VERSION` or an export folder), loads it the way the served
model does (`kiln_pyfunc.load_pipeline`: bf16 on CUDA, float32 on CPU) and writes
`<out>/<NN>-s<seed>.png`, one image per seed, seeds `seed .. seed+n-1`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from kiln_config.errors import InputError
from kiln_pyfunc import load_pipeline
from models.evaluation.generate import generate_images as generate
from tasks.registry.tracking import resolve_pipeline

__all__ = ["generate_pngs"]


def generate_pngs(
    model: str,
    tracking_uri: str,
    root: Path,
    prompt: str,
    out: Path,
    *,
    n: int,
    seed: int,
    steps: int,
    guidance_scale: float,
    batch_size: int = 4,
) -> dict:
    """Generate `n` images of `prompt` (seeds `seed .. seed+n-1`) into `out` with `model` (a
    models:/ URI of the registry at `tracking_uri`, or an export folder; `root` holds the
    downloads, `tasks.registry.tracking.resolve_pipeline`).

    Returns:
        {"images": [paths], "seconds_per_image", "device", "model"}; also written as
        `<out>/generate.json`.
    """
    if n < 1 or steps < 1 or batch_size < 1:
        raise InputError(
            f"--n, --steps and --batch-size must be at least 1 (got {n}, {steps}, {batch_size})"
        )
    _, pipeline_dir = resolve_pipeline(model, tracking_uri, root)
    pipe = load_pipeline(str(pipeline_dir))
    out.mkdir(parents=True, exist_ok=True)
    seeds = list(range(seed, seed + n))
    paths: list[str] = []
    t0 = time.perf_counter()
    for start in range(0, n, batch_size):
        chunk = seeds[start : start + batch_size]
        images = generate(pipe, [prompt] * len(chunk), chunk, steps, guidance_scale)
        for s, img in zip(chunk, images, strict=True):
            path = out / f"{len(paths):02d}-s{s}.png"
            img.save(path, format="PNG")
            paths.append(str(path))
    result = {
        "model": str(pipeline_dir),
        "prompt": prompt,
        "images": paths,
        "steps": steps,
        "guidance_scale": guidance_scale,
        "device": str(pipe.device),
        "seconds_per_image": round((time.perf_counter() - t0) / n, 4),
    }
    (out / "generate.json").write_text(json.dumps(result, indent=2))
    return result
