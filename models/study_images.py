"""Generate evaluation images for a prompt set (`evaluate.prompts_csv`), split across
processes:

    accelerate launch -m models.study_images --config study.yaml

The run file (`kiln_config.StudyRun`) names the pipeline, the study folder and the
`evaluate` settings: the prompts file, seeds, inference steps, guidance, batch size and limit.

Each (prompt, seed) pair gets its own generator, so an image depends only on its prompt and
seed, never on batching or process count. Existing images are kept, so a relaunch after a
crash only generates what is missing. The main process writes `study.json` last.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch
from accelerate import PartialState
from diffusers import StableDiffusionPipeline

from kiln_config import EvaluateConfig, StudyRun, load_yaml_model
from models.evaluation.generate import generate_images, load_pipeline, read_prompts

__all__ = ["main"]

log = logging.getLogger("kiln.generate")


def main(argv: list[str] | None = None) -> None:
    """Generate every (prompt, seed) image still missing from the study folder, then
    `study.json`."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="Run file (kiln_config.StudyRun)")
    run: StudyRun = load_yaml_model(StudyRun, p.parse_args(argv).config)
    ev = run.evaluate
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    state = PartialState(cpu=not torch.cuda.is_available())
    out = Path(run.out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    prompts = read_prompts(ev.prompts_csv, ev.limit)
    items = [
        {"index": i, **row, "seed": seed, "path": f"images/{i:04d}-s{seed}.png"}
        for i, row in enumerate(prompts)
        for seed in ev.seeds
    ]
    pipe = load_pipeline(run.pipeline, state.device)
    t0 = time.perf_counter()
    with state.split_between_processes(items) as mine:
        todo = [it for it in mine if not (out / it["path"]).is_file()]
        _generate_into(pipe, todo, out, ev)
        log.info("rank %d generated %d images", state.process_index, len(todo))
    state.wait_for_everyone()
    if state.is_main_process:
        _write_study(run, pipe, items, round(time.perf_counter() - t0, 2))
    state.wait_for_everyone()
    state.destroy_process_group()  # or a rank can abort at exit with the group still up


def _generate_into(
    pipe: StableDiffusionPipeline, todo: list[dict], out: Path, ev: EvaluateConfig
) -> None:
    """Generate `todo`'s images in batches, each PNG renamed into place when complete."""
    for start in range(0, len(todo), ev.batch_size):
        batch = todo[start : start + ev.batch_size]
        images = generate_images(
            pipe,
            [it["prompt"] for it in batch],  # study.json keeps the prompts as written
            [it["seed"] for it in batch],
            ev.num_inference_steps,
            ev.guidance_scale,
        )
        for it, img in zip(batch, images, strict=True):
            tmp = out / (it["path"] + ".tmp")
            img.save(tmp, format="PNG")
            tmp.replace(out / it["path"])


def _write_study(run: StudyRun, pipe, items: list[dict], generated_s: float) -> None:
    """Write `study.json` last, once every image is on disk.

    Raises:
        RuntimeError: when an image is missing.
    """
    out, ev = Path(run.out_dir), run.evaluate
    missing = [it["path"] for it in items if not (out / it["path"]).is_file()]
    if missing:
        raise RuntimeError(f"{len(missing)} images missing after generation, e.g. {missing[:3]}")
    study = {
        "study_id": out.name,
        "model": {"pipeline": str(Path(run.pipeline).resolve()), "ref": run.model_ref},
        "prompts_csv": str(Path(ev.prompts_csv).resolve()),
        "settings": {
            "seeds": ev.seeds,
            "num_inference_steps": ev.num_inference_steps,
            "guidance_scale": ev.guidance_scale,
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
