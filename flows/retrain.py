"""Weekly retraining: continue from the champion on the data that has arrived, then ask people.

    ingest (incremental) -> validate -> shard -> train (warm-started from
    `train.init_from_model`, normally models:/<name>@champion) -> evaluate -> register as
    `candidate` -> the champion's study on the same prompts and seeds -> open the blind A/B
    comparison candidate vs champion

The comparison is only opened: raters take days. The `human-eval` deployment (or
`kiln rate report`) reports it and logs the numbers that `kiln promote` reads. Nothing here
moves `champion`.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from flows.human_evaluation import study_for_model
from flows.pipeline import kiln_pipeline
from flows.steps import STEPS
from kiln_config import PipelineConfig
from kiln_config.errors import InputError
from tasks.evaluation.comparison import create_comparison_task
from tasks.inputs import check_inputs
from tasks.storage.layout import Layout

__all__ = ["retrain_flow"]


@flow(name="kiln-retrain", log_prints=True)
def retrain_flow(config: PipelineConfig, event_root: str | None = None) -> dict:
    """Retrain from the champion, register the candidate, open its comparison. Nothing is
    trained when no image is new since the last training (returns `{"skipped": why}`).

    Args:
        config: A loaded retraining config (configs/sd2-retrain.yaml):
            `train.init_from_model` names the model to continue from. Its inputs are checked
            here, once the retrain is known to be due.
        event_root: Set by the new-data trigger: the storage root whose ingest emitted
            `kiln.ingest.completed`. An event from another root (a developer's ingest on the
            same Prefect server) retrains nothing.
    """
    cfg = config
    log = get_run_logger()
    if event_root is not None and Path(event_root) != Path(cfg.storage.root):
        why = (
            f"the new-data event came from root {event_root}; this retrain trains "
            f"{cfg.storage.root}: nothing to do"
        )
        log.info(why)
        return {"skipped": why}
    if not cfg.train.init_from_model:
        raise InputError(
            "train.init_from_model is not set, so this would train from "
            "scratch; use the kiln-pipeline flow for that, or set it to "
            f"models:/{cfg.registry.model_name}@champion"
        )
    check_inputs(cfg, STEPS["pipeline"].checks)
    result = kiln_pipeline(cfg, only_new_data=True)
    if "skipped" in result:
        create_markdown_artifact(
            key="retrain",
            description="nothing new to retrain on",
            markdown=f"## No retrain\n\n{result['skipped']}.",
        )
        return result
    he, r = cfg.human_eval, cfg.storage.root
    # The file to pass back: the run's own snapshot, which loads to the same values.
    name = Layout(Path(r)).run_config(result["run"]["run_id"])
    champion = f"models:/{cfg.registry.model_name}@champion"
    champ_study = study_for_model(cfg, champion)
    cid = create_comparison_task(
        r,
        he.database_url,
        result["study"]["study_id"],
        champ_study,
        he.raters_per_pair,
        he.gold_per_rater,
        None,
    )
    log.info(
        "candidate %s v%s vs %s: comparison %s is open",
        cfg.registry.model_name,
        result["model"]["version"],
        champion,
        cid,
    )
    create_markdown_artifact(
        key="retrain",
        description=f"candidate v{result['model']['version']} vs champion",
        markdown=(
            f"## Candidate `{result['model']['uri_by_alias']}` (v{result['model']['version']})\n\n"
            f"Warm-started from `{cfg.train.init_from_model}`; comparison `{cid}` against "
            f"`{champion}` (study `{champ_study}`) is open.\n\n"
            f"1. `kiln rate invite --config {name} --comparison {cid} "
            "--raters 8`\n"
            "2. when the votes are in: the `human-eval` deployment, or `kiln rate report`\n"
            f"3. `kiln promote --config {name}`: the gate reads the report"
        ),
    )
    return {**result, "comparison": cid, "champion_study": champ_study}
