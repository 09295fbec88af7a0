"""End to end on the tiny preset: two tiny trainings (different seeds) -> studies ->
`kiln compare` -> simulated raters over HTTP -> `kiln rate report` -> the flow logs to MLflow.

The simulated raters follow the app's own pages and prefer model A with a known probability
(they look up which side is A in the store, as a real rater's taste would "know"). Every
rater rates every pair and each answer is a function of (rater, prompt), so the votes, and
the report, are the same on every run.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil

import httpx
import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from human_eval.store import RatingStore
from kiln_cli.main import main as cli
from kiln_config import load_config
from tasks.storage.layout import Layout
from tests.servers import free_port

from .conftest import start_server, stop

pytestmark = pytest.mark.e2e

P_A, RATERS = 0.75, 8


def _rater_answers(base, token, store, seed_key):
    """Answer every task of one rater; return the number answered."""
    n = 0
    with httpx.Client(timeout=30) as c:
        while True:
            page = c.get(f"{base}/rate/{token}")
            m = re.search(r'name="task_id" value="(\d+)"', page.text)
            if m is None:
                assert "Thank you" in page.text
                return n
            task = int(m.group(1))
            with store.engine.connect() as con:
                left, gold, prompt = con.exec_driver_sql(
                    "SELECT t.left, p.gold, p.prompt_index FROM tasks_served t "
                    "JOIN pairs p ON p.id = t.pair_id WHERE t.id = ?",
                    (task,),
                ).one()
            a_side = "left" if left == "a" else "right"
            b_side = "right" if a_side == "left" else "left"
            seed = int(hashlib.sha256(f"{seed_key}-{prompt}".encode()).hexdigest()[:8], 16)
            rng = np.random.default_rng(seed)
            form = {"task_id": task}
            for q in ("quality", "alignment"):
                prefers_a = rng.random() < P_A or (gold and q == "alignment")
                form[q] = a_side if prefers_a else b_side
            assert c.post(f"{base}/rate/{token}/vote", data=form).status_code == 303
            n += 1


def test_tiny_models_compared_by_simulated_raters(tmp_path, tiny_shards, demo_src, make_config):
    from flows.evaluate import evaluate_flow
    from flows.human_evaluation import human_eval_flow
    from flows.register import register_flow
    from flows.train import train_flow

    _, shared_root, version = tiny_shards
    root = tmp_path / "root"
    shutil.copytree(shared_root, root)  # the shared fixture is never modified
    studies = {}
    configs, runs = {}, {}
    for side, seed, alias in (("b", 2, "champion"), ("a", 1, "candidate")):
        cfg = make_config(
            tmp_path / f"{side}.yaml",
            root,
            demo_src,
            **{"train.seed": seed, "evaluate.limit": 10, "registry.alias": alias},
        )
        data = yaml.safe_load(cfg.read_text())
        data["train"]["stages"] = data["train"]["stages"][:1]  # one 32 px stage: fast
        data["human_eval"] = {
            "raters_per_pair": RATERS,
            "gold_per_rater": 2,
            "port": free_port(),
            "bootstrap_resamples": 2000,
        }
        cfg.write_text(yaml.safe_dump(data))
        runs[side] = train_flow(load_config(cfg), dataset_version=version, run_id=f"run-e2e-{side}")
        if side == "a":  # B's study is left to `kiln compare` to generate
            studies[side] = evaluate_flow(load_config(cfg), run_id=runs[side]["run_id"])["study_id"]
        model = register_flow(
            load_config(cfg), run_id=runs[side]["run_id"], study_id=studies.get(side)
        )
        configs[side] = cfg
    config_a = configs["a"]
    common = ["--config", str(config_a), "--root", str(root)]
    runner = CliRunner()
    # Registered models by alias: A's study exists and is reused (the id `kiln evaluate`
    # gave it); B's is generated first, with the same prompts, seeds and settings.
    made = runner.invoke(
        cli,
        [
            "compare",
            *common,
            "--a",
            "models:/kiln-t2i@candidate",
            "--b",
            "models:/kiln-t2i@champion",
        ],
    )
    assert made.exit_code == 0, made.output
    cid = made.stdout.strip().splitlines()[-1]
    studies["b"] = re.search(r"vs (run-e2e-b-\w+) \(B\)", made.stderr).group(1)
    assert f"{studies['a']} (A) vs" in made.stderr
    assert (root / "eval" / studies["b"] / "study.json").is_file()
    again = runner.invoke(cli, ["compare", *common, "--a", studies["a"], "--b", studies["b"]])
    assert again.stdout.strip().splitlines()[-1] == cid  # the same comparison
    links = runner.invoke(
        cli, ["rate", "invite", *common, "--comparison", cid, "--raters", str(RATERS)]
    ).stdout
    tokens = re.findall(r"/rate/(\S+)$", links, re.M)
    port = yaml.safe_load(config_a.read_text())["human_eval"]["port"]
    proc, base = start_server(["kiln_cli", "rate", "serve", *common], port)
    store = RatingStore.open(Layout(root).ratings_db())
    try:
        done = [_rater_answers(base, t, store, f"r{i}") for i, t in enumerate(tokens)]
    finally:
        stop(proc)
    assert done == [10 + 2] * RATERS  # every pair and both gold checks, for every rater

    report = runner.invoke(cli, ["rate", "report", *common, "--comparison", cid])
    assert report.exit_code == 0, report.output
    summary = json.loads(report.stdout)
    for q in ("quality", "alignment"):
        s = summary[q]
        assert s["votes"] == 10 * RATERS
        assert s["ci_low"] <= P_A <= s["ci_high"], s
    assert (root / "human_eval" / cid / "preference.png").stat().st_size > 10_000

    result = human_eval_flow(load_config(config_a), studies["a"], studies["b"], wait_s=0)
    from mlflow.tracking import MlflowClient

    tracking = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(tracking, registry_uri=tracking)
    run_a = json.loads((root / "runs" / "run-e2e-a" / "run.json").read_text())["mlflow_run_id"]
    metrics = client.get_run(run_a).data.metrics
    assert metrics["human_eval/quality_pref"] == pytest.approx(summary["quality"]["pref"])
    assert metrics["human_eval/alignment_pref_ci_low"] == pytest.approx(
        summary["alignment"]["ci_low"]
    )
    tags = client.get_model_version(model["name"], model["version"]).tags
    assert tags["human_eval.comparison"] == cid == result["comparison"]
