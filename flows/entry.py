"""The deployments' entry points: each flow, started from a pipeline YAML path.

A deployment (deployments/prefect.yaml, deployments/serve.py) passes a config *path*; every
flow in flows/ takes the loaded `PipelineConfig`. Each entry here loads the file once through
its step of the table (`flows.steps.STEPS`: the same inputs checked, and the same training
lock refused, as the `kiln` command's) and runs the typed flow's body in its own flow run,
under the same name: one run per deployment run, shown in the UI as the flow it starts. The
other parameters are the typed flow's, declared again here so that Prefect's form asks for
them (tests hold each entry's parameters equal to its flow's).
"""

from __future__ import annotations

from prefect import flow

from flows.evaluate import evaluate_flow
from flows.human_evaluation import human_eval_flow
from flows.ingest import ingest_flow
from flows.pipeline import kiln_pipeline
from flows.promote import promote_flow, rollback_flow
from flows.register import register_flow
from flows.retrain import retrain_flow
from flows.shard import shard_flow
from flows.steps import STEPS, check_id_params
from flows.takedown import takedown_flow
from flows.train import train_flow
from flows.validate import validate_flow

__all__ = [
    "evaluate",
    "human_eval",
    "ingest",
    "pipeline",
    "promote",
    "register",
    "retrain",
    "rollback",
    "shard",
    "takedown",
    "train",
    "validate",
]


def _run(step: str, config: str, **params):
    """The typed flow's body of `step`, on the config at `config` loaded by the table, once
    its id parameters are known to name folders under the root."""
    check_id_params(params)
    return STEPS[step].load_flow().fn(STEPS[step].load_config(config), **params)


@flow(name=kiln_pipeline.name, log_prints=True)
def pipeline(config: str, allow_failed_gate: bool = False, only_new_data: bool = False) -> dict:
    """The whole pipeline (`flows.pipeline.kiln_pipeline`) from a pipeline YAML path."""
    return _run(
        "pipeline", config, allow_failed_gate=allow_failed_gate, only_new_data=only_new_data
    )


@flow(name=retrain_flow.name, log_prints=True)
def retrain(config: str, event_root: str | None = None) -> dict:
    """Retraining (`flows.retrain.retrain_flow`) from a retraining YAML path; the flow checks
    the inputs itself, once it knows the retrain is due."""
    return _run("retrain", config, event_root=event_root)


@flow(name=ingest_flow.name, log_prints=True)
def ingest(config: str, standalone: bool = True) -> dict:
    """The ingest (`flows.ingest.ingest_flow`) from a pipeline YAML path."""
    return _run("ingest", config, standalone=standalone)


@flow(name=validate_flow.name, log_prints=True)
def validate(config: str, ingest_id: str | None = None, allow_failed_gate: bool = False) -> dict:
    """The quality gate (`flows.validate.validate_flow`) from a pipeline YAML path."""
    return _run("validate", config, ingest_id=ingest_id, allow_failed_gate=allow_failed_gate)


@flow(name=shard_flow.name, log_prints=True)
def shard(
    config: str,
    ingest_id: str | None = None,
    allow_failed_gate: bool = False,
    dry_run: bool = False,
) -> dict:
    """The shards (`flows.shard.shard_flow`) from a pipeline YAML path."""
    return _run(
        "shard", config, ingest_id=ingest_id, allow_failed_gate=allow_failed_gate, dry_run=dry_run
    )


@flow(name=train_flow.name, log_prints=True)
def train(config: str, dataset_version: str | None = None, run_id: str | None = None) -> dict:
    """Training (`flows.train.train_flow`) from a pipeline YAML path."""
    return _run("train", config, dataset_version=dataset_version, run_id=run_id)


@flow(name=evaluate_flow.name, log_prints=True)
def evaluate(config: str, run_id: str | None = None) -> dict:
    """The evaluation study (`flows.evaluate.evaluate_flow`) from a pipeline YAML path."""
    return _run("evaluate", config, run_id=run_id)


@flow(name=register_flow.name, log_prints=True)
def register(config: str, run_id: str | None = None, study_id: str | None = None) -> dict:
    """Registration (`flows.register.register_flow`) from a pipeline YAML path."""
    return _run("register", config, run_id=run_id, study_id=study_id)


@flow(name=promote_flow.name, log_prints=True)
def promote(
    config: str,
    candidate: str | None = None,
    first: bool = False,
    force: bool = False,
    reason: str | None = None,
    allow_takedown: bool = False,
) -> dict:
    """Promotion (`flows.promote.promote_flow`) from a pipeline YAML path."""
    return _run(
        "promote",
        config,
        candidate=candidate,
        first=first,
        force=force,
        reason=reason,
        allow_takedown=allow_takedown,
    )


@flow(name=rollback_flow.name, log_prints=True)
def rollback(config: str, reason: str | None = None) -> dict:
    """Rollback (`flows.promote.rollback_flow`) from a pipeline YAML path."""
    return _run("rollback", config, reason=reason)


@flow(name=takedown_flow.name, log_prints=True)
def takedown(
    config: str,
    reason: str,
    keys: list[str] | None = None,
    contributor: str | None = None,
    by: str | None = None,
) -> dict:
    """A takedown (`flows.takedown.takedown_flow`) from a pipeline YAML path."""
    return _run("takedown", config, reason=reason, keys=keys, contributor=contributor, by=by)


@flow(name=human_eval_flow.name, log_prints=True)
def human_eval(
    config: str,
    study_a: str,
    study_b: str,
    wait_s: float = 0.0,
    poll_s: float = 60.0,
    raters_per_pair: int | None = None,
    gold: int | None = None,
    name: str | None = None,
) -> dict:
    """Human evaluation (`flows.human_evaluation.human_eval_flow`) from a pipeline YAML path."""
    return _run(
        "human_eval",
        config,
        study_a=study_a,
        study_b=study_b,
        wait_s=wait_s,
        poll_s=poll_s,
        raters_per_pair=raters_per_pair,
        gold=gold,
        name=name,
    )
