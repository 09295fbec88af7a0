"""MLflow calls: the training run's record and the model registry.

The train flow opens one MLflow run per training run (`create_training_run`); the training
script logs metrics into it by id, and the train flow ends it (`mark_training_run`): FINISHED
when every stage is trained, FAILED or KILLED otherwise, so no run stays RUNNING. Later,
`register_model` logs the exported pipeline into that finished run as a pyfunc model
(MLflow logs to a finished run by id), registers a version, tags it with its lineage and
points an alias (`candidate` by default) at it. Aliases, never the deprecated registry stages.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mlflow.tracking import MlflowClient
from prefect import task
from prefect.cache_policies import NO_CACHE

__all__ = [
    "create_training_run",
    "mark_training_run",
    "ensure_experiment",
    "register_model",
    "mlflow_uris",
]

# What a serving environment needs to load the pyfunc model (pinned to what trained it).
SERVING_PACKAGES = [
    "torch",
    "diffusers",
    "transformers",
    "accelerate",
    "safetensors",
    "pandas",
    "pillow",
]


@contextmanager
def mlflow_uris(uri: str) -> Iterator[None]:
    """Point MLflow's fluent API (`start_run`, `log_model`) at `uri`, then put back what was.

    `mlflow.set_tracking_uri` and `set_registry_uri` also write `MLFLOW_TRACKING_URI` and
    `MLFLOW_REGISTRY_URI` into `os.environ`, so every later subprocess of this process (a
    worker's next flow run, an `accelerate launch`, `mlflow models serve`) would inherit this
    run's tracking store. Both the module state and the variables are restored on exit.
    """
    import mlflow
    from mlflow.tracking._model_registry import utils as registry_utils
    from mlflow.tracking._tracking_service import utils as tracking_utils

    names = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")
    env = {k: os.environ.get(k) for k in names}
    saved = (tracking_utils._tracking_uri, registry_utils._registry_uri)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    try:
        yield
    finally:
        tracking_utils._tracking_uri, registry_utils._registry_uri = saved
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def ensure_experiment(client: MlflowClient, name: str, artifact_root: str | None) -> str:
    """The experiment's id, creating it with artifacts under `artifact_root` if missing."""
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = Path(artifact_root).resolve().as_uri() if artifact_root else None
    return client.create_experiment(name, artifact_location=location)


@task(name="create-training-run", cache_policy=NO_CACHE)
def create_training_run(
    tracking_uri: str,
    experiment: str,
    run_name: str,
    params: dict[str, str],
    tags: dict[str, str],
    artifact_root: str | None = None,
) -> str:
    """Create the MLflow run that a whole training run (all stages) logs into; return its id."""
    client = MlflowClient(tracking_uri)
    exp_id = ensure_experiment(client, experiment, artifact_root)
    run = client.create_run(exp_id, run_name=run_name, tags=tags)
    for k, v in params.items():
        client.log_param(run.info.run_id, k, str(v)[:6000])
    return run.info.run_id


@task(name="mark-training-run", cache_policy=NO_CACHE)
def mark_training_run(tracking_uri: str, mlflow_run_id: str, status: str) -> None:
    """Set the training run's MLflow status: RUNNING (a resume), or end it FINISHED, FAILED
    or KILLED."""
    client = MlflowClient(tracking_uri)
    if status == "RUNNING":
        client.update_run(mlflow_run_id, status="RUNNING")
    elif status in ("FINISHED", "FAILED", "KILLED"):
        client.set_terminated(mlflow_run_id, status=status)
    else:
        raise ValueError(
            f"status must be RUNNING, FINISHED, FAILED or KILLED (received {status!r})"
        )


@task(name="register-model", cache_policy=NO_CACHE)
def register_model(
    tracking_uri: str,
    mlflow_run_id: str,
    export_dir: str,
    model_name: str,
    alias: str,
    lineage: dict[str, str],
) -> dict:
    """Log `export_dir` as a pyfunc model in the training run, register it, set `alias`.

    Returns:
        {"name", "version", "alias", "model_uri", "uri_by_alias"}.
    """
    import mlflow

    import models
    from models.pyfunc import KilnDiffusionModel, signature

    if not (Path(export_dir) / "model_index.json").is_file():
        raise FileNotFoundError(f"no exported pipeline at {export_dir} (model_index.json missing)")
    client = MlflowClient(tracking_uri, registry_uri=tracking_uri)
    reqs = [f"{p}=={importlib.metadata.version(p)}" for p in SERVING_PACKAGES]
    ended = client.get_run(mlflow_run_id).info
    with mlflow_uris(tracking_uri):
        try:
            # Resuming a run sets it RUNNING (and FAILED if logging raises); the training
            # run's own end state and time are put back below, whatever happens here.
            with mlflow.start_run(run_id=mlflow_run_id):
                info = mlflow.pyfunc.log_model(
                    name="model",
                    python_model=KilnDiffusionModel(),
                    artifacts={"pipeline": export_dir},
                    code_paths=[str(Path(models.__file__).parent)],
                    pip_requirements=reqs,
                    signature=signature(),
                )
        finally:
            if ended.status != "RUNNING":
                client.set_terminated(
                    mlflow_run_id, status=ended.status, end_time=ended.end_time
                )
        version = mlflow.register_model(info.model_uri, model_name, tags=lineage)
    client.set_registered_model_alias(model_name, alias, version.version)
    client.update_model_version(
        model_name, version.version, description=f"Kiln training run {lineage.get('run_id', '')}"
    )
    tags = {
        "kiln.model_name": model_name,
        "kiln.model_version": str(version.version),
        "kiln.model_alias": alias,
        **{f"kiln.{k}": str(v) for k, v in lineage.items()},
    }
    for k, v in tags.items():
        client.set_tag(mlflow_run_id, k, v)
    return {
        "name": model_name,
        "version": str(version.version),
        "alias": alias,
        "model_uri": info.model_uri,
        "uri_by_alias": f"models:/{model_name}@{alias}",
    }
