"""MLflow calls: the training run's record and the model registry.

The train flow opens one MLflow run per training run (`create_training_run`); the training
script logs metrics into it by id, and the train flow ends it (`mark_training_run`): FINISHED
when every stage is trained, FAILED or KILLED otherwise, so no run stays RUNNING. Later,
`register_model` logs the exported pipeline into that finished run as a pyfunc model
(MLflow logs to a finished run by id), registers a version, tags it with its lineage and
points an alias (`candidate` by default) at it, and describes the model and the version
(what it is, its data and run, how to load it). Aliases, never the deprecated registry stages.

The quality step gets a run of its own (`log_data_docs`): its Great Expectations Data Docs
site as artifacts, so the quality-gate artifact can link them over http (a browser refuses a
file:// link from the Prefect UI).
"""

from __future__ import annotations

import importlib.metadata
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote, urlsplit

import mlflow
from mlflow.tracking import MlflowClient
from prefect import task
from prefect.cache_policies import NO_CACHE

import kiln_pyfunc
from kiln_config import EvaluateConfig, check_id
from kiln_config.errors import InputError, MissingInput, NotFound
from kiln_pyfunc import KilnDiffusionModel, default_params, signature
from tasks.runtime.logs import task_logger
from tasks.storage.layout import Layout

__all__ = [
    "EXPERIMENT_DESCRIPTION",
    "EXPERIMENT_KIND",
    "LOCAL_MLFLOW_UI",
    "ModelVersionNotFound",
    "model_version",
    "create_training_run",
    "ensure_experiment",
    "log_data_docs",
    "log_run_artifact",
    "mark_training_run",
    "artifacts_url",
    "mlflow_ui_url",
    "mlflow_uris",
    "model_description",
    "register_model",
    "registered_pipeline",
    "resolve_pipeline",
    "tag_id",
    "version_description",
]

# MLflow 3's UI opens an experiment without this tag on its GenAI (traces) page; tagged as
# model development it opens on the runs table, where Kiln's runs are.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
# The description the MLflow UI shows on the experiment's page (its `mlflow.note.content` tag).
EXPERIMENT_NOTE = "mlflow.note.content"
EXPERIMENT_DESCRIPTION = (
    "Kiln: text-to-image diffusion training. One run per `kiln train` or `kiln run` (params, "
    "loss and validation metrics, samples per stage, the exported pipeline), a quality run "
    "per ingest (Data Docs), and human evaluation results on the candidate's run. Registered "
    "versions carry the aliases `candidate`, `champion` and `previous-champion`."
)
# Where `kiln mlflow-ui` serves a local tracking store by default (kiln_cli/main.py, --port).
LOCAL_MLFLOW_UI = "http://127.0.0.1:5000"
# The quality summary's counts, logged as metrics of the quality run.
QUALITY_METRICS = (
    "listed",
    "clean",
    "rejected_ingest",
    "rejected_validate",
    "reject_fraction",
    "max_reject_fraction",
    "near_duplicates",
    "manifest_problems",
)

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
    """The experiment's id, creating it with artifacts under `artifact_root` if missing.

    A tracking server (an http(s) URI) keeps the artifacts where it is configured to
    (`--artifacts-destination`, an object store behind its proxy): there `artifact_root` is not
    used, since a folder of this machine would be out of reach of the server's other clients.

    Either way it is tagged as model development (`EXPERIMENT_KIND`), so the MLflow UI opens
    on its runs. An experiment made before Kiln tagged it gets the tag now; a kind that a
    person chose in the UI is left alone (only a missing or UI-inferred kind is replaced).
    It gets Kiln's description (`EXPERIMENT_DESCRIPTION`) unless it has one already.
    """
    key, kind = EXPERIMENT_KIND
    exp = client.get_experiment_by_name(name)
    if exp is None:
        served = urlsplit(client.tracking_uri).scheme in ("http", "https")
        location = Path(artifact_root).resolve().as_uri() if artifact_root and not served else None
        tags = {key: kind, EXPERIMENT_NOTE: EXPERIMENT_DESCRIPTION}
        return client.create_experiment(name, artifact_location=location, tags=tags)
    current = exp.tags.get(key)
    if current is None or current.endswith("inferred") or current.endswith("inferred_type"):
        client.set_experiment_tag(exp.experiment_id, key, kind)
    if not exp.tags.get(EXPERIMENT_NOTE):
        client.set_experiment_tag(exp.experiment_id, EXPERIMENT_NOTE, EXPERIMENT_DESCRIPTION)
    return exp.experiment_id


