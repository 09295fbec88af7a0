"""The whole pipeline as one Prefect flow run, with a subflow per step."""

from __future__ import annotations

from prefect import flow

from flows.config import check_inputs, load_config
from flows.evaluate import evaluate_flow
from flows.ingest import ingest_flow
from flows.register import register_flow
from flows.shard import shard_flow
from flows.train import train_flow
from flows.validate import validate_flow

__all__ = ["kiln_pipeline"]


@flow(name="kiln-pipeline", log_prints=True)
def kiln_pipeline(config_path: str, root: str | None = None, source: str | None = None) -> dict:
    """ingest -> validate -> shard -> train (all stages) -> evaluate -> register.

    Args:
        config_path: Pipeline YAML.
        root: Overrides `storage.root`.
        source: Overrides `ingest.source`.
    """
    check_inputs(load_config(config_path, root=root, source=source), ("train", "evaluate"))
    ingest = ingest_flow(config_path, root=root, source=source)
    quality = validate_flow(config_path, root=root, ingest_id=ingest["ingest_id"])
    shards = shard_flow(config_path, root=root, ingest_id=ingest["ingest_id"])
    run = train_flow(config_path, root=root, dataset_version=shards["dataset_version"])
    study = evaluate_flow(config_path, root=root, run_id=run["run_id"])
    model = register_flow(config_path, root=root, run_id=run["run_id"], study_id=study["study_id"])
    return {
        "ingest": ingest,
        "quality": quality,
        "shards": shards,
        "run": {k: v for k, v in run.items() if k != "stages"},
        "study": study,
        "model": model,
    }
