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

from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from flows.evaluate import study_id_for
from human_eval.store import QUESTIONS
from kiln_config import PipelineConfig, stable_hash
from kiln_config.errors import MissingInput
from tasks.evaluation.comparison import (
    create_comparison_task,
    log_to_mlflow,
    mlflow_metrics,
    report_task,
    wait_for_votes,
)
from tasks.inputs import prompts_file
from tasks.launch.accelerate import launch_generate
from tasks.registry.tracking import registered_pipeline
from tasks.storage.layout import Layout

__all__ = ["human_eval_flow", "study_for_model"]


def _pipeline_identity(folder: Path) -> str:
    """A hash of an exported pipeline folder's files (path, size, mtime), so that a model
    exported again into the same folder gets a new study instead of the old images.

    Raises:
        FileNotFoundError: The folder holds no diffusers pipeline (no model_index.json).
    """
    if not (folder / "model_index.json").is_file():
        # A stage's raw weights (final-raw/) sit beside its export (final/): point at it.
        export = folder.parent / "final"
        hint = f" (did you mean {export}?)" if (export / "model_index.json").is_file() else ""
        raise MissingInput(
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

    The prompts file is resolved here (`tasks.inputs.prompts_file`).

    Raises:
        ValueError: a URI that is not models:/NAME@ALIAS or models:/NAME/VERSION.
    """
    ev = cfg.evaluate.model_copy(update={"prompts_csv": prompts_file(cfg)})
    layout = Layout(Path(cfg.storage.root))
    if ref.startswith("models:/"):
        ident, pipeline = registered_pipeline(cfg.tracking_uri, layout.root, ref)
    else:
        ident = f"pipeline-{_pipeline_identity(Path(ref))}"
        pipeline = lambda: ref  # noqa: E731
    study_id = study_id_for(ident, ev)
    out = layout.study(study_id)
    if not (out / "study.json").is_file():
        launch_generate.fn(
            str(pipeline()),
            ev.prompts_csv,
            str(out),
            evaluate=ev,
            launch=cfg.launch,
            model_ref=ident,
        )
    return study_id


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
        cells = {
            "overall": report["questions"][q]["overall"],
            **report["questions"][q]["categories"],
        }
        for group, c in cells.items():
            lines.append(
                f"| {q} | {group} | {f(c['pref'])} | [{f(c['ci_low'])}, "
                f"{f(c['ci_high'])}] | {f(c['tie_share'])} | {c['votes']} | "
                f"{c['prompts']} |"
            )
    for q in QUESTIONS:
        a = report["questions"][q]["alpha"]
        lines.append(f"\nKrippendorff's alpha ({q}): {f(a['value'])} over {a['pairs']} pairs.")
    # The Prefect UI renders no local image: the chart opens in the MLflow UI, over http.
    link = f"[open in MLflow]({chart_url}), " if chart_url else ""
    lines.append(f"\nChart: {link}on disk `{report['outputs']['preference.png']}`")
    return "\n".join(lines)


@flow(name="kiln-human-eval", log_prints=True)
def human_eval_flow(
    config: PipelineConfig,
    study_a: str,
    study_b: str,
    wait_s: float = 0.0,
    poll_s: float = 60.0,
    raters_per_pair: int | None = None,
    gold: int | None = None,
    name: str | None = None,
) -> dict:
    """Compare study A (the candidate) with study B, wait for votes, report and log.

    Args:
        config: The loaded config (storage root, `human_eval` and `registry` sections).
        study_a: Study id under `<root>/eval/` or a study folder: the candidate.
        study_b: The model it would replace.
        wait_s: How long to wait for every pair's K votes (0: report what there is now).
        poll_s: Seconds between checks while waiting.
        raters_per_pair: K (default `human_eval.raters_per_pair`).
        gold: Attention checks per rater (default `human_eval.gold_per_rater`).
        name: Comparison id (default a hash of the studies and settings).
    """
    cfg = config
    he, r = cfg.human_eval, cfg.storage.root
    k = raters_per_pair or he.raters_per_pair
    n_gold = he.gold_per_rater if gold is None else gold
    cid = create_comparison_task(r, he.database_url, study_a, study_b, k, n_gold, name)
    wait = wait_for_votes(r, he.database_url, cid, wait_s, poll_s)
    report = report_task(
        r, he.database_url, cid, he.min_gold_accuracy, he.bootstrap_resamples, he.seed
    )
    logged = log_to_mlflow(cfg.tracking_uri, cfg.registry.model_name, r, report)
    create_markdown_artifact(
        key=f"human-eval-{cid}".lower().replace("_", "-"),
        markdown=_markdown(report, wait, logged["chart_url"]),
        description=f"Human evaluation {cid}",
    )
    return {
        "comparison": cid,
        "wait": wait,
        "mlflow": logged,
        "metrics": mlflow_metrics(report),
        "outputs": report["outputs"],
    }
