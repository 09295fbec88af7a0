"""A comparison's report: preference rates with prompt-level intervals, agreement, outputs.

Writes `<root>/human_eval/<comparison>/{report.json, votes.csv, preference.png}`:

- per question (quality, alignment), overall and per prompt category: A's preference rate
  (ties half), the share of ties, a 95% bootstrap interval over prompts, and the pairs, votes
  and prompts behind it;
- Krippendorff's alpha (nominal) per question, with the number of pairs it used;
- the raters left out for gold accuracy below `min_gold_accuracy`, and how many;
- with three or more models among the store's comparisons, a Bradley-Terry ranking;
- given automatic scores of each pair's two images (`proxies`: the configured CLIP's score,
  the aesthetic head's), each proxy's agreement with the raters (`proxy_agreement`).

Gold pairs (attention checks) never enter the rates: their B side is another prompt's image.
"""

from __future__ import annotations

import csv
import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from human_eval.stats import (
    bootstrap_ci,
    bradley_terry,
    krippendorff_alpha,
    preference,
    scores_of,
)
from human_eval.store import QUESTIONS, RatingStore
from kiln_config.errors import NotFound

__all__ = [
    "NO_VOTES",
    "build_report",
    "gold_accuracy",
    "plot_preference",
    "preference_figure",
    "proxy_agreement",
    "ranking",
    "summarize",
    "summarize_comparison",
]

NO_VOTES = "no votes"
CSV_COLUMNS = [
    "vote_id",
    "rater",
    "pair_id",
    "prompt_index",
    "seed",
    "category",
    "prompt",
    "gold",
    "question",
    "answer",
    "left",
    "served_at",
    "voted_at",
    "excluded",
]


def gold_accuracy(votes: list[dict]) -> dict[str, tuple[int, int]]:
    """rater -> (correct, answered) on gold pairs' alignment question (the answer is A)."""
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for v in votes:
        if v["gold"] and v["question"] == "alignment":
            out[v["rater"]][0] += v["answer"] == "a"
            out[v["rater"]][1] += 1
    return {r: (c, n) for r, (c, n) in out.items()}


def excluded_raters(votes: list[dict], min_gold_accuracy: float) -> dict[str, float]:
    """Raters whose gold accuracy is below the threshold -> their accuracy.

    A rater who has answered no gold pair yet is kept: there is nothing to judge them on.
    """
    return {
        r: c / n for r, (c, n) in gold_accuracy(votes).items() if n and c / n < min_gold_accuracy
    }


def _cell(votes: list[dict], n_resamples: int, seed: int) -> dict:
    """A's preference over `votes`; without votes its numbers are NaN (null in report.json)
    and `note` says "no votes", so that no reader takes an empty cell for 0."""
    scores = scores_of([v["answer"] for v in votes])
    rate, ties = preference(scores)
    prompts = [v["prompt_index"] for v in votes]
    low, high = bootstrap_ci(scores, prompts, n_resamples=n_resamples, seed=seed)
    cell = {
        "pref": rate,
        "ci_low": low,
        "ci_high": high,
        "tie_share": ties,
        "votes": len(votes),
        "pairs": len({v["pair_id"] for v in votes}),
        "prompts": len(set(prompts)),
    }
    if not votes:
        cell["note"] = NO_VOTES
    return cell


def summarize(
    votes: list[dict],
    *,
    min_gold_accuracy: float,
    n_resamples: int,
    seed: int,
    pair_ids: list[int] | None = None,
    categories: list[str] | None = None,
) -> dict:
    """The statistics of one comparison's votes (plain rows, as `RatingStore.votes` gives).

    `pair_ids` (the comparison's non-gold pairs) gives each question's `min_votes_per_pair`:
    the fewest kept votes any pair has, 0 while a pair is unrated. The promotion gate reads it.
    `categories` (those of the comparison's pairs) lists a category without kept votes too,
    as a cell marked "no votes".
    """
    excluded = excluded_raters(votes, min_gold_accuracy)
    kept = [v for v in votes if not v["gold"] and v["rater"] not in excluded]
    questions = {}
    for q in QUESTIONS:
        qv = [v for v in kept if v["question"] == q]
        by_cat: dict[str, list[dict]] = {c or "-": [] for c in categories or []}
        by_cat = defaultdict(list, by_cat)
        for v in qv:
            by_cat[v["category"] or "-"].append(v)
        units: dict[int, list[str]] = defaultdict(list)
        for v in qv:
            units[v["pair_id"]].append(v["answer"])
        alpha, used = krippendorff_alpha(units)
        overall = _cell(qv, n_resamples, seed)
        every = pair_ids if pair_ids is not None else list(units)
        overall["min_votes_per_pair"] = min((len(units.get(p, [])) for p in every), default=0)
        questions[q] = {
            "overall": overall,
            "categories": {c: _cell(cv, n_resamples, seed) for c, cv in sorted(by_cat.items())},
            "alpha": {"value": alpha, "pairs": used},
        }
    raters = sorted({v["rater"] for v in votes})
    gold = gold_accuracy(votes)
    return {
        "questions": questions,
        "raters": {
            "total": len(raters),
            "excluded": len(excluded),
            "excluded_ids": sorted(excluded),
            "min_gold_accuracy": min_gold_accuracy,
            "gold_accuracy": {r: (c / n if n else None) for r, (c, n) in sorted(gold.items())},
        },
        "settings": {"bootstrap_resamples": n_resamples, "seed": seed, "ci_level": 0.95},
    }


