"""The human evaluation's Prefect tasks: create a comparison, wait for its votes, build the
report, and log it to MLflow (metrics on study A's training run, tags and the model card on its
registered versions). `flows/human_evaluation.py` runs them in order.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from human_eval.report import build_report
from human_eval.store import QUESTIONS, RatingStore
from human_eval.studies import create_comparison, load_study
from kiln_config import is_id
from tasks.registry.tracking import artifacts_url
from tasks.storage.layout import Layout

__all__ = [
    "category_metric_slug",
    "create_comparison_task",
    "log_to_mlflow",
    "mlflow_metrics",
    "report_task",
    "wait_for_votes",
]


@task(name="create-comparison", cache_policy=NO_CACHE)
def create_comparison_task(
    root: str,
    url: str | None,
    study_a: str,
    study_b: str,
    k: int,
    gold: int,
    name: str | None,
) -> str:
    """Create (or find) the comparison; idempotent, so a retried flow reuses it."""
    layout = Layout(Path(root))
    with RatingStore.open(layout.ratings_db(), url) as store:
        cid, created = create_comparison(
            store,
            load_study(study_a, layout.folder("eval")),
            load_study(study_b, layout.folder("eval")),
            raters_per_pair=k,
            gold=gold,
            name=name,
        )
    get_run_logger().info("comparison %s %s", cid, "created" if created else "exists")
    return cid


@task(name="wait-for-votes", cache_policy=NO_CACHE)
def wait_for_votes(root: str, url: str | None, cid: str, wait_s: float, poll_s: float) -> dict:
    """Poll the store until every pair has K votes or `wait_s` has passed."""
    log = get_run_logger()
    deadline = time.monotonic() + wait_s
    with RatingStore.open(Layout(Path(root)).ratings_db(), url) as store:
        while True:
            done, target = store.progress(cid)
            if done >= target or time.monotonic() >= deadline:
                break
            log.info("%s: %d of %d votes; next check in %.0f s", cid, done, target, poll_s)
            time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
    if done < target:
        log.warning("%s: deadline reached with %d of %d votes; reporting those", cid, done, target)
    return {"votes": done, "target": target, "complete": done >= target}


@task(name="build-human-eval-report", cache_policy=NO_CACHE)
def report_task(root: str, url: str | None, cid: str, min_gold: float, n: int, seed: int) -> dict:
    layout = Layout(Path(root))
    with RatingStore.open(layout.ratings_db(), url) as store:
        return build_report(
            store, cid, layout.comparison(cid), min_gold_accuracy=min_gold, n_resamples=n, seed=seed
        )


def _with_human_eval(description: str | None, report: dict) -> str:
    """The version's model card with its "Human evaluation" line set to this report."""

    def cell(q: str) -> str:
        c = report["questions"][q]["overall"]
        if c["pref"] is None:
            return f"{q}: no votes"
        return f"{q} preferred {c['pref']:.0%} (95% CI {c['ci_low']:.0%}–{c['ci_high']:.0%})"

    votes = report["questions"]["quality"]["overall"]["votes"]
    line = (
        f"**Human evaluation**: comparison `{report['comparison']}` against "
        f"`{report['model_b']}`: {cell('quality')}, {cell('alignment')}; {votes} votes from "
        f"{report['raters']['total'] - report['raters']['excluded']} raters."
    )
    lines = [
        ln for ln in (description or "").splitlines() if not ln.startswith("**Human evaluation**")
    ]
    return "\n".join([*lines, line])


def category_metric_slug(category: str) -> str:
    """A prompt category as a metric-name part: "Gary Marcus et al." -> gary_marcus_et_al."""
    return re.sub(r"[^a-z0-9]+", "_", category.lower()).strip("_") or "none"


def mlflow_metrics(report: dict) -> dict[str, float]:
    """The numbers the promotion gate reads, by their MLflow names (NaN-free)."""
    out: dict[str, float] = {}
    for q in QUESTIONS:
        cell, alpha = report["questions"][q]["overall"], report["questions"][q]["alpha"]
        for key, name in [
            ("pref", "pref"),
            ("ci_low", "pref_ci_low"),
            ("ci_high", "pref_ci_high"),
            ("tie_share", "tie_share"),
            ("votes", "votes"),
        ]:
            if cell[key] is not None:
                out[f"human_eval/{q}_{name}"] = float(cell[key])
        if alpha["value"] is not None:
            out[f"human_eval/{q}_alpha"] = float(alpha["value"])
        out[f"human_eval/{q}_min_votes_per_pair"] = float(cell.get("min_votes_per_pair", 0))
        for cat, c in report["questions"][q]["categories"].items():
            if c["pref"] is not None:
                out[f"human_eval/{q}_pref/{category_metric_slug(cat)}"] = float(c["pref"])
    out["human_eval/raters_excluded"] = float(report["raters"]["excluded"])
    return out


@task(name="log-human-eval", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def log_to_mlflow(tracking_uri: str, model_name: str, root: str, report: dict) -> dict:
    """Log the report on study A's training run and tag its registered versions.

    Logs to the existing run by id (no new run is opened); re-logging the same values is
    harmless, so the task retries.
    """
    from mlflow.tracking import MlflowClient

    model_a = report["model_a"]
    run_json = Layout(Path(root)).run_record(model_a) if is_id(model_a) else None
    if run_json is None or not run_json.is_file():
        get_run_logger().warning(
            "study A's model %r is not a training run under %s: nothing logged to MLflow",
            report["model_a"],
            root,
        )
        return {"mlflow_run_id": None, "versions": [], "chart_url": None}
    mlflow_run_id = json.loads(run_json.read_text())["mlflow_run_id"]
    client = MlflowClient(tracking_uri, registry_uri=tracking_uri)
    cid = report["comparison"]
    now = int(time.time() * 1000)
    for k, v in mlflow_metrics(report).items():
        client.log_metric(mlflow_run_id, k, v, timestamp=now)
    for name in ("preference.png", "votes.csv", "report.json"):
        client.log_artifact(mlflow_run_id, report["outputs"][name], f"human_eval/{cid}")
    client.set_tag(mlflow_run_id, "human_eval.comparison", cid)
    versions = [
        v
        for v in client.search_model_versions(f"run_id = '{mlflow_run_id}'")
        if v.name == model_name
    ]
    tags = {"human_eval.comparison": cid, "human_eval.against": report["model_b"]}
    for q in QUESTIONS:
        cell = report["questions"][q]["overall"]
        for key, tag in (("pref", "pref"), ("ci_low", "pref_ci_low")):
            if cell[key] is not None:  # no votes: no tag, never the string "None"
                tags[f"human_eval.{q}_{tag}"] = f"{cell[key]}"
    for v in versions:
        for k, val in tags.items():
            client.set_model_version_tag(model_name, v.version, k, val)
        card = _with_human_eval(v.description, report)
        client.update_model_version(model_name, v.version, description=card)

    experiment_id = client.get_run(mlflow_run_id).info.experiment_id
    chart = artifacts_url(
        tracking_uri, experiment_id, mlflow_run_id, f"human_eval/{cid}/preference.png"
    )
    return {
        "mlflow_run_id": mlflow_run_id,
        "versions": [v.version for v in versions],
        "chart_url": chart,
    }