def mlflow_ui_url(tracking_uri: str) -> str:
    """The MLflow UI's base URL for `tracking_uri`: the tracking server itself when it is one
    (http or https, without any credentials), else the local `kiln mlflow-ui`."""
    parts = urlsplit(tracking_uri)
    if parts.scheme not in ("http", "https"):
        return LOCAL_MLFLOW_UI
    host = parts.hostname or ""
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port is not None else ""
    return f"{parts.scheme}://{host}{port}{parts.path.rstrip('/')}"


def artifacts_url(tracking_uri: str, experiment_id: str, run_id: str, path: str) -> str:
    """The UI page of a run's artifact `path` (the artifacts tab, that file open)."""
    page = f"#/experiments/{experiment_id}/runs/{run_id}/artifacts"
    return f"{mlflow_ui_url(tracking_uri)}/{page}" + (f"/{quote(path)}" if path else "")


@task(name="create-training-run", cache_policy=NO_CACHE)
def create_training_run(
    tracking_uri: str,
    experiment: str,
    run_name: str,
    params: dict[str, str],
    tags: dict[str, str],
    artifact_root: str | None = None,
    dataset: tuple[str, str] | None = None,
) -> str:
    """Create the MLflow run that a whole training run (all stages) logs into; return its id.

    `dataset` is (dataset version, source URI of its shards): logged as the run's input.
    """
    client = MlflowClient(tracking_uri)
    exp_id = ensure_experiment(client, experiment, artifact_root)
    run = client.create_run(exp_id, run_name=run_name, tags=tags)
    for k, v in params.items():
        client.log_param(run.info.run_id, k, str(v)[:6000])
    if dataset is not None:
        log_dataset_input(client, run.info.run_id, *dataset)
    return run.info.run_id


def log_dataset_input(client: MlflowClient, run_id: str, version: str, source_uri: str) -> None:
    """Log the dataset version as the run's MLflow dataset input (context `training`), so the
    MLflow UI's Datasets column shows what a model was trained on: name and digest are the
    dataset version, the source is where its shards live."""
    import warnings

    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    with warnings.catch_warnings():  # "can be interpreted in multiple ways": both are local
        warnings.simplefilter("ignore", UserWarning)
        source = resolve_dataset_source(source_uri)
    ds = MetaDataset(source, name=f"kiln-{version}", digest=version)
    tag = InputTag(key=MLFLOW_DATASET_CONTEXT, value="training")
    client.log_inputs(run_id, datasets=[DatasetInput(ds._to_mlflow_entity(), tags=[tag])])


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


@task(name="log-run-artifact", cache_policy=NO_CACHE)
def log_run_artifact(tracking_uri: str, run_id: str, path: str, artifact_path: str) -> bool:
    """Log one file (a stage's loss curves) into a run's artifacts. A failure is a warning:
    the file stays on disk and the stage's outcome stands. Returns whether it was logged."""
    try:
        MlflowClient(tracking_uri).log_artifact(run_id, path, artifact_path)
        return True
    except Exception as e:  # noqa: BLE001 - the artifact is a convenience, never a failure
        task_logger(__name__).warning(
            "%s not logged to MLflow run %s (%s: %s); it stays on disk.",
            path,
            run_id,
            type(e).__name__,
            e,
        )
        return False


