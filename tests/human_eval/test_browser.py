"""A real browser (Playwright driving Debian's Chromium) on a real `kiln rate serve` process.

Playwright's own browser download is not used (no network): `make system-packages` installs
Debian's package, and the test points `executable_path` at it. Screenshots are kept under
the test's tmp dir (pytest keeps the last three runs).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from human_eval.report import build_report
from human_eval.store import RatingStore
from kiln_cli.main import main as cli
from kiln_config import load_config
from tasks.storage.layout import Layout
from tests.servers import free_port

from .conftest import PROMPTS, start_server, stop, write_study

pytestmark = pytest.mark.integration

CHROMIUM = "/usr/bin/chromium"
XSS = '<img src=x onerror=alert(1)>"; DROP TABLE votes;--'
SECRETS = ["run-alpha", "run-beta", "study-alpha", "study-beta", "/models/", "cmp-"]


@pytest.fixture
def served(tmp_path, make_config):
    """A comparison of 8 pairs + 2 gold (one prompt is an XSS probe), a rater link, and a
    `kiln rate serve` process."""
    root = tmp_path / "root"
    prompts = [
        (XSS, "Misspellings"),
        *PROMPTS,
        *[(f"A cube number {i}.", "Counting") for i in range(3)],
    ]
    write_study(root, "study-alpha", prompts=prompts, size=512, model="run-alpha")
    write_study(
        root, "study-beta", prompts=prompts, size=512, colour=(0, 90, 200), model="run-beta"
    )
    cfg = make_config(tmp_path / "tiny.yaml", root, tmp_path)
    data = yaml.safe_load(cfg.read_text())
    data["human_eval"] = {"port": free_port(), "gold_per_rater": 2}
    cfg.write_text(yaml.safe_dump(data))
    common = ["--config", str(cfg), "--root", str(root)]
    runner = CliRunner()
    cid = runner.invoke(cli, ["compare", *common, "--a", "study-alpha", "--b", "study-beta"])
    cid = cid.stdout.strip().splitlines()[-1]
    invite = runner.invoke(cli, ["rate", "invite", *common, "--comparison", cid, "--raters", "1"])
    link = re.search(r"http://\S+", invite.stdout).group(0)
    port = data["human_eval"]["port"]
    admin = runner.invoke(cli, ["rate", "admin-link", *common]).stdout.strip()
    proc, _ = start_server(["kiln_cli", "rate", "serve", *common], port)
    yield {
        "link": link,
        "root": root,
        "cid": cid,
        "token": link.rsplit("/", 1)[1],
        "admin": admin,
        "config": cfg,
    }
    stop(proc)


def _task_id(page) -> int:
    return int(page.locator("input[name=task_id]").get_attribute("value"))


def _check_page(page, dialogs):
    html = page.content()
    for secret in SECRETS:
        assert secret not in html, secret
    assert page.locator("img").count() == 2  # nothing injected
    # Both images decode in the browser (served re-encoded, without metadata).
    page.wait_for_function(
        "Array.from(document.images).every(i => i.complete && "
        "i.naturalWidth === 512 && i.naturalHeight === 512)"
    )
    assert not dialogs
    # A laptop screen (1366 x 768) shows the whole task with 512 px images: no scrolling.
    assert page.evaluate("document.documentElement.scrollHeight <= window.innerHeight")


def test_rate_with_keyboard_and_clicks_in_chromium(served, tmp_path):
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"{CHROMIUM} is missing: run `make system-packages` (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    shots = tmp_path / "screenshots"
    shots.mkdir()
    dialogs: list[str] = []
    answered: dict[int, tuple[str, str]] = {}  # task id -> (quality, alignment) on screen
    seen_xss = False
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1366, "height": 768})
        page.set_default_timeout(15_000)
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        page.goto(served["link"])
        keys = [("1", "3"), ("2", "1"), ("3", "2"), ("1", "1"), ("2", "3")]
        screen = {"1": "left", "2": "right", "3": "tie"}
        for i, (kq, ka) in enumerate(keys):
            _check_page(page, dialogs)
            assert page.locator("#progress").inner_text() == f"{i + 1} of 10"
            seen_xss |= page.locator("#prompt").inner_text() == XSS
            task = _task_id(page)
            page.screenshot(path=shots / f"keyboard-{i}.png")
            page.keyboard.press(kq)
            page.keyboard.press(ka)
            with page.expect_navigation():
                page.keyboard.press("Enter")
            answered[task] = (screen[kq], screen[ka])
        # Reload mid-way: the same task, same images, nothing recorded twice.
        task, src = _task_id(page), page.locator("img").first.get_attribute("src")
        page.reload()
        assert (_task_id(page), page.locator("img").first.get_attribute("src")) == (task, src)
        clicks = [
            ("right", "left"),
            ("tie", "tie"),
            ("left", "right"),
            ("right", "right"),
            ("left", "tie"),
        ]
        label = {"left": "1: A", "right": "2: B", "tie": "3: Indifferent"}
        for i, (q, a) in enumerate(clicks):
            _check_page(page, dialogs)
            assert page.locator("#progress").inner_text() == f"{6 + i} of 10"
            seen_xss |= page.locator("#prompt").inner_text() == XSS
            task = _task_id(page)
            page.locator("fieldset[data-question=quality]").get_by_text(label[q]).click()
            page.locator("fieldset[data-question=alignment]").get_by_text(label[a]).click()
            page.screenshot(path=shots / f"click-{i}.png")
            with page.expect_navigation():
                page.locator("#send").click()
            answered[task] = (q, a)
        assert page.locator("#done").inner_text() == "Thank you"
        page.screenshot(path=shots / "done.png")
        page.goto(served["admin"])  # the operator's view of the same votes
        result = page.locator("table.result[data-question=quality] tr[data-group=overall]")
        on_admin = {k: result.locator(f"td.{k}").inner_text() for k in ("pref", "votes")}
        page.screenshot(path=shots / "admin.png", full_page=True)
        browser.close()
    assert seen_xss and not dialogs  # the XSS prompt was shown, as text, and ran nothing

    store = RatingStore.open(Layout(served["root"]).ratings_db())
    votes = store.votes(served["cid"])
    assert len(votes) == 20  # 10 tasks x 2 questions, none twice
    with store.engine.connect() as con:
        rows = con.exec_driver_sql("SELECT id, pair_id, left FROM tasks_served").all()
    task_of_pair = {pair: (task, left) for task, pair, left in rows}
    assert set(answered) == {task for task, _ in task_of_pair.values()}
    for v in votes:  # the screen answer, mapped through the side shown on the left
        task, left = task_of_pair[v["pair_id"]]
        shown = answered[task][0 if v["question"] == "quality" else 1]
        expect = {"left": left, "right": "b" if left == "a" else "a", "tie": "tie"}[shown]
        assert (v["answer"], v["left"]) == (expect, left)
    assert len(list(shots.glob("*.png"))) == 12

    # The admin page showed what `kiln rate report` writes (the config's settings).
    he = load_config(str(served["config"])).human_eval
    report = build_report(
        store,
        served["cid"],
        tmp_path / "report",
        min_gold_accuracy=he.min_gold_accuracy,
        n_resamples=he.bootstrap_resamples,
        seed=he.seed,
    )
    overall = report["questions"]["quality"]["overall"]
    assert on_admin == {
        "pref": overall.get("note") or f"{overall['pref']:.3f}",
        "votes": str(overall["votes"]),
    }
