"""The human evaluation commands: `kiln compare` and `kiln rate {serve, invite, report}`.

    kiln compare --config C --a STUDY --b STUDY          -> prints the comparison id
    kiln rate invite --config C --comparison ID --raters N   -> one link per rater
    kiln rate serve --config C                            -> the rating app + admin link
    kiln rate report --config C --comparison ID           -> <root>/human_eval/ID/

A study is `kiln evaluate` output: an id under `<root>/eval/` or a study folder. Like every
`kiln` command they take `--config` and `--root`; the store is `human_eval.database_url`, by
default `<root>/human_eval/ratings.db`. Heavy modules are imported inside the commands, so
`kiln --help` stays fast.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import click

from flows.cli_options import CONFIG, ROOT

__all__ = ["compare", "evaluate_model", "rate"]

COMPARISON = click.option("--comparison", required=True, help="Comparison id (kiln compare).")


@contextmanager
def _one_line():
    """Expected failures (a missing study, a mismatch, the registry's errors) as one line."""
    try:
        yield
    except (FileNotFoundError, ValueError, LookupError) as e:
        raise click.ClickException(str(e)) from None
    except Exception as e:  # MlflowException, LaunchError: without importing their modules here
        name = type(e).__name__
        if name == "MlflowException":
            raise click.ClickException(f"registry: {e}") from None
        if name == "LaunchError":  # generating a missing study failed: its last output lines
            raise click.ClickException(f"generating the study failed: {e}") from None
        raise


def _load(config_path: str, root: str | None):
    """(config, ratings store) or one clear line."""
    from flows.config import ConfigError, load_config
    from human_eval.store import RatingStore

    try:
        cfg = load_config(config_path, root=root)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    store = RatingStore.open(cfg.storage.root, cfg.human_eval.database_url)
    click.get_current_context().call_on_close(store.close)  # however the command ends
    return cfg, store


@click.command()
@CONFIG
@ROOT
@click.option(
    "--a", "study_a", required=True,
    help="A (e.g. the candidate): a study id or folder, models:/NAME@ALIAS or a pipeline folder.",
)  # fmt: skip
@click.option(
    "--b", "study_b", required=True,
    help="B (e.g. the champion): a study id or folder, models:/NAME@ALIAS or a pipeline folder.",
)  # fmt: skip
@click.option(
    "--raters-per-pair", type=int, default=None, help="Votes per pair, K (default: config)."
)
@click.option(
    "--gold", type=int, default=None, help="Attention checks per rater (default: config)."
)
@click.option("--name", default=None, help="Comparison id (default: a hash of the studies).")
def compare(
    config_path: str,
    root: str | None,
    study_a: str,
    study_b: str,
    raters_per_pair: int | None,
    gold: int | None,
    name: str | None,
) -> None:
    """Create the blind A/B comparison of two studies with the same prompts and seeds.

    A side may also be a model (models:/NAME@ALIAS, models:/NAME/VERSION or an exported
    pipeline folder): its study is generated first with `evaluate`'s settings, unless it
    exists.
    """
    from flows.human_evaluation import is_model_ref, study_for_model
    from human_eval.studies import create_comparison, load_study

    cfg, store = _load(config_path, root)
    he = cfg.human_eval
    with _one_line():
        if is_model_ref(study_a):
            study_a = study_for_model(cfg, study_a)
        if is_model_ref(study_b):
            study_b = study_for_model(cfg, study_b)
        a = load_study(study_a, cfg.storage.root)
        b = load_study(study_b, cfg.storage.root)
        cid, created = create_comparison(
            store, a, b,
            raters_per_pair=raters_per_pair or he.raters_per_pair,
            gold=he.gold_per_rater if gold is None else gold,
            name=name, seed=he.seed,
        )  # fmt: skip
    click.echo(f"{'created' if created else 'exists:'} {a.study_id} (A) vs {b.study_id} (B)",
               err=True)  # fmt: skip
    click.echo(cid)


def evaluate_model(config_path: str, root: str | None, model: str) -> None:
    """`kiln evaluate --model URI`: the study of any registered model or pipeline folder.

    Generated with the config's `evaluate` settings unless it exists (content-addressed);
    prints {"study_id", "path"} as JSON, or one clear line on error.
    """
    from flows.human_evaluation import study_for_model

    cfg, _ = _load(config_path, root)
    with _one_line():
        study_id = study_for_model(cfg, model)
    path = Path(cfg.storage.root) / "eval" / study_id
    click.echo(json.dumps({"study_id": study_id, "path": str(path)}, indent=2))


@click.group()
def rate() -> None:
    """Blind A/B human evaluation: serve the rating app, invite raters, report."""


@rate.command()
@CONFIG
@ROOT
@click.option("--host", default=None, help="Listen address (default: human_eval.host).")
@click.option("--port", type=int, default=None, help="Port (default: human_eval.port, 8765).")
def serve(config_path: str, root: str | None, host: str | None, port: int | None) -> None:
    """Serve the rating pages; prints the admin link (never part of a rater link)."""
    from human_eval.app import serve as run_app

    cfg, store = _load(config_path, root)
    host, port = host or cfg.human_eval.host, port or cfg.human_eval.port
    click.echo(f"Rating app at http://{host}:{port}/rate/<token> (kiln rate invite)")
    click.echo(f"Admin page: http://{host}:{port}/admin/{store.admin_token()}")
    he = cfg.human_eval  # the admin page's running result: the report's settings
    run_app(store, host, port, min_gold_accuracy=he.min_gold_accuracy,
            n_resamples=he.bootstrap_resamples, seed=he.seed)  # fmt: skip


@rate.command()
@CONFIG
@ROOT
@COMPARISON
@click.option("--raters", type=int, required=True, help="Number of rater links to create.")
@click.option("--host", default=None, help="Host in the links (default: human_eval.host).")
@click.option("--port", type=int, default=None, help="Port in the links (default: config).")
def invite(
    config_path: str,
    root: str | None,
    comparison: str,
    raters: int,
    host: str | None,
    port: int | None,
) -> None:
    """Print one rating link per new rater: http://HOST:PORT/rate/<token>."""
    cfg, store = _load(config_path, root)
    if raters < 1:
        raise click.UsageError(f"--raters must be at least 1 (got {raters})")
    host, port = host or cfg.human_eval.host, port or cfg.human_eval.port
    try:
        links = store.add_raters(comparison, raters)
    except KeyError as e:
        raise click.ClickException(e.args[0]) from None
    for pseudonym, token in links:
        click.echo(f"{pseudonym}\thttp://{host}:{port}/rate/{token}")


@rate.command()
@CONFIG
@ROOT
@COMPARISON
def report(config_path: str, root: str | None, comparison: str) -> None:
    """Write report.json, votes.csv and preference.png under <root>/human_eval/<comparison>/."""
    from human_eval.report import build_report

    cfg, store = _load(config_path, root)
    he = cfg.human_eval
    out = Path(cfg.storage.root) / "human_eval" / comparison
    try:
        result = build_report(store, comparison, out, min_gold_accuracy=he.min_gold_accuracy,
                              n_resamples=he.bootstrap_resamples, seed=he.seed)  # fmt: skip
    except KeyError as e:
        raise click.ClickException(e.args[0]) from None
    summary = {
        q: {k: v["overall"][k] for k in ("pref", "ci_low", "ci_high", "tie_share", "votes")}
        for q, v in result["questions"].items()
    }
    summary["raters_excluded"] = result["raters"]["excluded"]
    summary["outputs"] = result["outputs"]
    click.echo(json.dumps(summary, indent=2, default=str))


# `python -m flows.rate_cli rate serve ...` works on its own; `kiln` adds both commands.
cli = click.Group("kiln-rate", commands={"rate": rate, "compare": compare})

if __name__ == "__main__":
    cli()