def summarize_comparison(
    store: RatingStore,
    comparison_id: str,
    *,
    min_gold_accuracy: float,
    n_resamples: int,
    seed: int,
    votes: list[dict] | None = None,
) -> dict:
    """`summarize` over a comparison's votes in the store, as the report and the admin page
    show them (every category of its pairs listed, `min_votes_per_pair` over all pairs)."""
    votes = store.votes(comparison_id) if votes is None else votes
    return summarize(
        votes,
        min_gold_accuracy=min_gold_accuracy,
        n_resamples=n_resamples,
        seed=seed,
        **_pairs_of(store, comparison_id),
    )


def ranking(
    store: RatingStore, *, min_gold_accuracy: float, n_resamples: int, seed: int
) -> dict | None:
    """Bradley-Terry strengths of every model in the store's comparisons, per question, with
    intervals from `n_resamples` bootstrap resamples.

    None with fewer than three models (one comparison already says all about two).
    """
    comps = store.comparisons()
    models = sorted({c.model_a for c in comps} | {c.model_b for c in comps})
    if len(models) < 3:
        return None
    index = {m: i for i, m in enumerate(models)}
    outcomes: dict[str, list] = {q: [] for q in QUESTIONS}
    for c in comps:
        votes = store.votes(c.id)
        excluded = excluded_raters(votes, min_gold_accuracy)
        for v in votes:
            if not v["gold"] and v["rater"] not in excluded:
                s = scores_of([v["answer"]])[0]
                outcomes[v["question"]].append((index[c.model_a], index[c.model_b], s))
    out = {"models": models}
    for q, rows in outcomes.items():
        if rows:
            out[q] = bradley_terry(len(models), rows, n_resamples=n_resamples, seed=seed)
    return out


