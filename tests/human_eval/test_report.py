"""The report: rates in their intervals, gold exclusion, alpha, the three outputs."""

from __future__ import annotations

import csv
import json
import time

import numpy as np
import pytest

from human_eval.report import build_report
from human_eval.store import RatingStore, Task, Vote, sqlite_url
from human_eval.studies import create_comparison, load_study
from kiln_config import HumanEvalConfig
from tasks.storage.layout import Layout

from .conftest import many_prompts, write_study

# The report's settings, as `kiln rate report` passes them, without leaving raters out.
_HE = HumanEvalConfig()
SETTINGS = {"min_gold_accuracy": 0.0, "n_resamples": _HE.bootstrap_resamples, "seed": _HE.seed}


def _simulate(store, cid, n_raters, p_a, rng, careless=()):
    """Every rater answers every pair (and every gold pair) in one transaction: A wins with
    probability p_a, 10% ties. Careless raters answer gold checks wrongly."""
    raters = [(p, store.rater(t)) for p, t in store.add_raters(cid, n_raters)]
    pairs = store.pairs(cid)
    with store.session() as s:
        for pseudonym, rater in raters:
            for p in pairs:
                task = Task(
                    rater_id=rater.id, pair_id=p.id, left=rng.choice(["a", "b"]), answered=True
                )
                s.add(task)
                s.flush()
                for q in ("quality", "alignment"):
                    if p.gold:
                        ans = "b" if pseudonym in careless else "a"
                    else:
                        u = rng.random()
                        ans = "tie" if u < 0.1 else ("a" if rng.random() < p_a else "b")
                    s.add(
                        Vote(
                            rater_id=rater.id,
                            pair_id=p.id,
                            task_id=task.id,
                            question=q,
                            answer=ans,
                            left=task.left,
                            served_at=task.served_at,
                        )
                    )


def _comparison(root, n_prompts, gold, name=None, b="study-b"):
    prompts = many_prompts(n_prompts)
    a = write_study(root, "study-a", prompts=prompts, size=8, model="run-a")
    other = write_study(root, b, prompts=prompts, size=8, colour=(0, 0, 250), model=f"run-{b}")
    store = RatingStore(sqlite_url(Layout(root).ratings_db()))
    cid, _ = create_comparison(
        store, load_study(a), load_study(other), raters_per_pair=5, gold=gold, name=name
    )
    return store, cid


