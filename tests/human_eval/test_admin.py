"""The admin page's running result on a real `kiln rate serve` process: as votes come in over
HTTP, per question its overall preference, interval and per-category table are the numbers
`build_report` writes with the config's settings."""

from __future__ import annotations

import html
import re

import httpx
import numpy as np
import pytest
import yaml

from human_eval.report import build_report
from human_eval.store import Pair, RatingStore, Task
from human_eval.studies import create_comparison, load_study
from tasks.storage.layout import Layout
from tests.servers import free_port

from .conftest import many_prompts, start_server, stop, write_study

pytestmark = pytest.mark.integration

SETTINGS = {"min_gold_accuracy": 0.5, "bootstrap_resamples": 300, "seed": 7}


@pytest.fixture
def served(tmp_path, make_config):
    root = tmp_path / "root"
    prompts = many_prompts(10)  # 5 categories, 2 prompts each
    a = write_study(root, "study-a", prompts=prompts, size=8, model="run-a")
    b = write_study(root, "study-b", prompts=prompts, size=8, colour=(0, 0, 250), model="run-b")
    cfg = make_config(tmp_path / "tiny.yaml", root, tmp_path)
    data = yaml.safe_load(cfg.read_text())
    data["human_eval"] = {"port": free_port(), **SETTINGS}
    cfg.write_text(yaml.safe_dump(data))
    store = RatingStore.open(Layout(root).ratings_db())
    cid, _ = create_comparison(store, load_study(a), load_study(b), raters_per_pair=3, gold=2)
    tokens = [t for _, t in store.add_raters(cid, 3)]
    common = ["--config", str(cfg), "--root", str(root)]
    proc, base = start_server(["kiln_cli", "rate", "serve", *common], data["human_eval"]["port"])
    yield {"base": base, "store": store, "cid": cid, "tokens": tokens, "root": root}
    stop(proc)
    store.close()


def _vote(client, base, token, store, rng, careful: bool) -> bool:
    """Answer the rater's next task over HTTP: the left image more often than not, ties now
    and then. A gold check (looked up in the store, as a careful rater would spot it) is
    answered right by a careful rater and wrongly by a careless one, who is then left out."""
    page = client.get(f"{base}/rate/{token}")
    m = re.search(r'name="task_id" value="(\d+)"', page.text)
    if m is None:
        return False
    answers = {
        q: rng.choice(["left", "right", "tie"], p=[0.6, 0.3, 0.1]) for q in ("quality", "alignment")
    }
    with store.session() as s:
        task = s.get(Task, int(m.group(1)))
        gold, left = s.get(Pair, task.pair_id).gold, task.left
    if gold:  # the gold pair's right answer is A, wherever A is shown
        a_side = "left" if left == "a" else "right"
        b_side = "right" if left == "a" else "left"
        answers["alignment"] = a_side if careful else b_side
    r = client.post(f"{base}/rate/{token}/vote", data={"task_id": m.group(1), **answers})
    assert r.status_code == 303
    return True


def _page_result(text: str) -> dict:
    """{question: {group: {pref, ci, ties, votes, prompts} or {note, votes, prompts}}} and
    each question's alpha, read from the admin page's result tables."""
    out = {}
    for q, body in re.findall(
        r'<table class="result" data-question="(\w+)">(.*?)</table>', text, re.S
    ):
        rows = {}
        for group, row in re.findall(r'<tr data-group="([^"]*)">(.*?)</tr>', body, re.S):
            cells = dict(re.findall(r'<td class="(\w+)"[^>]*>([^<]*)</td>', row))
            rows[html.unescape(group)] = {k: html.unescape(v).strip() for k, v in cells.items()}
        alpha = re.search(r'<span class="alpha">([^<]*)</span>', body).group(1)
        out[q] = {"groups": rows, "alpha": alpha}
    return out


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _assert_page_is_report(page: dict, report: dict) -> None:
    assert set(page) == {"quality", "alignment"}
    for q, res in report["questions"].items():
        groups = {"overall": res["overall"], **res["categories"]}
        assert list(page[q]["groups"]) == list(groups)
        assert page[q]["alpha"] == _fmt(res["alpha"]["value"])
        for name, c in groups.items():
            shown = page[q]["groups"][name]
            assert shown["votes"] == str(c["votes"]) and shown["prompts"] == str(c["prompts"])
            if c.get("note"):
                assert shown["pref"] == "no votes" and "ci" not in shown
            else:
                assert shown["pref"] == _fmt(c["pref"])
                assert shown["ci"] == f"[{_fmt(c['ci_low'])}, {_fmt(c['ci_high'])}]"
                assert shown["ties"] == _fmt(c["tie_share"])


def test_admin_page_shows_the_reports_numbers_as_votes_come_in(served, tmp_path):
    base, store, cid = served["base"], served["store"], served["cid"]
    admin = f"{base}/admin/{store.new_admin_token(rotate=True)}"
    rng = np.random.default_rng(0)

    def check() -> dict:
        page = httpx.get(admin)
        assert page.status_code == 200
        report = build_report(
            store, cid, tmp_path / "report", min_gold_accuracy=0.5, n_resamples=300, seed=7
        )
        shown = _page_result(page.text)
        _assert_page_is_report(shown, report)
        return report

    report = check()  # nothing yet: every group says "no votes"
    assert report["questions"]["quality"]["overall"]["note"] == "no votes"
    seen = []
    with httpx.Client() as client:
        for _round in range(3):
            for i, token in enumerate(served["tokens"]):
                for _ in range(4):
                    _vote(client, base, token, store, rng, careful=i < 2)
            report = check()
            seen.append(report["questions"]["quality"]["overall"]["votes"])
    # The page followed the votes: some after the first round, at the end every pair rated by
    # the two careful raters (the careless one's votes left out once gold-checked).
    assert seen[0] > 0 and seen[-1] == 2 * 10
    overall = report["questions"]["quality"]["overall"]
    assert overall["ci_low"] <= overall["pref"] <= overall["ci_high"]
    assert len(report["questions"]["quality"]["categories"]) == 5
    assert report["raters"]["excluded_ids"] == ["r003"]  # the careless rater, once gold-checked
