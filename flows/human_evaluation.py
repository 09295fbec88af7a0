"""Human evaluation flow: create a comparison, wait for the votes, report, log to MLflow.

    human_eval_flow(config, study_a, study_b, wait_s=...)

The wait is a polling task with a deadline (`wait_s`, checked every `poll_s`), not a Prefect
pause: collection takes days, and a polling task needs no one to resume it in the UI. It
ends early once every pair has K votes; at the deadline the report is built from what there
is (its vote counts say so). Raters get their links from `kiln rate invite`, never from the
flow: a link is a credential and would otherwise land in Prefect's logs.

The report goes to:
- `<root>/human_eval/<comparison>/{report.json, votes.csv, preference.png}`;
- a Prefect markdown artifact `human-eval-<comparison>` (the table and the chart's path);
- MLflow, on study A's training run (A is the candidate): metrics `human_eval/<q>_pref`,
  `human_eval/<q>_pref_ci_low`, `human_eval/<q>_pref_ci_high`, `human_eval/<q>_tie_share`,
  `human_eval/<q>_votes`, `human_eval/<q>_alpha` for q in quality and alignment, plus
  `human_eval/raters_excluded`; the PNG and CSV as artifacts under `human_eval/<comparison>/`;
  and tags `human_eval.comparison`, `human_eval.quality_pref`, ... on every registered
  version of that run. The registry's promotion gate reads these names.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from flows.config import PipelineConfig, as_config
from human_eval.report import build_report
from human_eval.store import QUESTIONS, RatingStore
from human_eval.studies import create_comparison, load_study

__all__ = ["category_slug", "human_eval_flow", "is_model_ref", "mlflow_metrics", "study_for_model"]


def is_model_ref(ref: str) -> bool:
    """A registered model URI (models:/name@alias, models:/name/3) or a folder that is not a
    study, rather than a study. A folder without study.json is taken for a pipeline, so that
    one without model_index.json either is named as neither (`_pipeline_identity`) instead of
    being looked up as a study id."""
    if ref.startswith("models:/"):
        return True
    folder = Path(ref)
    return (folder / "model_index.json").is_file() or (
        folder.is_dir() and not (folder / "study.json").is_file()
    )


def _pipeline_identity(folder: Path) -> str:
    """A hash of an exported pipeline folder's files (path, size, mtime), so that a model
    exported again into the same folder gets a new study instead of the old images.

    Raises:
        FileNotFoundError: The folder holds no diffusers pipeline (no model_index.json).
    """
    from models.config import stable_hash

    if not (folder / "model_index.json").is_file():
        # A stage's raw weights (final-raw/) sit beside its export (final/): point at it.
        export = folder.parent / "final"
        hint = f" (did you mean {export}?)" if (export / "model_index.json").is_file() else ""
        raise FileNotFoundError(
            f"{folder} is not an exported pipeline (no model_index.json) nor a study (no "
            f"study.json){hint}: pass a study id, models:/NAME@ALIAS, models:/NAME/VERSION or "
            "a pipeline folder written by `kiln train` (a stage's final/)"
        )
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    stats = [(str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return stable_hash([str(folder.resolve()), stats], 8)


def study_for_model(cfg: PipelineConfig, ref: str) -> str:
    """The study id of a model: found when it exists, else generated with `evaluate`'s
    prompts, seeds and settings (content-addressed, so asking twice reuses the images).

    A registered version that names its training run (the `run_id` tag `kiln register`
    writes) and whose run is under the root gets that run's study id, the one
    `kiln evaluate --run-id` writes; another version is downloaded from the registry; a
    pipeline folder is named by a hash of its path.

    `cfg` has passed `check_inputs` for the `evaluate` step (its prompts file is resolved).

    Raises:
        ValueError: a URI that is not models:/NAME@ALIAS or models:/NAME/VERSION.
    """
    from flows.evaluate import study_id_for
    from tasks.launch import launch_generate
    from tasks.layout import Layout
    from tasks.registry import registered_pipeline

    ev, layout = cfg.evaluate, Layout(Path(cfg.storage.root))
    if ref.startswith("models:/"):
        ident, pipeline = registered_pipeline(cfg.tracking_uri, layout.root, ref)
    else:
        ident = f"pipeline-{_pipeline_identity(Path(ref))}"
        pipeline = lambda: ref  # noqa: E731
    study_id = study_id_for(ident, ev)
    out = layout.study(study_id)
    if not (out / "study.json").is_file():
        launch_generate.fn(str(pipeline()), ev.prompts_csv, str(out), evaluate=ev,
                           launch=cfg.launch, model_ref=ident)  # fmt: skip
    return study_id


@task(name="create-comparison", cache_policy=NO_CACHE)
def create_comparison_task(
    root: str, url: str | None, study_a: str, study_b: str, k: int, gold: int,
    name: str | None, seed: int,
) -> str:  # fmt: skip
    """Create (or find) the comparison; idempotent, so a retried flow reuses it."""
    with RatingStore.open(root, url) as store:
        cid, created = create_comparison(
            store, load_study(study_a, root), load_study(study_b, root),
            raters_per_pair=k, gold=gold, name=name, seed=seed,
        )  # fmt: skip
    get_run_logger().info("comparison %s %s", cid, "created" if created else "exists")
    return cid


@task(name="wait-for-votes", cache_policy=NO_CACHE)
def wait_for_votes(root: str, url: str | None, cid: str, wait_s: float, poll_s: float) -> dict:
    """Poll the store until every pair has K votes or `wait_s` has passed."""
    log = get_run_logger()
    deadline = time.monotonic() + wait_s
    with RatingStore.open(root, url) as store:
        while True:
            done, target = store.progress(cid)
            if done >= target or time.monotonic() >= deadline:
                break
            log.info("%s: %d of %d votes; next check in %.0f s", cid, done, target, poll_s)
            time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
    if done < target:
        log.warning("%s: deadline reached with %d of %d votes; reporting those", cid, done,
                    target)  # fmt: skip
    return {"votes": done, "target": target, "complete": done >= target}


@task(name="build-human-eval-report", cache_policy=NO_CACHE)
def report_task(root: str, url: str | None, cid: str, min_gold: float, n: int, seed: int) -> dict:
    out = Path(root) / "human_eval" / cid
    with RatingStore.open(root, url) as store:
        return build_report(store, cid, out, min_gold_accuracy=min_gold, n_resamples=n,
                            seed=seed)  # fmt: skip


def _with_human_eval(description: str | None, report: dict) -> str:
    """The version's model card with its "Human evaluation" line set to this report."""

    def cell(q: str) -> str:
        c = report["questions"][q]["overall"]
        if c["pref"] is None:
            return f"{q}: no votes"
        return f"{q} preferred {c['pref']:.0%} (95% CI {c['ci_low']:.0%}–{c['ci_high']:.0%})"

    votes = report["questions"]["quality"]["overall"]["votes"]
    line = (f"**Human evaluation**: comparison `{report['comparison']}` against "
            f"`{report['model_b']}`: {cell('quality')}, {cell('alignment')}; {votes} votes from "
            f"{report['raters']['total'] - report['raters']['excluded']} raters.")  # fmt: skip
    lines = [ln for ln in (description or "").splitlines()
             if not ln.startswith("**Human evaluation**")]  # fmt: skip
    return "\n".join([*lines, line])


