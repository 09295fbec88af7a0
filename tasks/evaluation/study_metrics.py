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

import csv
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

from mlflow.tracking import MlflowClient
from prefect import task
from prefect.cache_policies import NO_CACHE

from kiln_config import EvalMetricsConfig
from models.evaluation.image_metrics import (
    FID_RESIZE,
    MetricUnavailable,
    clip_resize,
    clip_score,
    decode_images,
    fid,
    files_sha256,
    hub_snapshot,
    images_as_uint8,
    load_clip,
    load_inception,
    read_val_split,
)
from tasks.launch.accelerate import launch_generate
from tasks.registry.tracking import artifacts_url
from tasks.runtime.logs import task_logger
from tasks.storage.layout import is_published

if TYPE_CHECKING:
    import torch

__all__ = ["compute_study_metrics", "log_study_metrics", "metrics_lineage", "metrics_report"]


# torch and models.evaluation.image_metrics are imported where the metrics are computed: every flow-run
# process that imports flows.evaluate (a deployment's pipeline or retrain) would otherwise pay
# about 2 s of torch's import before its first step.


def _device() -> torch.device:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _clip(study_dir: Path, items: list[dict], name: str | None) -> dict:
    if not name:
        return {"skipped": "evaluate.metrics.clip_model is not set (a local CLIP folder or hub id)"}

    model, processor = load_clip(name)
    model.to(_device())
    images = images_as_uint8(study_dir / it["path"] for it in items)
    prompts = (it["prompt"] for it in items)
    value = clip_score(zip(images, prompts, strict=True), model, processor)
    local = Path(name).expanduser()
    files = local if local.is_dir() else hub_snapshot(name)
    digest = files_sha256(files) if files else {"sha256": None}
    return {
        "value": value,
        "images": len(items),
        "model": name,
        **digest,
        "resize": clip_resize(processor),
    }


def _write_captions(path: Path, captions: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["Prompts", "Category"])
        w.writerows([c, "validation"] for c in captions)


def _fid(
    study_dir: Path,
    cfg: EvalMetricsConfig,
    val_dir: Path,
    generate: dict,
    feature: torch.nn.Module | None,
) -> dict:
    if feature is not None:
        weights = {"weights": f"given module {type(feature).__name__}", "sha256": None}
        resize = "the given feature module's own"
    elif not cfg.inception_weights:
        return {"skipped": "evaluate.metrics.inception_weights is not set (a local .pth path)"}
    else:
        feature = load_inception(cfg.inception_weights)
        weights = {"weights": cfg.inception_weights, **files_sha256(cfg.inception_weights)}
        resize = FID_RESIZE
    if not is_published(val_dir):
        raise MetricUnavailable(
            f"no validation split at {val_dir}; re-run `kiln shard` with shards.val_fraction > 0"
        )
    val = read_val_split(val_dir, cfg.fid_max_images)
    if len(val) < 2:
        raise MetricUnavailable(f"FID needs 2 or more validation images; {val_dir} has {len(val)}")
    out = study_dir / "fid"
    _write_captions(out / "prompts.csv", [s["caption"] for s in val])
    gen = launch_generate.fn(
        generate["pipeline"], str(out / "prompts.csv"), str(out), **generate["settings"]
    )
    fake = images_as_uint8(out / it["path"] for it in gen["items"])
    # On the device only now: the generation subprocess had the GPU to itself.
    real = decode_images(s["image"] for s in val)
    value = fid(real, fake, feature.to(_device()))
    return {
        "value": value,
        "images": len(val),
        "real": str(val_dir),
        "generated": str(out),
        **weights,
        "resize": resize,
        "generated_resolution": gen["settings"]["resolution"],
    }


@task(name="compute-study-metrics", cache_policy=NO_CACHE)
def compute_study_metrics(
    study_dir: str,
    items: list[dict],
    cfg: EvalMetricsConfig,
    val_dir: str,
    generate: dict,
    fid_feature: torch.nn.Module | None = None,
) -> dict:
    """CLIP score and FID of a study; writes and returns `<study>/metrics.json`'s content.

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
    import torch

    log = task_logger(__name__)
    study = Path(study_dir)
    result: dict = {"study_id": study.name}
    steps = (
        ("clip_score", lambda: _clip(study, items, cfg.clip_model)),
        ("fid", lambda: _fid(study, cfg, Path(val_dir), generate, fid_feature)),
    )
    for name, run in steps:
        t0 = time.perf_counter()
        try:
            result[name] = run()
        except MetricUnavailable as e:
            result[name] = {"skipped": str(e)}
        finally:  # give the cached GPU memory back before the next metric's launch
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if "skipped" in result[name]:
            log.warning("%s skipped: %s", name, result[name]["skipped"])
        else:
            result[name]["seconds"] = round(time.perf_counter() - t0, 2)
            log.info("%s = %.4f on %d images", name, result[name]["value"], result[name]["images"])
    tmp = study / "metrics.json.tmp"
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(study / "metrics.json")
    return result


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
