"""The human evaluation flow: a real Prefect flow run logging to a real MLflow store."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from human_eval.store import RatingStore
from human_eval.studies import create_comparison, load_study
from kiln_config import load_config
from tasks.storage.layout import Layout

from .conftest import many_prompts, write_study
from .test_report import _simulate

pytestmark = pytest.mark.integration


def _candidate_in_mlflow(root, tracking_uri):
    """A finished training run `run-cand` with its MLflow run and a registered version."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri, registry_uri=tracking_uri)
    exp = client.create_experiment("kiln", artifact_location=str(root / "mlartifacts"))
    run = client.create_run(exp, run_name="run-cand")
    client.set_terminated(run.info.run_id)
    client.create_registered_model("kiln-t2i")
    (root / "export").mkdir(parents=True)
    version = client.create_model_version("kiln-t2i", str(root / "export"), run.info.run_id)
    run_dir = root / "runs" / "run-cand"
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"mlflow_run_id": run.info.run_id}))
    return client, run.info.run_id, version.version


def test_flow_reports_and_logs_metrics_and_tags(tmp_path, make_config):
    from flows.human_evaluation import human_eval_flow

    root = tmp_path / "root"
    cfg = make_config(tmp_path / "tiny.yaml", root, tmp_path)
    data = yaml.safe_load(cfg.read_text())
    data["human_eval"] = {"raters_per_pair": 3, "gold_per_rater": 2, "bootstrap_resamples": 500}
    cfg.write_text(yaml.safe_dump(data))
    tracking = f"sqlite:///{root / 'mlflow.db'}"
    client, mlflow_run_id, version = _candidate_in_mlflow(root, tracking)

    prompts = many_prompts(20)
    a = write_study(root, "cand-study", prompts=prompts, size=8, model="run-cand")
    b = write_study(
        root, "champ-study", prompts=prompts, size=8, colour=(9, 9, 250), model="run-champ"
    )
    store = RatingStore.open(Layout(root).ratings_db())
    cid, _ = create_comparison(
        store, load_study(a), load_study(b), raters_per_pair=3, gold=2, name="cand-vs-champ"
    )
    _simulate(store, cid, 3, p_a=0.8, rng=np.random.default_rng(5))

    result = human_eval_flow(
        load_config(cfg), "cand-study", "champ-study", name="cand-vs-champ", wait_s=30, poll_s=1
    )
    assert result["comparison"] == cid and result["wait"]["complete"]
    report = json.loads((root / "human_eval" / cid / "report.json").read_text())
    logged = client.get_run(mlflow_run_id).data
    for q in ("quality", "alignment"):
        cell = report["questions"][q]["overall"]
        assert logged.metrics[f"human_eval/{q}_pref"] == pytest.approx(cell["pref"])
        assert logged.metrics[f"human_eval/{q}_pref_ci_low"] == pytest.approx(cell["ci_low"])
        assert logged.metrics[f"human_eval/{q}_votes"] == 20 * 3
    assert logged.tags["human_eval.comparison"] == cid
    arts = {f.path for f in client.list_artifacts(mlflow_run_id, f"human_eval/{cid}")}
    assert {f"human_eval/{cid}/preference.png", f"human_eval/{cid}/votes.csv"} <= arts
    tags = client.get_model_version("kiln-t2i", version).tags
    assert tags["human_eval.comparison"] == cid
    assert float(tags["human_eval.quality_pref"]) == pytest.approx(
        report["questions"]["quality"]["overall"]["pref"]
    )
    assert result["mlflow"]["versions"] == [version]
    card = client.get_model_version("kiln-t2i", version).description
    assert f"**Human evaluation**: comparison `{cid}` against `run-champ`: quality" in card
    chart = result["mlflow"]["chart_url"]
    assert chart.startswith("http://127.0.0.1:5000/#/experiments/")
    assert chart.endswith(f"/runs/{mlflow_run_id}/artifacts/human_eval/{cid}/preference.png")
    for q in ("quality", "alignment"):
        assert logged.metrics[f"human_eval/{q}_min_votes_per_pair"] == 3
        for cat, cell in report["questions"][q]["categories"].items():
            assert logged.metrics[f"human_eval/{q}_pref/{cat.lower().replace(' ', '_')}"] == (
                pytest.approx(cell["pref"])
            )

    # The champion gate reads exactly these numbers from MLflow (real flow runs).
    from flows.promote import promote_flow, rollback_flow
    from tasks.registry.promotion import PromotionRefused

    champ_run = client.create_run(client.get_experiment_by_name("kiln").experiment_id)
    (root / "champ-export").mkdir()
    champ = client.create_model_version(
        "kiln-t2i", str(root / "champ-export"), champ_run.info.run_id, tags={"run_id": "run-champ"}
    )
    promote_flow(load_config(cfg), candidate=f"models:/kiln-t2i/{champ.version}", first=True)
    strict = yaml.safe_load(cfg.read_text())
    strict["registry"]["gate"] = {"min_votes_per_pair": 4}
    (tmp_path / "strict.yaml").write_text(yaml.safe_dump(strict))
    with pytest.raises(PromotionRefused, match="fewest votes on a pair 3, need 4"):
        promote_flow(load_config(tmp_path / "strict.yaml"), candidate=f"models:/kiln-t2i/{version}")
    out = promote_flow(load_config(cfg), candidate=f"models:/kiln-t2i/{version}")
    assert out["outcome"] == "promoted" and out["previous_champion"] == champ.version
    assert client.get_model_version_by_alias("kiln-t2i", "champion").version == version
    assert rollback_flow(load_config(cfg), reason="test")["champion"] == champ.version