@task(name="log-data-docs", cache_policy=NO_CACHE)
def log_data_docs(
    tracking_uri: str,
    experiment: str,
    ingest_id: str,
    docs_dir: str,
    summary: dict,
    artifact_root: str | None = None,
) -> str | None:
    """Log one quality step's folder (the Data Docs site, summary.json, a sample of the
    quarantine) as artifacts of an MLflow run `quality-<ingest_id>`, with the summary's counts
    as metrics; the whole quarantine stays on disk.

    Returns:
        The MLflow UI link to the Data Docs' validation results page (see `_docs_page`),
        or None when logging failed: a warning says why, the docs stay on
        disk, and the gate's verdict stands either way.
    """
    try:
        return _log_quality_run(
            tracking_uri, experiment, ingest_id, Path(docs_dir), summary, artifact_root
        )
    except Exception as e:  # noqa: BLE001 - the gate's verdict never depends on MLflow
        task_logger(__name__).warning(
            "Data Docs of %s not logged to MLflow (%s: %s); they stay at %s. Check "
            "registry.tracking_uri and that its server is reachable.",
            ingest_id,
            type(e).__name__,
            e,
            docs_dir,
        )
        return None


def _log_quality_run(
    tracking_uri: str,
    experiment: str,
    ingest_id: str,
    docs_dir: Path,
    summary: dict,
    artifact_root: str | None,
) -> str:
    from mlflow.entities import Metric, Param

    if not docs_dir.is_dir():
        raise MissingInput(f"no quality folder at {docs_dir}")
    client = MlflowClient(tracking_uri)
    exp_id = ensure_experiment(client, experiment, artifact_root)
    tags = {
        "kiln.step": "quality",
        "kiln.ingest_id": ingest_id,
        "kiln.quality_gate": "passed" if summary["passed"] else "failed",
    }
    run_id = client.create_run(exp_id, run_name=f"quality-{ingest_id}", tags=tags).info.run_id
    ts = int(time.time() * 1000)
    counts = {k: float(summary[k]) for k in QUALITY_METRICS if k in summary}
    counts.update({f"quarantined.{k}": float(v) for k, v in summary.get("reasons", {}).items()})
    try:
        client.log_batch(
            run_id,
            metrics=[Metric(k, v, ts, 0) for k, v in counts.items()],
            params=[Param("ingest_id", ingest_id)],
        )
        # Everything but the full quarantine, whose rows grow with the catalog: the run gets
        # the counts, the Data Docs and `quarantine_sample.parquet` (a bounded sample).
        for path in sorted(docs_dir.iterdir()):
            if path.name == "quarantine.parquet":
                continue
            if path.is_dir():
                client.log_artifacts(run_id, str(path), artifact_path=path.name)
            else:
                client.log_artifact(run_id, str(path))
    except BaseException:
        client.set_terminated(run_id, status="FAILED")
        raise
    client.set_terminated(run_id, status="FINISHED")
    task_logger(__name__).info("Data Docs of %s logged to MLflow run %s", ingest_id, run_id)
    return artifacts_url(tracking_uri, exp_id, run_id, _docs_page(docs_dir))


def _docs_page(docs_dir: Path) -> str:
    """The Data Docs page the link opens: the validation results when there is one, since
    MLflow's viewer shows one HTML artifact at a time and the links between the site's pages
    lead nowhere there (the other pages are in the run's artifact tree); else `index.html`;
    else the run's artifacts."""
    pages = sorted(docs_dir.glob("validations/**/*.html"))
    if len(pages) == 1:
        return pages[0].relative_to(docs_dir).as_posix()
    return "index.html" if (docs_dir / "index.html").is_file() else ""


def model_description(model_name: str) -> str:
    """The registered model's description (markdown): what it is and how to load it."""
    return (
        "Text-to-image latent diffusion model (Stable Diffusion 2 class: UNet, VAE, CLIP text "
        "encoder) trained from scratch by Kiln on the team's own licensed images. Each version "
        "is one training run's exported diffusers pipeline, wrapped as an MLflow pyfunc model; "
        "its description names its dataset version and run, its tags hold the whole lineage.\n\n"
        "```python\nimport mlflow, pandas as pd\n"
        f'model = mlflow.pyfunc.load_model("models:/{model_name}@candidate")\n'
        'out = model.predict(pd.DataFrame({"prompt": ["a red circle"]}),\n'
        '                    params={"num_inference_steps": 50, "seed": 7})\n'
        "# one row per prompt: prompt, image (PNG bytes), width, height\n```\n\n"
        "Aliases, not stages: `candidate` is the newest registered version; point `champion` "
        "at the one that serves."
    )


