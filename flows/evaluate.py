"""Evaluate flow: generate images for every DrawBench prompt and seed with the trained model."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from flows.config import check_inputs, load_config
from tasks.launch import launch_generate
from tasks.layout import Layout

__all__ = ["evaluate_flow"]


@flow(name="kiln-evaluate", log_prints=True)
def evaluate_flow(config_path: str, root: str | None = None, run_id: str | None = None) -> dict:
    """Write `<root>/eval/<study_id>/{images/,study.json}` for a training run's final export.

    Args:
        config_path: Pipeline YAML.
        root: Overrides `storage.root`.
        run_id: Training run to evaluate; default the newest.
    """
    cfg = load_config(config_path, root=root)
    check_inputs(cfg, ("evaluate",))
    layout = Layout(Path(cfg.storage.root))
    run_id, record = layout.finished_run(run_id, "evaluate")
    ev = cfg.evaluate
    settings = json.dumps(
        [
            Path(ev.prompts_csv).read_bytes().hex(),
            ev.seeds,
            ev.num_inference_steps,
            ev.guidance_scale,
            ev.limit,
        ]
    )
    study_id = f"{run_id}-{hashlib.sha256(settings.encode()).hexdigest()[:8]}"
    study = launch_generate(
        record["export"],
        ev.prompts_csv,
        str(layout.study(study_id)),
        accelerate_config=cfg.launch.accelerate_config,
        seeds=ev.seeds,
        num_inference_steps=ev.num_inference_steps,
        guidance_scale=ev.guidance_scale,
        batch_size=ev.batch_size,
        limit=ev.limit,
        model_ref=run_id,
        num_processes=cfg.launch.num_processes,
    )
    layout.set_latest("eval", study_id)
    cats: dict[str, int] = {}
    for it in study["items"]:
        cats[it["category"]] = cats.get(it["category"], 0) + 1
    create_markdown_artifact(
        key="drawbench-study",
        description=f"Study {study_id}",
        markdown=(
            f"## DrawBench study `{study_id}`\n\n{len(study['items'])} images "
            f"({len(ev.seeds)} seed(s) per prompt) at `{layout.study(study_id)}`.\n\n"
            "| category | images |\n|---|---:|\n"
            + "\n".join(f"| {c} | {n} |" for c, n in sorted(cats.items()))
        ),
    )
    return {
        "study_id": study_id,
        "images": len(study["items"]),
        "path": str(layout.study(study_id)),
    }
