"""The whole pipeline as one Prefect flow run, with a subflow per step.

The config is loaded and checked once (by the CLI, or by a deployment's entry in
flows/entry.py) and the loaded object is passed to every step, so editing the file during a
multi-day run changes nothing in it. The train step writes it to the training run's folder
(`<root>/runs/<run_id>/config.yaml`), and evaluate and register use the config it trained with.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from flows.evaluate import evaluate_flow
from flows.ingest import ingest_flow
from flows.register import register_flow
from flows.shard import shard_flow
from flows.train import train_flow
from flows.validate import validate_flow
from kiln_config import PipelineConfig
from tasks.inputs import with_prompts
from tasks.reports import pipeline_report
from tasks.storage.layout import new_run_id
from tasks.storage.lock import root_lock

__all__ = ["kiln_pipeline"]


@flow(name="kiln-pipeline", log_prints=True)
def kiln_pipeline(
    config: PipelineConfig,
    allow_failed_gate: bool = False,
    only_new_data: bool = False,
) -> dict:
    """ingest -> validate -> shard -> train (all stages) -> evaluate -> register.

    Args:
        config: The loaded config, the inputs of every step checked by the caller.
        allow_failed_gate: Go on past a failed quality gate (recorded in shards.json).
        only_new_data: Stop after the ingest, returning `{"ingest", "skipped"}`, when no
            accepted image is new or changed since the newest finished training (a retrain
            queued behind another, or the weekly cron the night after a triggered one) and no
            image it trained on has been taken down since.
    """
    # The resolved prompts file goes into the training run's snapshot: the study reads the
    # file the run recorded, even if KILN_DRAWBENCH_CSV changes before it is evaluated.
    cfg = with_prompts(config)
    run_id = new_run_id()
    # The whole pipeline holds the root's training lock (its train subflow re-enters it):
    # a second `kiln run` on this root fails at once instead of racing on the same folders.
    with root_lock(Path(cfg.storage.root), f"pipeline run {run_id}"):
        return _pipeline(cfg, run_id, allow_failed_gate, only_new_data)


def _pipeline(
    cfg: PipelineConfig, run_id: str, allow_failed_gate: bool, only_new_data: bool
) -> dict:
    ingest = ingest_flow(cfg, standalone=False)
    fresh = ingest["new_data"]
    last = fresh["trained_run_id"]
    down = fresh.get("taken_down_since_training", 0)
    if only_new_data and last and fresh["new_since_training"] == 0 and not down:
        why = (
            f"no accepted image is new or changed since run {last} trained on catalog "
            f"{fresh['trained_ingest_id']}: nothing to retrain on"
        )
        get_run_logger().info(why)
        return {"ingest": ingest, "skipped": why}
    gate = {"ingest_id": ingest["ingest_id"], "allow_failed_gate": allow_failed_gate}
    quality = validate_flow(cfg, **gate)
    shards = shard_flow(cfg, **gate)
    run = train_flow(cfg, dataset_version=shards["dataset_version"], run_id=run_id)
    trained = run.pop("config")  # the config the run trained with (its snapshot's)
    study = evaluate_flow(trained, run_id=run_id)
    model = register_flow(trained, run_id=run_id, study_id=study["study_id"])
    result = {
        "ingest": ingest,
        "quality": quality,
        "shards": shards,
        "run": {k: v for k, v in run.items() if k != "stages"},
        "study": study,
        "model": model,
    }
    # The parent run's own artifact: one table linking every step's output.
    create_markdown_artifact(
        key="kiln-pipeline", description=f"Pipeline {run_id}", markdown=pipeline_report(result, run)
    )
    return result
