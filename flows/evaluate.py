"""Evaluate flow: generate images for every prompt the config names (`evaluate.prompts_csv`;
DrawBench when unset) and seed with the trained model, lay them out as one contact sheet per
category, and compute CLIP score and FID when their weights are configured
(`evaluate.metrics`); a metric without weights is skipped, and the study's artifact says why.

The settings come from the training run's config snapshot, not the file passed in: editing
the file while a run trains does not change how it is evaluated.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from kiln_config import PipelineConfig, run_config, stable_hash
from tasks.evaluation.contact_sheet import write_contact_sheets
from tasks.evaluation.prompts import prompt_set_name
from tasks.evaluation.study_metrics import compute_study_metrics, log_study_metrics, metrics_report
from tasks.inputs import prompts_file
from tasks.launch.accelerate import launch_generate
from tasks.reports import study_report
from tasks.storage.layout import Layout

__all__ = ["evaluate_flow", "study_id_for"]


def study_id_for(model_ident: str, ev) -> str:
    """A study's id: the model's identity and a hash of everything that shapes its images
    (the prompts file's bytes, seeds, steps, guidance, limit), so asking twice reuses it.

    Args:
        model_ident: A training run id, or an id of a registered model or pipeline folder.
        ev: The config's `evaluate` section, with `prompts_csv` resolved
            (`tasks.inputs.prompts_file`).
    """
    settings = [
        Path(ev.prompts_csv).read_bytes().hex(),
        ev.seeds,
        ev.num_inference_steps,
        ev.guidance_scale,
        ev.limit,
    ]
    return f"{model_ident}-{stable_hash(settings, 8)}"


@flow(name="kiln-evaluate", log_prints=True)
def evaluate_flow(config: PipelineConfig, run_id: str | None = None) -> dict:
    """Write `<root>/eval/<study_id>/{images/,study.json}` for a training run's final export.

    Args:
        config: The loaded config: finds the root; the settings come from the run's snapshot,
            its prompts file resolved here (`tasks.inputs.prompts_file`).
        run_id: Training run to evaluate; default the newest.
    """
    layout = Layout(Path(config.storage.root))
    run_id, record = layout.finished_run(run_id, "evaluate")
    cfg = run_config(config, layout.run_config(run_id), get_run_logger())
    ev = cfg.evaluate.model_copy(update={"prompts_csv": prompts_file(cfg)})
    study_id = study_id_for(run_id, ev)
    study = launch_generate(
        record["export"],
        ev.prompts_csv,
        str(layout.study(study_id)),
        evaluate=ev,
        launch=cfg.launch,
        model_ref=run_id,
    )
    study_dir = layout.study(study_id)
    sheets = write_contact_sheets(study_dir, study["items"])
    final_res = cfg.train.stages[-1].resolution
    metrics = compute_study_metrics(
        str(study_dir),
        study["items"],
        ev.metrics,
        str(layout.val_shards(record["dataset_version"], final_res)),
        generate={
            "pipeline": record["export"],
            # FID's images: one seed for each of its own prompts, the rest as the study's
            "settings": {
                "evaluate": ev.model_copy(update={"seeds": ev.seeds[:1], "limit": None}),
                "launch": cfg.launch,
                "model_ref": run_id,
            },
        },
    )
    url = log_study_metrics(
        cfg.tracking_uri,
        record["mlflow_run_id"],
        str(study_dir),
        metrics,
        [str(p) for p in sheets.values()],
    )
    layout.set_latest("eval", study_id)
    prompts = prompt_set_name(study["prompts_csv"])
    create_markdown_artifact(
        key="evaluation-study",
        description=f"Study {study_id}",
        markdown=study_report(study_id, study["items"], ev.seeds, str(study_dir), prompts)
        + "\n\n"
        + metrics_report(metrics, sheets, url),
    )
    return {
        "study_id": study_id,
        "prompts": prompts,
        "images": len(study["items"]),
        "path": str(study_dir),
        "contact_sheets": {c: str(p) for c, p in sheets.items()},
        "metrics": metrics,
    }