def category_slug(category: str) -> str:
    """A DrawBench category as a metric-name part: "Gary Marcus et al." -> gary_marcus_et_al."""
    return re.sub(r"[^a-z0-9]+", "_", category.lower()).strip("_") or "none"


def mlflow_metrics(report: dict) -> dict[str, float]:
    """The numbers the promotion gate reads, by their MLflow names (NaN-free)."""
    out: dict[str, float] = {}
    for q in QUESTIONS:
        cell, alpha = report["questions"][q]["overall"], report["questions"][q]["alpha"]
        for key, name in [("pref", "pref"), ("ci_low", "pref_ci_low"),
                          ("ci_high", "pref_ci_high"), ("tie_share", "tie_share"),
                          ("votes", "votes")]:  # fmt: skip
            if cell[key] is not None:
                out[f"human_eval/{q}_{name}"] = float(cell[key])
        if alpha["value"] is not None:
            out[f"human_eval/{q}_alpha"] = float(alpha["value"])
        out[f"human_eval/{q}_min_votes_per_pair"] = float(cell.get("min_votes_per_pair", 0))
        for cat, c in report["questions"][q]["categories"].items():
            if c["pref"] is not None:
                out[f"human_eval/{q}_pref/{category_slug(cat)}"] = float(c["pref"])
    out["human_eval/raters_excluded"] = float(report["raters"]["excluded"])
    return out


