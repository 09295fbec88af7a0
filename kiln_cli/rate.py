"""The human evaluation commands: `kiln compare` and `kiln rate {serve, invite, report}`.

    kiln compare --config C --a STUDY --b STUDY          -> prints the comparison id
    kiln rate invite --config C --comparison ID --raters N   -> one link per rater
    kiln rate serve --config C                            -> the rating app
    kiln rate admin-link --config C [--rotate]            -> the admin page's link
    kiln rate revoke --config C --comparison ID --rater R -> that rater's link stops working
    kiln rate report --config C --comparison ID           -> <root>/human_eval/ID/

A study is `kiln evaluate` output: an id under `<root>/eval/` or a study folder. Like every
`kiln` command they take `--config` and `--root`; the store is `human_eval.database_url`, by
default `<root>/human_eval/ratings.db`.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from human_eval.app import serve as run_app
from human_eval.report import build_report
from human_eval.store import RatingStore
from human_eval.studies import create_comparison, is_model_ref, load_study
from kiln_cli.options import (
    CliError,
    ConfigDefault,
    config_options,
    load_for_command,
    study_for_model,
)
from kiln_config.errors import KilnError
from tasks.evaluation.proxy_scores import pair_proxy_scores
from tasks.storage.layout import Layout

__all__ = ["compare", "rate"]

COMPARISON = click.option("--comparison", required=True, help="Comparison id (kiln compare).")


def _load(config_path: str, root: str | None, step: str | None = None):
    """(config, ratings store); the store closes however the command ends."""
    cfg = load_for_command(config_path, root, step)
    store = RatingStore.open(
        Layout(Path(cfg.storage.root)).ratings_db(), cfg.human_eval.database_url
    )
    click.get_current_context().call_on_close(store.close)
    return cfg, store


@click.command()
@config_options
@click.option(
    "--a",
    "study_a",
    required=True,
    help="A (e.g. the candidate): a study id or folder, models:/NAME@ALIAS or a pipeline folder.",
)
@click.option(
    "--b",
    "study_b",
    required=True,
    help="B (e.g. the champion): a study id or folder, models:/NAME@ALIAS or a pipeline folder.",
)
@click.option(
    "--raters-per-pair",
    type=int,
    cls=ConfigDefault,
    field="human_eval.raters_per_pair",
    help="Votes per pair, K.",
)
@click.option(
    "--gold",
    type=int,
    cls=ConfigDefault,
    field="human_eval.gold_per_rater",
    help="Attention checks per rater.",
)
@click.option("--name", default=None, help="Comparison id (default: a hash of the studies).")
def compare(
    config_path: str, root: str | None, study_a: str, study_b: str, name: str | None
) -> None:
    """Create the blind A/B comparison of two studies with the same prompts and seeds.

    A side may also be a model (models:/NAME@ALIAS, models:/NAME/VERSION or an exported
    pipeline folder): its study is generated first with `evaluate`'s settings, unless it
    exists.
    """
    models = [is_model_ref(study_a), is_model_ref(study_b)]
    cfg, store = _load(config_path, root, "evaluate" if any(models) else None)
    he = cfg.human_eval  # --raters-per-pair and --gold applied
    if any(models):
        study_a = study_for_model(cfg, study_a) if models[0] else study_a
        study_b = study_for_model(cfg, study_b) if models[1] else study_b
    studies = Layout(Path(cfg.storage.root)).folder("eval")
    a, b = load_study(study_a, studies), load_study(study_b, studies)
    cid, created = create_comparison(
        store,
        a,
        b,
        raters_per_pair=he.raters_per_pair,
        gold=he.gold_per_rater,
        name=name,
    )
    click.echo(
        f"{'created' if created else 'exists:'} {a.study_id} (A) vs {b.study_id} (B)", err=True
    )
    click.echo(cid)


@click.group()
def rate() -> None:
    """Blind A/B human evaluation: serve the rating app, invite raters, report."""


@rate.command()
@config_options
@click.option("--host", cls=ConfigDefault, field="human_eval.host", help="Listen address.")
@click.option("--port", type=int, cls=ConfigDefault, field="human_eval.port", help="Port.")
def serve(config_path: str, root: str | None) -> None:
    """Serve the rating pages (the links: `kiln rate invite` and `kiln rate admin-link`)."""
    cfg, store = _load(config_path, root)
    host, port = cfg.human_eval.host, cfg.human_eval.port  # --host and --port applied
    # No token is printed: a service's output lands in its logs.
    click.echo(f"Rating app at http://{host}:{port}/rate/<token> (kiln rate invite)")
    click.echo(f"Admin page at http://{host}:{port}/admin/<token> (kiln rate admin-link)")
    he = cfg.human_eval  # the admin page's running result: the report's settings
    run_app(
        store,
        host,
        port,
        min_gold_accuracy=he.min_gold_accuracy,
        n_resamples=he.bootstrap_resamples,
        seed=he.seed,
        bad_links_per_minute=he.bad_links_per_minute,
    )


@rate.command("admin-link")
@config_options
@click.option("--rotate", is_flag=True, help="Replace the admin link; the old one stops working.")
@click.option("--host", cls=ConfigDefault, field="human_eval.host", help="Host in the link.")
@click.option(
    "--port", type=int, cls=ConfigDefault, field="human_eval.port", help="Port in the link."
)
def admin_link(config_path: str, root: str | None, rotate: bool) -> None:
    """Print the admin page's link: made the first time; with --rotate, a new one replaces
    it. The store keeps only its hash, so an existing link cannot be shown again."""
    cfg, store = _load(config_path, root)
    token = store.new_admin_token(rotate=rotate)
    if token is None:
        raise CliError(
            "an admin link exists, and only its hash is stored: pass --rotate to make a new "
            "one (the old link stops working)"
        )
    click.echo(f"{_link_base(cfg)}/admin/{token}")


@rate.command()
@config_options
@COMPARISON
@click.option("--raters", type=int, required=True, help="Number of rater links to create.")
@click.option("--host", cls=ConfigDefault, field="human_eval.host", help="Host in the links.")
@click.option(
    "--port", type=int, cls=ConfigDefault, field="human_eval.port", help="Port in the links."
)
def invite(config_path: str, root: str | None, comparison: str, raters: int) -> None:
    """Print one rating link per new rater: <human_eval.public_url>/rate/<token>, by default
    http://HOST:PORT/rate/<token>."""
    cfg, store = _load(config_path, root)
    if raters < 1:
        raise click.UsageError(f"--raters must be at least 1 (got {raters})")
    links = store.add_raters(comparison, raters)
    for pseudonym, token in links:
        click.echo(f"{pseudonym}\t{_link_base(cfg)}/rate/{token}")