def test_report_rates_intervals_exclusion_and_outputs(tmp_path):
    store, cid = _comparison(tmp_path / "root", 60, gold=4)
    rng = np.random.default_rng(0)
    _simulate(store, cid, 5, p_a=0.7, rng=rng, careless={"r005"})
    out = tmp_path / "root" / "human_eval" / cid
    report = build_report(store, cid, out, **{**SETTINGS, "min_gold_accuracy": 0.8})
    assert json.loads((out / "report.json").read_text()) == report  # strict JSON, no NaN
    assert report["raters"]["excluded"] == 1 and report["raters"]["excluded_ids"] == ["r005"]
    truth = 0.9 * 0.7 + 0.05
    for q in ("quality", "alignment"):
        overall = report["questions"][q]["overall"]
        assert overall["ci_low"] <= truth <= overall["ci_high"], overall
        assert overall["votes"] == 60 * 4 and overall["pairs"] == 60 and overall["prompts"] == 60
        assert 0.0 < overall["tie_share"] < 0.25
        cats = report["questions"][q]["categories"]
        assert set(cats) == {"Colors", "Counting", "Positional", "Text", "Rare Words"}
        assert sum(c["votes"] for c in cats.values()) == overall["votes"]
        for c in cats.values():
            assert c["ci_low"] <= c["pref"] <= c["ci_high"]
        alpha = report["questions"][q]["alpha"]
        assert alpha["pairs"] == 60 and -1 <= alpha["value"] <= 1
    with open(out / "votes.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == store.count_votes(cid) == (60 + 4) * 5 * 2
    assert {"rater", "left", "served_at", "voted_at", "excluded"} <= set(rows[0])
    assert {r["rater"] for r in rows if r["excluded"] == "True"} == {"r005"}
    png = (out / "preference.png").read_bytes()
    assert png[:4] == b"\x89PNG" and len(png) > 10_000
    assert "bradley_terry" not in report  # two models only


def test_unknown_comparison_names_the_known_ones(tmp_path):
    store, cid = _comparison(tmp_path / "root", 4, gold=0)
    with pytest.raises(KeyError, match=cid):
        build_report(store, "nope", tmp_path / "out", **SETTINGS)


def test_three_models_get_a_bradley_terry_ranking(tmp_path):
    root = tmp_path / "root"
    store, ab = _comparison(root, 20, gold=0, name="a-vs-b", b="study-b")
    _, ac = _comparison(root, 20, gold=0, name="a-vs-c", b="study-c")
    rng = np.random.default_rng(1)
    _simulate(store, ab, 3, p_a=0.6, rng=rng)  # a beats b
    _simulate(store, ac, 3, p_a=0.9, rng=rng)  # a beats c by more: order a, b, c
    report = build_report(store, ab, tmp_path / "out", **{**SETTINGS, "n_resamples": 500})
    bt = report["bradley_terry"]
    names = [bt["models"][i] for i in bt["quality"]["order"]]
    assert names[0] == "run-a" and set(names) == {"run-a", "run-study-b", "run-study-c"}


def test_report_build_time_200_prompts_5_raters(tmp_path):
    """The figure for docs/benchmarks.md: 200 prompts x 5 raters x 2 questions."""
    store, cid = _comparison(tmp_path / "root", 200, gold=0)
    _simulate(store, cid, 5, p_a=0.6, rng=np.random.default_rng(2))
    t0 = time.perf_counter()
    report = build_report(store, cid, tmp_path / "out", **SETTINGS)
    took = time.perf_counter() - t0
    assert report["questions"]["quality"]["overall"]["votes"] == 1000
    print(f"\nreport for 200 prompts x 5 raters x 2 questions: {took:.2f} s")
    assert took < 30


def test_a_category_without_votes_is_marked_no_votes_not_drawn_as_zero(tmp_path):
    import matplotlib.pyplot as plt

    from human_eval.report import preference_figure

    store, cid = _comparison(tmp_path / "root", 20, gold=0)
    _simulate(store, cid, 2, p_a=0.7, rng=np.random.default_rng(3))
    text = [p.id for p in store.pairs(cid) if p.category == "Text"]
    with store.session() as s:  # nobody has rated a Text prompt yet
        s.query(Vote).filter(Vote.pair_id.in_(text)).delete()
    out = tmp_path / "out"
    report = build_report(store, cid, out, **{**SETTINGS, "n_resamples": 200})
    assert json.loads((out / "report.json").read_text()) == report
    for q in ("quality", "alignment"):
        cats = report["questions"][q]["categories"]
        assert set(cats) == {"Colors", "Counting", "Positional", "Text", "Rare Words"}
        empty = cats["Text"]
        assert empty["votes"] == empty["pairs"] == empty["prompts"] == 0
        assert empty["pref"] is empty["ci_low"] is empty["ci_high"] is empty["tie_share"] is None
        assert empty["note"] == "no votes"
        for name, c in cats.items():  # the others as before: numbers, no note
            if name != "Text":
                assert c["votes"] == 8 and 0 <= c["pref"] <= 1 and "note" not in c
        assert "note" not in report["questions"][q]["overall"]
    fig = preference_figure(report)
    try:
        for ax in fig.axes:
            names = [t.get_text() for t in ax.get_xticklabels()]
            x = names.index("Text")
            bars = [b.get_x() + b.get_width() / 2 for b in ax.patches]
            assert len(bars) == len(names) - 1 and x not in bars  # no bar for Text, not even 0
            notes = [t for t in ax.texts if t.get_text() == "no votes"]
            assert [t.get_position()[0] for t in notes] == [x]
    finally:
        plt.close(fig)


def test_a_comparison_without_votes_reports_no_votes_everywhere(tmp_path):
    store, cid = _comparison(tmp_path / "root", 5, gold=0)
    report = build_report(store, cid, tmp_path / "out", **{**SETTINGS, "n_resamples": 100})
    for q in ("quality", "alignment"):
        cells = [report["questions"][q]["overall"], *report["questions"][q]["categories"].values()]
        assert len(cells) == 6
        assert all(c["pref"] is None and c["note"] == "no votes" for c in cells)
    assert (tmp_path / "out" / "preference.png").read_bytes()[:4] == b"\x89PNG"


def test_proxy_agreement_known_answer():
    from human_eval.report import proxy_agreement

    def vote(pair, prompt, answer, rater="r1"):
        return {
            "pair_id": pair,
            "prompt_index": prompt,
            "answer": answer,
            "question": "quality",
            "gold": False,
            "rater": rater,
        }

    votes = [
        *(vote(1, 0, a, r) for a, r in (("a", "r1"), ("a", "r2"), ("b", "r3"))),  # A wins
        *(vote(2, 1, a, r) for a, r in (("b", "r1"), ("b", "r2"))),  # B wins
        *(vote(3, 2, a, r) for a, r in (("a", "r1"), ("b", "r2"))),  # a tie: left out
        vote(4, 3, "a"),  # the proxy cannot tell the images apart: left out
    ]
    scores = {1: (0.3, 0.1), 2: (0.5, 0.2), 3: (0.9, 0.1), 4: (0.2, 0.2)}
    got = proxy_agreement(votes, scores, min_gold_accuracy=0.0, n_resamples=200, seed=0)
    q = got["quality"]
    assert (q["agreement"], q["pairs"], q["ties_skipped"]) == (0.5, 2, 2)
    assert 0.0 <= q["ci_low"] <= 0.5 <= q["ci_high"] <= 1.0
    assert got["alignment"]["pairs"] == 0  # no alignment votes: no number, not a zero