def version_description(model_name: str, version: str, lineage: dict[str, str]) -> str:
    """One version's description (markdown): its data, its run, how to load exactly it."""
    get = lineage.get
    scores = ", ".join(
        f"{k.removeprefix('eval.')} {lineage[k]}"
        for k in ("eval.clip_score", "eval.fid")
        if k in lineage
    )
    study = ""
    if get("study_id"):
        study = f" Evaluated in study `{get('study_id')}`" + (f" ({scores})." if scores else ".")
    return (
        f"Trained by Kiln run `{get('run_id', '?')}` (MLflow run `{get('mlflow_run_id', '?')}`) "
        f"on dataset version `{get('dataset_version', '?')}`, built from catalog "
        f"`{get('ingest_id', '?')}` of `{get('source', '?')}`.{study} "
        f"Config sha256 `{get('config_sha256', '?')}`.\n\n"
        f'Load this version: `mlflow.pyfunc.load_model("models:/{model_name}/{version}")`, '
        "then `predict` a DataFrame with a `prompt` column (PNG bytes come back). The diffusers "
        "pipeline inside (artifact `pipeline`) also loads with "
        "`StableDiffusionPipeline.from_pretrained`."
    )


@task(name="register-model", cache_policy=NO_CACHE)
def register_model(
    tracking_uri: str,
    mlflow_run_id: str,
    export_dir: str,
    model_name: str,
    alias: str,
    lineage: dict[str, str],
    metrics: dict[str, float] | None = None,
    card: str | None = None,
    *,
    evaluate: EvaluateConfig,
) -> dict:
    """Log `export_dir` as a pyfunc model in the training run, register it, set `alias`.

    `card` (tasks.reports.model_card) follows the lineage in the version's description.
    `evaluate` gives the model's default inference steps and guidance: those it was
    evaluated with.

    `metrics` (the last stage's validation loss and conditioning gap) are logged on the
    logged model that the version is registered from (the version's metrics in MLflow 3), and
    so also, unprefixed, on the training run, where the promotion gate reads `ema/val/loss`.

    Returns:
        {"name", "version", "alias", "model_uri", "uri_by_alias"}.
    """
    if not (Path(export_dir) / "model_index.json").is_file():
        raise MissingInput(f"no exported pipeline at {export_dir} (model_index.json missing)")
    client = MlflowClient(tracking_uri, registry_uri=tracking_uri)
    reqs = [f"{p}=={importlib.metadata.version(p)}" for p in SERVING_PACKAGES]
    ended = client.get_run(mlflow_run_id).info
    steps, guidance = evaluate.num_inference_steps, evaluate.guidance_scale
    with mlflow_uris(tracking_uri):
        try:
            # Resuming a run sets it RUNNING (and FAILED if logging raises); the training
            # run's own end state and time are put back below, whatever happens here.
            with mlflow.start_run(run_id=mlflow_run_id):
                info = mlflow.pyfunc.log_model(
                    name="model",
                    python_model=KilnDiffusionModel(steps, guidance),
                    artifacts={"pipeline": export_dir},
                    code_paths=[kiln_pyfunc.__file__],
                    pip_requirements=reqs,
                    signature=signature(default_params(steps, guidance)),
                )
                if metrics:
                    mlflow.log_metrics(metrics, model_id=info.model_id)
        finally:
            if ended.status != "RUNNING":
                client.set_terminated(mlflow_run_id, status=ended.status, end_time=ended.end_time)
        version = mlflow.register_model(info.model_uri, model_name, tags=lineage)
    client.set_registered_model_alias(model_name, alias, version.version)
    if not client.get_registered_model(model_name).description:  # keep one a person wrote
        client.update_registered_model(model_name, description=model_description(model_name))
    client.update_model_version(
        model_name,
        version.version,
        description=version_description(model_name, str(version.version), lineage)
        + (f"\n\n{card}" if card else ""),
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


class ModelVersionNotFound(NotFound):
    """A models:/ URI names no version in the registry (no such model, alias or version)."""


def model_version(client: MlflowClient, ref: str):
    """The ModelVersion of models:/NAME@ALIAS or models:/NAME/VERSION.

    Raises:
        ValueError: `ref` is not such a URI.
        ModelVersionNotFound: the model, alias or version does not exist.
    """
    import re

    from mlflow.exceptions import MlflowException

    m = re.fullmatch(r"models:/([^/@]+)(?:@([\w-]+)|/(\d+))", ref)
    if m is None:
        raise InputError(f"{ref!r}: expected models:/NAME@ALIAS or models:/NAME/VERSION")
    name, alias, number = m.groups()
    try:
        return (
            client.get_model_version_by_alias(name, alias)
            if alias
            else client.get_model_version(name, number)
        )
    except MlflowException as e:
        # The server answered that it has no such model, alias or version; a refusal (no
        # login, no permission) or an unreachable server is raised as it is.
        if e.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            raise
        raise ModelVersionNotFound(f"{ref} does not exist in the registry ({e.message})") from e


def tag_id(mv, tag: str) -> str | None:
    """A registered version's tag that names a folder under the root (`run_id`,
    `dataset_version`); None when the version has none (not registered by Kiln).

    Raises:
        InputError: the tag is not one path component: whoever can write a version's tags
            must not choose where Kiln reads or writes.
    """
    value = mv.tags.get(tag)
    return check_id(f"{mv.name} version {mv.version}'s {tag} tag", value) if value else None


def registered_pipeline(tracking_uri: str, root: Path, uri: str):
    """(identity, a callable giving the local pipeline folder) of a registered version.

    A version whose `run_id` tag names a training run under `root` with its export on disk
    is that run (identity: the run id); any other is downloaded once from the registry into
    `<root>/models/<name>-v<version>/` (identity: `<name>-v<version>`).

    Raises:
        ValueError: `uri` is not models:/NAME@ALIAS or models:/NAME/VERSION.
        ModelVersionNotFound: it names no version.
    """
    import json

    mv = model_version(MlflowClient(tracking_uri, registry_uri=tracking_uri), uri)
    name = mv.name
    run_id = tag_id(mv, "run_id")
    run_json = Layout(Path(root)).run_record(run_id) if run_id else None
    if run_json is not None and run_json.is_file():
        export = json.loads(run_json.read_text()).get("export")
        if export and Path(export).is_dir():
            return run_id, lambda: export

    def download() -> Path:
        import mlflow.artifacts

        dst = Layout(Path(root)).registered_model(name, mv.version)
        if (dst / "MLmodel").is_file():
            return _pipeline_in(dst)
        # A models:/ URI is resolved by a client on the *global* registry URI, whatever
        # registry_uri says (MLflow 3.17): set it for the call, and put it back.
        with mlflow_uris(tracking_uri):
            got = mlflow.artifacts.download_artifacts(
                artifact_uri=f"models:/{name}/{mv.version}",
                dst_path=str(dst),
                tracking_uri=tracking_uri,
                registry_uri=tracking_uri,
            )
        return _pipeline_in(Path(got))

    return f"{name}-v{mv.version}", download


def _pipeline_in(model_dir: Path) -> Path:
    """The diffusers pipeline folder inside a downloaded pyfunc model (its `pipeline`
    artifact, named in MLmodel)."""
    import yaml

    spec = yaml.safe_load((model_dir / "MLmodel").read_text())
    rel = spec["flavors"]["python_function"]["artifacts"]["pipeline"]["path"]
    folder = (model_dir / rel).resolve()
    if not folder.is_relative_to(model_dir.resolve()):
        raise InputError(
            f"{model_dir / 'MLmodel'}: the pipeline artifact's path {rel!r} leaves the model's "
            "folder; refusing to load it"
        )
    return folder


def resolve_pipeline(model: str, tracking_uri: str, root: Path) -> tuple[str, Path]:
    """(identity, local pipeline folder) of a models:/ URI or an export folder.

    Raises:
        FileNotFoundError: a folder that holds no exported pipeline.
        ValueError: a models:/ URI of the wrong form.
    """
    if model.startswith("models:/"):
        ident, folder = registered_pipeline(tracking_uri, root, model)
        return ident, Path(folder())
    path = Path(model)
    if not (path / "model_index.json").is_file():
        raise MissingInput(
            f"--model {model}: not an exported pipeline (no model_index.json); pass "
            "models:/NAME@ALIAS, models:/NAME/VERSION or a folder written by `kiln train`"
        )
    return str(path.resolve()), path