@rate.command()
@config_options
@COMPARISON
@click.option("--rater", "pseudonym", required=True, help="The rater's name in the links (r003).")
def revoke(config_path: str, root: str | None, comparison: str, pseudonym: str) -> None:
    """Stop one rater's link from working (a running app within seconds); the answers they
    gave are kept, and the report's gold check still judges them."""
    _, store = _load(config_path, root)
    answers = store.revoke_rater(comparison, pseudonym)
    if answers is None:
        raise CliError(
            f"comparison {comparison} has no rater {pseudonym} with a working link "
            "(`kiln rate report` lists its raters)"
        )
    click.echo(f"{pseudonym}: link revoked; their {answers} answers are kept")


def _link_base(cfg) -> str:
    """Where the printed links point: `human_eval.public_url`, else the app's own address
    (--host and --port applied)."""
    he = cfg.human_eval
    return he.public_url or f"http://{he.host}:{he.port}"


@rate.command()
@config_options
@COMPARISON
def report(config_path: str, root: str | None, comparison: str) -> None:
    """Write report.json, votes.csv and preference.png under <root>/human_eval/<comparison>/."""
    cfg, store = _load(config_path, root)
    he = cfg.human_eval
    out = Layout(Path(cfg.storage.root)).comparison(comparison)
    proxies, skipped = None, {}
    clip = cfg.evaluate.metrics.clip_model  # quality.clip_model unless set apart
    if clip is not None and store.comparison(comparison) is not None:
        try:
            proxies, skipped = pair_proxy_scores(
                store, comparison, clip, cfg.quality.aesthetic_head
            )
        except KilnError as e:  # no CLIP there: the report without its proxies, and why
            skipped = {"clip_score": str(e)}
    result = build_report(
        store,
        comparison,
        out,
        min_gold_accuracy=he.min_gold_accuracy,
        n_resamples=he.bootstrap_resamples,
        seed=he.seed,
        proxies=proxies,
    )
    summary = {
        q: {k: v["overall"][k] for k in ("pref", "ci_low", "ci_high", "tie_share", "votes")}
        for q, v in result["questions"].items()
    }
    summary["raters_excluded"] = result["raters"]["excluded"]
    if "proxy_agreement" in result or skipped:  # each automatic score against the raters
        summary["proxy_agreement"] = {
            **result.get("proxy_agreement", {}),
            **{name: {"skipped": why} for name, why in skipped.items()},
        }
    summary["outputs"] = result["outputs"]
    click.echo(json.dumps(summary, indent=2, default=str))
