"""The champion gate against a real MLflow registry (SQLite): promote, refuse, force, rollback."""

from __future__ import annotations

import json

import pytest
from mlflow.tracking import MlflowClient

from kiln_config import GateConfig
from tasks.registry.promotion import CHAMPION, PREVIOUS, PromotionRefused, gate, promote, rollback

GOOD = {
    **{f"human_eval/{q}_min_votes_per_pair": 5.0 for q in ("quality", "alignment")},
    **{f"human_eval/{q}_pref_ci_low": 0.56 for q in ("quality", "alignment")},
    **{
        f"human_eval/{q}_pref/{c}": 0.6
        for q in ("quality", "alignment")
        for c in ("colors", "counting")
    },
}
AGAINST = {"human_eval.comparison": "cand-vs-champ", "human_eval.against": "run-champ"}


def test_gate_passes_good_numbers_and_names_each_failure():
    cfg = GateConfig()
    ok = gate(GOOD, AGAINST, {"run-champ"}, cfg)
    assert ok.passed and {c["check"] for c in ok.checks} >= {
        "comparison",
        "quality votes",
        "alignment categories",
    }
    bad = dict(GOOD)
    bad["human_eval/quality_min_votes_per_pair"] = 2.0
    bad["human_eval/alignment_pref_ci_low"] = 0.48
    bad["human_eval/quality_pref/counting"] = 0.3
    d = gate(bad, AGAINST, {"run-champ"}, cfg, champion_metrics={})
    assert not d.passed
    text = "\n".join(d.failures)
    assert "quality votes: fewest votes on a pair 2, need 3" in text
    assert "alignment preference: 95% CI low 0.48, need >= 0.5" in text
    assert "quality categories: lowest counting 0.3, need >= 0.4" in text
    # A comparison against another model than the champion does not count.
    other = gate(GOOD, {**AGAINST, "human_eval.against": "run-old"}, {"run-champ"}, cfg)
    assert [c["check"] for c in other.checks if not c["ok"]] == ["comparison"]
    assert not gate({}, {}, {"run-champ"}, cfg).passed  # no evaluation at all


def test_gate_checks_the_validation_loss_only_when_both_have_it():
    cfg = GateConfig(max_val_loss_increase=0.02)
    worse = {**GOOD, "ema/val/loss": 0.110}
    assert not gate(worse, AGAINST, {"run-champ"}, cfg, {"ema/val/loss": 0.100}).passed
    assert gate(
        {**GOOD, "ema/val/loss": 0.101}, AGAINST, {"run-champ"}, cfg, {"ema/val/loss": 0.100}
    ).passed
    assert gate(worse, AGAINST, {"run-champ"}, cfg, {}).passed


def _version(client, root, name, run_name, metrics, tags=None):
    exp = client.get_experiment_by_name("kiln") or client.get_experiment(
        client.create_experiment("kiln", artifact_location=str(root / "mlartifacts"))
    )
    run = client.create_run(exp.experiment_id, run_name=run_name)
    for k, v in metrics.items():
        client.log_metric(run.info.run_id, k, v)
    client.set_terminated(run.info.run_id)
    if not client.search_registered_models(f"name = '{name}'"):
        client.create_registered_model(name)
    src = root / "exports" / run_name
    src.mkdir(parents=True)
    mv = client.create_model_version(
        name, str(src), run.info.run_id, tags={"run_id": run_name, **(tags or {})}
    )
    return mv.version


@pytest.fixture
def registry(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    return uri, MlflowClient(uri, registry_uri=uri), tmp_path


def test_first_promote_gate_refusal_force_and_rollback(registry):
    uri, client, root = registry
    cfg = GateConfig()
    v1 = _version(client, root, "kiln-t2i", "run-champ", {"ema/val/loss": 0.1})
    with pytest.raises(PromotionRefused, match="no champion yet.*--first"):
        promote(uri, f"models:/kiln-t2i/{v1}", cfg)
    first = promote(uri, f"models:/kiln-t2i/{v1}", cfg, first=True)
    assert first["outcome"] == "first"
    assert client.get_model_version_by_alias("kiln-t2i", CHAMPION).version == v1

    # A candidate without enough votes is refused; champion stays, the refusal is recorded.
    thin = {**GOOD, "human_eval/alignment_min_votes_per_pair": 1.0}
    v2 = _version(client, root, "kiln-t2i", "run-cand", thin, AGAINST)
    client.set_registered_model_alias("kiln-t2i", "candidate", v2)
    with pytest.raises(PromotionRefused) as e:
        promote(uri, "models:/kiln-t2i@candidate", cfg)
    assert "alignment votes: fewest votes on a pair 1, need 3" in str(e.value)
    assert "--force --reason" in str(e.value)
    assert client.get_model_version_by_alias("kiln-t2i", CHAMPION).version == v1
    tags = client.get_model_version("kiln-t2i", v2).tags
    assert tags["kiln.promotion.outcome"] == "refused"
    checks = json.loads(tags["kiln.promotion.checks"])
    assert any(c["check"] == "alignment votes" and not c["ok"] for c in checks)

    with pytest.raises(PromotionRefused, match="--force needs --reason"):
        promote(uri, "models:/kiln-t2i@candidate", cfg, force=True)
    forced = promote(uri, "models:/kiln-t2i@candidate", cfg, force=True, reason="launch demo")
    assert forced["outcome"] == "forced" and forced["previous_champion"] == v1
    assert client.get_model_version_by_alias("kiln-t2i", CHAMPION).version == v2
    assert client.get_model_version_by_alias("kiln-t2i", PREVIOUS).version == v1
    assert client.get_model_version("kiln-t2i", v2).tags["kiln.promotion.reason"] == "launch demo"
    with pytest.raises(PromotionRefused, match="already champion"):
        promote(uri, f"models:/kiln-t2i/{v2}", cfg)

    back = rollback(uri, "kiln-t2i", reason="bad outputs")
    assert back["champion"] == v1
    assert client.get_model_version_by_alias("kiln-t2i", CHAMPION).version == v1
    assert client.get_model_version_by_alias("kiln-t2i", PREVIOUS).version == v2
    assert "bad outputs" in client.get_model_version("kiln-t2i", v1).tags["kiln.rollback"]


def test_a_preferred_candidate_is_promoted(registry):
    uri, client, root = registry
    v1 = _version(client, root, "kiln-t2i", "run-champ", {"ema/val/loss": 0.1})
    promote(uri, f"models:/kiln-t2i/{v1}", GateConfig(), first=True)
    v2 = _version(client, root, "kiln-t2i", "run-cand", {**GOOD, "ema/val/loss": 0.09}, AGAINST)
    out = promote(uri, f"models:/kiln-t2i/{v2}", GateConfig())
    assert out["outcome"] == "promoted" and out["passed"] and out["previous_champion"] == v1
    assert client.get_model_version_by_alias("kiln-t2i", CHAMPION).version == v2
    assert client.get_model_version("kiln-t2i", v2).tags["kiln.promotion.outcome"] == "promoted"
    with pytest.raises(PromotionRefused, match="does not exist"):
        promote(uri, "models:/kiln-t2i/99", GateConfig())
    with pytest.raises(PromotionRefused, match="no previous-champion"):
        rollback(uri, "other-model")