@task(name="log-human-eval", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def log_to_mlflow(tracking_uri: str, model_name: str, root: str, report: dict) -> dict:
    """Log the report on study A's training run and tag its registered versions.

    Logs to the existing run by id (no new run is opened); re-logging the same values is
    harmless, so the task retries.
    """
    from mlflow.tracking import MlflowClient

    run_json = Path(root) / "runs" / report["model_a"] / "run.json"
    if not run_json.is_file():
        get_run_logger().warning("study A's model %r is not a training run under %s: nothing "
                                 "logged to MLflow", report["model_a"], root)  # fmt: skip
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
        v for v in client.search_model_versions(f"run_id = '{mlflow_run_id}'")
        if v.name == model_name
    ]  # fmt: skip
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
    from tasks.registry import artifacts_url

    experiment_id = client.get_run(mlflow_run_id).info.experiment_id
    chart = artifacts_url(tracking_uri, experiment_id, mlflow_run_id,
                          f"human_eval/{cid}/preference.png")  # fmt: skip
    return {"mlflow_run_id": mlflow_run_id, "versions": [v.version for v in versions],
            "chart_url": chart}  # fmt: skip


def _markdown(report: dict, wait: dict, chart_url: str | None = None) -> str:
    lines = [
        f"# Human evaluation {report['comparison']}",
        f"A: `{report['study_a']}` ({report['model_a']}) vs B: `{report['study_b']}` "
        f"({report['model_b']}); {wait['votes']} of {wait['target']} tasks answered; "
        f"{report['raters']['excluded']} of {report['raters']['total']} raters left out "
        f"(gold accuracy below {report['raters']['min_gold_accuracy']}).",
        "",
        "| question | group | A preferred | 95% CI | ties | votes | prompts |",
        "|---|---|---|---|---|---|---|",
    ]

    def f(x):
        return "-" if x is None else f"{x:.3f}"

    for q in QUESTIONS:
        cells = {"overall": report["questions"][q]["overall"],
                 **report["questions"][q]["categories"]}  # fmt: skip
        for group, c in cells.items():
            lines.append(f"| {q} | {group} | {f(c['pref'])} | [{f(c['ci_low'])}, "
                         f"{f(c['ci_high'])}] | {f(c['tie_share'])} | {c['votes']} | "
                         f"{c['prompts']} |")  # fmt: skip
    for q in QUESTIONS:
        a = report["questions"][q]["alpha"]
        lines.append(f"\nKrippendorff's alpha ({q}): {f(a['value'])} over {a['pairs']} pairs.")
    # The Prefect UI renders no local image: the chart opens in the MLflow UI, over http.
    link = f"[open in MLflow]({chart_url}), " if chart_url else ""
    lines.append(f"\nChart: {link}on disk `{report['outputs']['preference.png']}`")
    return "\n".join(lines)


@flow(name="kiln-human-eval", log_prints=True)
def human_eval_flow(
    config: PipelineConfig | str,
    study_a: str,
    study_b: str,
    root: str | None = None,
    wait_s: float = 0.0,
    poll_s: float = 60.0,
    raters_per_pair: int | None = None,
    gold: int | None = None,
    name: str | None = None,
) -> dict:
    """Compare study A (the candidate) with study B, wait for votes, report and log.

    Args:
        config: The loaded config, or a pipeline YAML path (storage root, `human_eval` and
            `registry` sections).
        study_a: Study id under `<root>/eval/` or a study folder: the candidate.
        study_b: The model it would replace.
        root: With a path: overrides `storage.root`.
        wait_s: How long to wait for every pair's K votes (0: report what there is now).
        poll_s: Seconds between checks while waiting.
        raters_per_pair: K (default `human_eval.raters_per_pair`).
        gold: Attention checks per rater (default `human_eval.gold_per_rater`).
        name: Comparison id (default a hash of the studies and settings).
    """
    cfg = as_config(config, root=root)
    he, r = cfg.human_eval, cfg.storage.root
    k = raters_per_pair or he.raters_per_pair
    n_gold = he.gold_per_rater if gold is None else gold
    cid = create_comparison_task(r, he.database_url, study_a, study_b, k, n_gold, name, he.seed)
    wait = wait_for_votes(r, he.database_url, cid, wait_s, poll_s)
    report = report_task(r, he.database_url, cid, he.min_gold_accuracy,
                         he.bootstrap_resamples, he.seed)  # fmt: skip
    logged = log_to_mlflow(cfg.tracking_uri, cfg.registry.model_name, r, report)
    create_markdown_artifact(key=f"human-eval-{cid}".lower().replace("_", "-"),
                             markdown=_markdown(report, wait, logged["chart_url"]),
                             description=f"Human evaluation {cid}")  # fmt: skip
    return {"comparison": cid, "wait": wait, "mlflow": logged,
            "metrics": mlflow_metrics(report), "outputs": report["outputs"]}  # fmt: skip