def plot_preference(report: dict, path: Path) -> Path:
    """Per-category bars of A's preference with CI whiskers and a 0.5 line, a panel per
    question (Agg backend: no display needed). A group without votes gets no bar, only the
    words "no votes": an empty bar at 0 would read as "B always preferred"."""
    fig = preference_figure(report)
    import matplotlib.pyplot as plt  # after preference_figure chose the Agg backend

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def preference_figure(report: dict):
    """The matplotlib figure `plot_preference` saves (close it with `plt.close`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(QUESTIONS), figsize=(6 * len(QUESTIONS), 4.5), sharey=True)
    for ax, q in zip(np.atleast_1d(axes), QUESTIONS, strict=True):
        cells = {
            "overall": report["questions"][q]["overall"],
            **report["questions"][q]["categories"],
        }
        names = list(cells)
        for i, name in enumerate(names):
            c = cells[name]
            if not c["votes"]:
                ax.text(i, 0.5, NO_VOTES, rotation=90, ha="center", va="center", color="#777777")
                continue
            rate = float(c["pref"])
            err = np.nan_to_num([[rate - float(c["ci_low"])], [float(c["ci_high"]) - rate]])
            ax.bar(i, rate, yerr=err, capsize=4, color="#444444" if i == 0 else "#4c78a8")
        ax.axhline(0.5, color="#d62728", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right")
        ax.set_xlim(-0.6, len(names) - 0.4)
        ax.set_ylim(0, 1)
        ax.set_title(f"{q}: A preferred (ties half), 95% CI")
    np.atleast_1d(axes)[0].set_ylabel("A's preference rate")
    fig.suptitle(f"{report['comparison']}: {report['study_a']} (A) vs {report['study_b']} (B)")
    fig.tight_layout()
    return fig


def proxy_agreement(
    votes: list[dict],
    pair_scores: dict[int, tuple[float, float]],
    *,
    min_gold_accuracy: float,
    n_resamples: int,
    seed: int,
) -> dict:
    """How often an automatic score picks the raters' winner, per question.

    A pair counts when its kept votes lean one way (A's mean score is not 0.5) and the proxy
    scores its two images differently (`pair_scores`: pair id -> (A's, B's)); the proxy
    agrees when the higher-scoring image is the one the raters preferred. Returns, per
    question, the share of agreeing pairs with a 95% bootstrap interval over prompts, the
    pairs counted and those left out as ties. A proxy whose interval stays above 0.5 tracks
    these raters; one around 0.5 does not.
    """
    excluded = excluded_raters(votes, min_gold_accuracy)
    kept = [
        v
        for v in votes
        if not v["gold"] and v["rater"] not in excluded and v["pair_id"] in pair_scores
    ]
    out = {}
    for q in QUESTIONS:
        by_pair: dict[int, list[str]] = defaultdict(list)
        prompt_of = {}
        for v in kept:
            if v["question"] == q:
                by_pair[v["pair_id"]].append(v["answer"])
                prompt_of[v["pair_id"]] = v["prompt_index"]
        agree, prompts, ties = [], [], 0
        for pid, answers in by_pair.items():
            human = float(scores_of(answers).mean())
            a, b = pair_scores[pid]
            if human == 0.5 or a == b:
                ties += 1
                continue
            agree.append(float((human > 0.5) == (a > b)))
            prompts.append(prompt_of[pid])
        low, high = bootstrap_ci(np.array(agree), prompts, n_resamples=n_resamples, seed=seed)
        out[q] = {
            "agreement": float(np.mean(agree)) if agree else float("nan"),
            "ci_low": low,
            "ci_high": high,
            "pairs": len(agree),
            "ties_skipped": ties,
        }
    return out


def _pairs_of(store: RatingStore, comparison_id: str) -> dict:
    """`summarize`'s view of a comparison's regular pairs: their ids and categories."""
    pairs = [p for p in store.pairs(comparison_id) if not p.gold]
    return {"pair_ids": [p.id for p in pairs], "categories": sorted({p.category for p in pairs})}


def _write_csv(votes: list[dict], excluded: list[str], path: Path) -> None:
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, CSV_COLUMNS)
        w.writeheader()
        for v in votes:
            w.writerow({**v, "excluded": v["rater"] in excluded})
    tmp.replace(path)


def build_report(
    store: RatingStore,
    comparison_id: str,
    out_dir: Path,
    *,
    min_gold_accuracy: float,
    n_resamples: int,
    seed: int,
    proxies: dict[str, dict[int, tuple[float, float]]] | None = None,
) -> dict:
    """Write report.json, votes.csv and preference.png for a comparison into `out_dir`; with
    `proxies` (name -> pair id -> the two images' scores), each one's `proxy_agreement`.

    Raises:
        KeyError: no such comparison (the message lists the ones there are).
    """
    t0 = time.perf_counter()
    cmp = store.comparison(comparison_id)
    if cmp is None:
        known = [c.id for c in store.comparisons()]
        raise NotFound(f"no comparison {comparison_id!r}; known: {known or 'none'}")
    votes = store.votes(comparison_id)
    report = {
        "comparison": cmp.id,
        "study_a": cmp.study_a,
        "study_b": cmp.study_b,
        "model_a": cmp.model_a,
        "model_b": cmp.model_b,
        "raters_per_pair": cmp.raters_per_pair,
        "gold_per_rater": cmp.gold_per_rater,
        **summarize_comparison(
            store,
            cmp.id,
            min_gold_accuracy=min_gold_accuracy,
            n_resamples=n_resamples,
            seed=seed,
            votes=votes,
        ),
    }
    if proxies:
        report["proxy_agreement"] = {
            name: proxy_agreement(
                votes,
                scores,
                min_gold_accuracy=min_gold_accuracy,
                n_resamples=n_resamples,
                seed=seed,
            )
            for name, scores in proxies.items()
        }
    bt = ranking(store, min_gold_accuracy=min_gold_accuracy, n_resamples=n_resamples, seed=seed)
    if bt is not None:
        report["bradley_terry"] = bt
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_csv(votes, report["raters"]["excluded_ids"], out_dir / "votes.csv")
    plot_preference(report, out_dir / "preference.png")
    report["outputs"] = {
        n: str(out_dir / n) for n in ("report.json", "votes.csv", "preference.png")
    }
    report["build_s"] = round(time.perf_counter() - t0, 3)
    report = _clean(report)
    tmp = out_dir / "report.json.tmp"
    tmp.write_text(json.dumps(report, indent=2, allow_nan=False))
    tmp.replace(out_dir / "report.json")
    return report


def _clean(x):
    """NaN (no votes, or alpha undefined) as null: report.json stays strict JSON."""
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    if isinstance(x, float) and x != x:
        return None
    return x
