from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def test_prefect_yaml_entrypoints_exist_and_pass_config_paths():
    spec = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    for d in spec["deployments"]:
        file, func = d["entrypoint"].split(":")
        assert f"def {func}(" in (REPO / file).read_text()
        assert set(d["parameters"]) == {"config_path"}  # others are asked for in the UI
        assert (REPO / d["parameters"]["config_path"]).is_file()


def test_serve_builds_a_deployment_per_flow():
    import importlib.util

    spec = importlib.util.spec_from_file_location("serve", REPO / "deployments" / "serve.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    deps = mod.build_deployments("configs/tiny.yaml", "0 3 * * 0")
    names = {d.name for d in deps}
    assert names == {"retrain", "ingest", "validate", "shard", "train", "evaluate", "register"}
    retrain = next(d for d in deps if d.name == "retrain")
    assert retrain.parameters == {"config_path": "configs/tiny.yaml"}
    assert retrain.schedules and retrain.schedules[0].schedule.cron == "0 3 * * 0"


def test_the_human_eval_flow_has_a_deployment_to_start_from_the_ui():
    spec = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    (dep,) = [d for d in spec["deployments"] if d["name"] == "human-eval"]
    assert dep["entrypoint"] == "flows/human_eval.py:human_eval_flow" and "schedules" not in dep
