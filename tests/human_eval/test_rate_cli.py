"""`kiln compare` and `kiln rate invite/report` on a tiny config (CliRunner, in process)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import click
import pytest
import yaml
from click.testing import CliRunner

from human_eval.store import RatingStore
from kiln_cli.main import main as cli
from kiln_config import load_config
from tasks.storage.layout import Layout

from .conftest import write_study


@pytest.fixture
def setup(tmp_path, make_config, two_studies):
    root, _, _ = two_studies
    cfg = make_config(tmp_path / "tiny.yaml", root, tmp_path)
    data = yaml.safe_load(cfg.read_text())
    data["human_eval"] = {"port": 9911}
    cfg.write_text(yaml.safe_dump(data))
    return str(cfg), root


def _run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def test_every_command_has_help():
    for path in (
        ["compare"],
        ["rate"],
        ["rate", "serve"],
        ["rate", "invite"],
        ["rate", "admin-link"],
        ["rate", "report"],
    ):
        result = _run(*path, "--help")
        assert result.exit_code == 0, result.output
        cmd = cli
        for name in path:
            cmd = cmd.commands[name]
        for param in cmd.params:
            if isinstance(param, click.Option):
                assert param.help and param.opts[-1] in result.output, (path, param.opts)


def test_config_has_a_human_eval_section(setup):
    cfg = load_config(setup[0])
    assert cfg.human_eval.port == 9911 and cfg.human_eval.raters_per_pair == 5
    assert cfg.human_eval.min_gold_accuracy == 0.8


def test_compare_invite_report(setup):
    config, root = setup
    common = ["--config", config, "--root", root]
    result = _run(
        "compare",
        *common,
        "--a",
        "run-a-1111",
        "--b",
        "run-b-2222",
        "--gold",
        "2",
        "--raters-per-pair",
        "3",
    )
    assert result.exit_code == 0, result.output
    cid = result.stdout.strip().splitlines()[-1]
    assert cid.startswith("cmp-")
    again = _run(
        "compare",
        *common,
        "--a",
        "run-a-1111",
        "--b",
        "run-b-2222",
        "--gold",
        "2",
        "--raters-per-pair",
        "3",
    )
    assert again.stdout.strip().splitlines()[-1] == cid  # the same comparison, not a new one

    invite = _run("rate", "invite", *common, "--comparison", cid, "--raters", "3")
    assert invite.exit_code == 0, invite.output
    links = re.findall(r"http://127\.0\.0\.1:9911/rate/([\w-]{32})$", invite.stdout, re.M)
    assert len(set(links)) == 3
    store = RatingStore.open(Layout(root).ratings_db())
    rater = store.rater(links[0])
    task = store.next_task(rater)
    store.record_vote(rater, task.task_id, {"quality": "left", "alignment": "left"})

    report = _run("rate", "report", *common, "--comparison", cid)
    assert report.exit_code == 0, report.output
    summary = json.loads(report.stdout)
    for name in ("report.json", "votes.csv", "preference.png"):
        assert (root / "human_eval" / cid / name).is_file()
    # The one vote counts unless its task was a gold check (those never enter the rates).
    # Gold positions and sides come from the store's secret: "left" on a gold pair is right
    # only where A was drawn on the left, and a wrong one excludes the rater.
    votes = store.votes(cid)
    gold = votes[0]["gold"]
    assert summary["quality"]["votes"] == (0 if gold else 1)
    wrong = [v for v in votes if v["gold"] and v["question"] == "alignment" and v["answer"] != "a"]
    assert summary["raters_excluded"] == (1 if wrong else 0)


def test_clear_errors(setup):
    config, root = setup
    common = ["--config", config, "--root", root]
    write_study(root, "run-c-3333", seeds=(0, 5))
    bad = _run("compare", *common, "--a", "run-a-1111", "--b", "run-c-3333")
    assert bad.exit_code == 1 and "seeds differ" in bad.output
    missing = _run("compare", *common, "--a", "run-a-1111", "--b", "nope")
    assert missing.exit_code == 1 and "run `kiln evaluate`" in missing.output
    model = _run("compare", *common, "--a", "models:/kiln-t2i@champion", "--b", "run-a-1111")
    assert model.exit_code == 1
    assert "kiln: error: models:/kiln-t2i@champion does not exist in the registry" in model.output
    bad_uri = _run("compare", *common, "--a", "models:/kiln-t2i", "--b", "run-a-1111")
    assert bad_uri.exit_code == 1 and "models:/NAME@ALIAS" in bad_uri.output
    unknown = _run("rate", "report", *common, "--comparison", "nope")
    assert unknown.exit_code == 1 and "no comparison 'nope'" in unknown.output
    unknown = _run("rate", "invite", *common, "--comparison", "nope", "--raters", "2")
    assert unknown.exit_code == 1 and "kiln compare" in unknown.output


def test_an_option_given_overrides_its_config_field(setup):
    config, root = setup  # the config sets human_eval.port 9911
    common = ["--config", config, "--root", root]
    made = _run(
        "compare",
        *common,
        "--a",
        "run-a-1111",
        "--b",
        "run-b-2222",
        "--gold",
        "2",
        "--raters-per-pair",
        "3",
    )
    cid = made.stdout.strip().splitlines()[-1]
    given = _run(
        "rate",
        "invite",
        *common,
        "--comparison",
        cid,
        "--raters",
        "1",
        "--host",
        "localhost",
        "--port",
        "9912",
    )
    assert given.exit_code == 0, given.output
    assert re.search(r"\thttp://localhost:9912/rate/[\w-]{32}$", given.stdout, re.M)
    bad = _run("rate", "invite", *common, "--comparison", cid, "--raters", "1", "--port", "0")
    assert bad.exit_code == 1
    assert "--port (human_eval.port): Input should be greater than 0 (received 0)" in bad.output
    assert "http" not in bad.stdout, "no link printed"


def test_evaluate_model_errors_are_one_line(setup):
    config, root = setup
    result = _run("evaluate", "--config", config, "--root", root, "--model", "models:/kiln-t2i/x")
    assert result.exit_code == 1 and "models:/NAME/VERSION" in result.output


def test_a_folder_that_is_not_a_pipeline_is_one_line(setup, tmp_path):
    config, root = setup
    typo = tmp_path / "exprot"
    result = _run("evaluate", "--config", config, "--root", root, "--model", typo)
    assert result.exit_code == 1 and "not an exported pipeline" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_a_pipeline_exported_again_gets_a_new_identity(tmp_path):
    import os

    from flows.human_evaluation import _pipeline_identity

    folder = tmp_path / "final"
    (folder / "unet").mkdir(parents=True)
    (folder / "model_index.json").write_text("{}")
    weights = folder / "unet" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(b"old")
    first = _pipeline_identity(folder)
    assert _pipeline_identity(folder) == first, "unchanged: the same study"
    weights.write_bytes(b"new weights")
    os.utime(weights, ns=(1, 1))
    assert _pipeline_identity(folder) != first, "exported again: a new study"


def test_compare_names_a_folder_that_is_neither_a_pipeline_nor_a_study(setup, tmp_path):
    config, root = setup
    common = ["--config", config, "--root", root]
    stage = tmp_path / "runs" / "run-1" / "stage-64"
    (stage / "final-raw" / "unet").mkdir(parents=True)
    (stage / "final-raw" / "unet" / "config.json").write_text("{}")
    result = _run("compare", *common, "--a", "run-a-1111", "--b", stage / "final-raw")
    assert result.exit_code == 1
    message = result.output.strip()
    assert message == (
        f"kiln: error: {stage / 'final-raw'} is not an exported pipeline (no model_index.json) "
        "nor a study (no study.json): pass a study id, models:/NAME@ALIAS, models:/NAME/VERSION "
        "or a pipeline folder written by `kiln train` (a stage's final/)"
    )
    assert "run `kiln evaluate`" not in message
    (stage / "final").mkdir()
    (stage / "final" / "model_index.json").write_text("{}")
    hinted = _run("compare", *common, "--a", "run-a-1111", "--b", stage / "final-raw")
    assert hinted.exit_code == 1 and f"(did you mean {stage / 'final'}?)" in hinted.output
    # A study given by its folder is still a study, and a name that is nowhere still says so.
    b_folder = root / "eval" / "run-b-2222"
    by_folder = _run("compare", *common, "--a", "run-a-1111", "--b", b_folder, "--gold", "1")
    assert by_folder.exit_code == 0, by_folder.output
    missing = _run("compare", *common, "--a", "run-a-1111", "--b", "run-z-9999")
    assert missing.exit_code == 1 and "no study 'run-z-9999'" in missing.output


def test_links_are_shown_once_and_the_store_keeps_their_hashes(setup):
    """A rater's and the admin's token work as links, but the database file holds neither;
    the admin link is made once, replaced by --rotate (the old one stops working)."""
    config, root = setup
    common = ["--config", config, "--root", root]
    made = _run("compare", *common, "--a", "run-a-1111", "--b", "run-b-2222", "--gold", "2")
    assert made.exit_code == 0, made.output
    cid = made.stdout.split()[-1]
    link = _run("rate", "invite", *common, "--comparison", cid, "--raters", "1").stdout
    rater = link.strip().rsplit("/", 1)[1]
    first = _run("rate", "admin-link", *common, "--port", "9000")
    assert first.exit_code == 0 and first.stdout.startswith("http://127.0.0.1:9000/admin/")
    again = CliRunner().invoke(cli, ["rate", "admin-link", *common])
    assert again.exit_code == 1
    assert again.output == (
        "kiln: error: an admin link exists, and only its hash is stored: pass --rotate to make "
        "a new one (the old link stops working)\n"
    )
    rotated = _run("rate", "admin-link", *common, "--rotate").stdout.strip()
    old, new = first.stdout.strip().rsplit("/", 1)[1], rotated.rsplit("/", 1)[1]
    db = Layout(root).ratings_db()
    store = RatingStore.open(db)
    assert store.rater(rater) is not None and store.is_admin(new) and not store.is_admin(old)
    store.close()
    data = db.read_bytes()
    assert all(t.encode() not in data for t in (rater, old, new)), "no token in the file"
    assert db.stat().st_mode & 0o777 == 0o600


def test_report_sets_the_curation_clip_against_the_raters(setup, tmp_path):
    """With quality.clip_model set, `kiln rate report` prints each proxy's agreement with
    the votes (the CLIP score, and the aesthetic head's) and its interval."""
    import torch
    from safetensors.torch import save_file

    from tests.content_fixtures import tiny_clip

    config, root = setup
    head = tmp_path / "aesthetic.safetensors"
    save_file({"weight": torch.ones(1, 16), "bias": torch.zeros(1)}, head)
    data = yaml.safe_load(Path(config).read_text())
    data["quality"] |= {
        "clip_model": str(tiny_clip(tmp_path / "clip")),
        "aesthetic_head": str(head),
    }
    Path(config).write_text(yaml.safe_dump(data))
    common = ["--config", config, "--root", root]
    cid = _run("compare", *common, "--a", "run-a-1111", "--b", "run-b-2222", "--gold", "0")
    cid = cid.stdout.strip().splitlines()[-1]
    token = re.findall(
        r"/rate/([\w-]{32})$",
        _run("rate", "invite", *common, "--comparison", cid, "--raters", "1").stdout,
        re.M,
    )[0]
    store = RatingStore.open(Layout(root).ratings_db())
    rater = store.rater(token)
    while (task := store.next_task(rater)) is not None:
        store.record_vote(rater, task.task_id, {"quality": "left", "alignment": "right"})
    report = _run("rate", "report", *common, "--comparison", cid)
    assert report.exit_code == 0, report.output
    proxies = json.loads(report.stdout)["proxy_agreement"]
    assert set(proxies) == {"clip_score", "aesthetic"}
    for name, per_question in proxies.items():
        for q, cell in per_question.items():
            assert cell["pairs"] + cell["ties_skipped"] == 8, (name, q, cell)
            assert 0 <= cell["ci_low"] <= cell["agreement"] <= cell["ci_high"] <= 1, cell
