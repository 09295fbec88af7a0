"""CLIP score and FID of an evaluation study, written to `<study>/metrics.json` and logged to
the training run's MLflow run.

FID compares the validation split of the model's final stage (held out from training) with
images generated from the same validation captions (the COCO-FID protocol, so both sets show
the same content), `min(evaluate.metrics.fid_max_images, validation images)` of each. The
generated set lives in `<study>/fid/` and is reused by a second evaluation. CLIP score reads
the study's own images and prompts.

A metric whose weights are not configured, missing or unloadable is skipped: its entry holds
`skipped` (the reason, naming the fix) and the evaluation goes on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

from mlflow.tracking import MlflowClient
from prefect import task
from prefect.cache_policies import NO_CACHE

from kiln_config import EvalMetricsConfig
from tasks.launch.accelerate import launch_generate
from tasks.registry.tracking import artifacts_url
from tasks.runtime.logs import task_logger
from tasks.storage.layout import is_published

if TYPE_CHECKING:
    import torch

__all__ = ["compute_study_metrics", "log_study_metrics", "metrics_lineage", "metrics_report"]


@task(name="compute-study-metrics", cache_policy=NO_CACHE)
def compute_study_metrics(
    study_dir: str,
    items: list[dict],
    cfg: EvalMetricsConfig,
    val_dir: str,
    generate: dict,
    fid_feature: torch.nn.Module | None = None,
) -> dict:
    """CLIP score and FID of a study (`models.evaluation.study_metrics`); writes and returns
    `<study>/metrics.json`'s content.

    Args:
        study_dir: The study folder (images/, study.json).
        items: study.json's items.
        cfg: `evaluate.metrics`.
        val_dir: The validation split at the model's final resolution.
        generate: {"pipeline": export folder, "settings": launch_generate's keyword
            arguments}: how to generate FID's images from the validation captions.
        fid_feature: FID's feature extractor instead of the Inception weights (an nn.Module
            with `num_features`, taking uint8 images): a seam for tests and other networks.
    """
    # torch and the metric networks load here, when a study's metrics are computed: every
    # flow-run process that imports flows.evaluate (a deployment's pipeline or retrain) would
    # otherwise pay about 2 s of torch's import before its first step.
    from models.evaluation.study_metrics import study_metrics

    def generated(prompts: Path, out: Path) -> dict:
        return launch_generate.fn(
            generate["pipeline"], str(prompts), str(out), **generate["settings"]
        )

    split = Path(val_dir)
    return study_metrics(
        Path(study_dir),
        items,
        cfg,
        split,
        is_published(split),
        generated,
        fid_feature,
        task_logger(__name__),
    )


def _tags(study_id: str, metrics: dict) -> dict[str, str]:
    tags = {"kiln.eval.study_id": study_id}
    for name in ("clip_score", "fid"):
        m = metrics.get(name, {})
        if "skipped" in m:
            tags[f"kiln.eval.{name}_skipped"] = m["skipped"][:5000]
        else:
            tags[f"kiln.eval.{name}_sha256"] = str(m.get("sha256"))
            tags[f"kiln.eval.{name}_resize"] = m["resize"]
    return tags


@task(name="log-study-metrics", cache_policy=NO_CACHE)
def log_study_metrics(
    tracking_uri: str, mlflow_run_id: str, study_dir: str, metrics: dict, sheets: list[str]
) -> str | None:
    """Log a study's metrics (`eval/clip_score`, `eval/fid`), their weights' sha256 and resize
    modes (tags), metrics.json and the contact sheets (artifacts under `eval/<study_id>/`)
    into the training run. Returns the MLflow UI link to the sheets, or None when logging
    failed: a warning says why, and the study stays on disk."""
    study = Path(study_dir)
    try:
        client = MlflowClient(tracking_uri)
        values = {
            f"eval/{k}": metrics[k]["value"]
            for k in ("clip_score", "fid")
            if "value" in metrics.get(k, {})
        }
        for k, v in values.items():
            client.log_metric(mlflow_run_id, k, v)
        for k, v in _tags(study.name, metrics).items():
            client.set_tag(mlflow_run_id, k, v)
        base = f"eval/{study.name}"
        client.log_artifact(mlflow_run_id, str(study / "metrics.json"), base)
        for s in sheets:
            client.log_artifact(mlflow_run_id, s, f"{base}/contact")
        exp_id = client.get_run(mlflow_run_id).info.experiment_id
    except Exception as e:  # noqa: BLE001 - the study and its metrics are on disk either way
        task_logger(__name__).warning(
            "study %s not logged to MLflow (%s: %s); it stays at %s. Check "
            "registry.tracking_uri and that its server is reachable.",
            study.name,
            type(e).__name__,
            e,
            study,
        )
        return None
    return artifacts_url(tracking_uri, exp_id, mlflow_run_id, f"{base}/contact")


def metrics_lineage(study_dir: Path) -> dict[str, str]:
    """A study's metrics as registry tags for the registered version (next to `study_id`):
    each computed metric's value and weights' sha256; {} when the study has no metrics."""
    path = study_dir / "metrics.json"
    if not path.is_file():
        return {}
    metrics = json.loads(path.read_text())
    out = {}
    for name in ("clip_score", "fid"):
        m = metrics.get(name, {})
        if "value" in m:
            out[f"eval.{name}"] = f"{m['value']:.6g}"
            out[f"eval.{name}_sha256"] = str(m.get("sha256"))
    return out


def _metric_row(label: str, m: dict) -> str:
    if "skipped" in m:
        reason = m["skipped"].replace("|", "\\|").replace("\n", " ")  # one table cell
        return f"| {label} | skipped: {reason} | | | |"
    sha = m.get("sha256")
    return (
        f"| {label} | {m['value']:.4f} | {m['images']} | "
        f"{f'`{sha[:16]}`' if sha else '-'} | {m['resize']} |"
    )


def metrics_report(metrics: dict, sheets: dict[str, Path], url: str | None) -> str:
    """The study artifact's second half: the contact sheets (MLflow links when logged, paths
    on disk always) and the metrics, each with its value or the reason it was skipped."""
    if url:
        links = [
            f"- [{c or 'uncategorised'}]({url}/{quote(p.name)}) `{p}`" for c, p in sheets.items()
        ]
        where = (
            "Contact sheets, logged to the training run's MLflow run (a local tracking store "
            "needs `kiln mlflow-ui` running):"
        )
    else:
        links = [f"- {c or 'uncategorised'}: `{p}`" for c, p in sheets.items()]
        where = "Contact sheets (not logged to MLflow; see the flow's log):"
    rows = [
        _metric_row("CLIP score", metrics.get("clip_score", {"skipped": "not computed"})),
        _metric_row("FID", metrics.get("fid", {"skipped": "not computed"})),
    ]
    return "\n".join(
        [
            "### Contact sheets\n",
            where,
            *links,
            "",
            "### Metrics\n",
            "| metric | value | images | weights sha256 | resize |",
            "|---|---|---:|---|---|",
            *rows,
        ]
    )
