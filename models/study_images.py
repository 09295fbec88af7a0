"""Generate evaluation images for a prompt set (`evaluate.prompts_csv`), split across
processes:

    accelerate launch -m models.study_images --pipeline FINAL --prompts prompts.csv --out STUDY

Each (prompt, seed) pair gets its own generator, so an image depends only on its prompt and
seed, never on batching or process count. Existing images are kept, so a relaunch after a
crash only generates what is missing. The main process writes `study.json` last.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import time
from pathlib import Path

import torch
from accelerate import PartialState
from diffusers import StableDiffusionPipeline

from kiln_config import EvaluateConfig
from kiln_config.errors import InputError, MissingInput
from models.tokenization import truncate_prompts

__all__ = ["generate_images", "load_pipeline", "main", "read_prompts"]

log = logging.getLogger("kiln.generate")


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


def main(argv: list[str] | None = None) -> None:
    """Generate every (prompt, seed) image still missing from `--out`, then `study.json`."""
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    state = PartialState(cpu=not torch.cuda.is_available())
    out = Path(args.out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    prompts = read_prompts(args.prompts, args.limit)
    items = [
        {"index": i, **row, "seed": seed, "path": f"images/{i:04d}-s{seed}.png"}
        for i, row in enumerate(prompts)
        for seed in args.seeds
    ]
    pipe = load_pipeline(args.pipeline, state.device)
    t0 = time.perf_counter()
    with state.split_between_processes(items) as mine:
        todo = [it for it in mine if not (out / it["path"]).is_file()]
        _generate_into(pipe, todo, out, args)
        log.info("rank %d generated %d images", state.process_index, len(todo))
    state.wait_for_everyone()
    if state.is_main_process:
        _write_study(out, args, pipe, items, round(time.perf_counter() - t0, 2))
    state.wait_for_everyone()
    state.destroy_process_group()  # or a rank can abort at exit with the group still up


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ev = EvaluateConfig()  # the `evaluate` section's defaults
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pipeline", required=True, help="Exported StableDiffusionPipeline folder")
    p.add_argument("--prompts", required=True, help="CSV with Prompts,Category columns")
    p.add_argument("--out", required=True, help="Study folder: images/ and study.json")
    p.add_argument("--seeds", type=int, nargs="+", default=ev.seeds, help="evaluate.seeds")
    p.add_argument("--steps", type=int, default=ev.num_inference_steps,
                   help="evaluate.num_inference_steps")  # fmt: skip
    p.add_argument("--guidance", type=float, default=ev.guidance_scale,
                   help="evaluate.guidance_scale")  # fmt: skip
    p.add_argument("--batch-size", type=int, default=ev.batch_size, help="evaluate.batch_size")
    p.add_argument("--limit", type=int, default=None, help="Only the first N prompts")
    p.add_argument("--model-ref", default="", help="Recorded in study.json (e.g. run id)")
    return p.parse_args(argv)


def _generate_into(pipe: StableDiffusionPipeline, todo: list[dict], out: Path, args) -> None:
    """Generate `todo`'s images in batches, each PNG renamed into place when complete."""
    for start in range(0, len(todo), args.batch_size):
        batch = todo[start : start + args.batch_size]
        images = generate_images(
            pipe,
            [it["prompt"] for it in batch],  # study.json keeps the prompts as written
            [it["seed"] for it in batch],
            args.steps,
            args.guidance,
        )
        for it, img in zip(batch, images, strict=True):
            tmp = out / (it["path"] + ".tmp")
            img.save(tmp, format="PNG")
            tmp.replace(out / it["path"])


def _write_study(out: Path, args, pipe, items: list[dict], generated_s: float) -> None:
    """Write `study.json` last, once every image is on disk.

    Raises:
        RuntimeError: when an image is missing.
    """
    missing = [it["path"] for it in items if not (out / it["path"]).is_file()]
    if missing:
        raise RuntimeError(f"{len(missing)} images missing after generation, e.g. {missing[:3]}")
    study = {
        "study_id": out.name,
        "model": {"pipeline": str(Path(args.pipeline).resolve()), "ref": args.model_ref},
        "prompts_csv": str(Path(args.prompts).resolve()),
        "settings": {
            "seeds": args.seeds,
            "num_inference_steps": args.steps,
            "guidance_scale": args.guidance,
            "resolution": pipe.unet.config.sample_size * pipe.vae_scale_factor,
        },
        "generated_s": generated_s,
        "items": items,
    }
    tmp = out / "study.json.tmp"
    tmp.write_text(json.dumps(study, indent=2))
    tmp.replace(out / "study.json")


if __name__ == "__main__":
    main()
