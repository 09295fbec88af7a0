from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent


def test_prefect_yaml_entrypoints_exist_and_pass_config_paths():
    spec = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    for d in spec["deployments"]:
        file, func = d["entrypoint"].split(":")
        assert f"def {func}(" in (REPO / file).read_text()
        assert set(d["parameters"]) == {"config"}  # others are asked for in the UI
        assert (REPO / d["parameters"]["config"]).is_file()


def test_serve_builds_a_deployment_per_flow():
    import importlib.util

    spec = importlib.util.spec_from_file_location("serve", REPO / "deployments" / "serve.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    deps = mod.build_deployments("configs/tiny.yaml", "0 3 * * 0")
    names = {d.name for d in deps}
    assert names == {"retrain", "ingest", "validate", "shard", "train", "evaluate", "register"}
    retrain = next(d for d in deps if d.name == "retrain")
    assert retrain.parameters == {"config": "configs/tiny.yaml"}
    assert retrain.schedules and retrain.schedules[0].schedule.cron == "0 3 * * 0"


def test_the_human_eval_flow_has_a_deployment_to_start_from_the_ui():
    spec = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    (dep,) = [d for d in spec["deployments"] if d["name"] == "human-eval"]
    assert dep["entrypoint"] == "flows/entry.py:human_eval"
    assert "schedules" not in dep


def test_training_deployments_never_overlap_and_weekly_retrain_warm_starts():
    from kiln_config import load_config

    spec = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    deps = {d["name"]: d for d in spec["deployments"]}
    for name in ("weekly-retrain", "from-scratch", "tiny-pipeline", "team-pipeline"):
        assert deps[name]["concurrency_limit"] == {"limit": 1, "collision_strategy": "ENQUEUE"}
    weekly = deps["weekly-retrain"]
    assert weekly["entrypoint"] == "flows/entry.py:retrain" and weekly["schedules"]
    cfg = load_config(REPO / weekly["parameters"]["config"])
    assert cfg.train.init_from_model == "models:/kiln-t2i@champion"
    assert len(cfg.train.stages) == 1, "one stage at the champion's final resolution"
    assert "schedules" not in deps["from-scratch"], "from scratch is on demand"


def test_no_flow_module_shadows_a_top_level_package():
    """A worker loads an entrypoint by path, with flows/ first on sys.path: a flows/X.py named like
    a package (a flows/human_eval.py would hide human_eval/) breaks the deployment's imports."""
    packages = {p.name for p in REPO.iterdir() if (p / "__init__.py").is_file()}
    modules = {p.stem for p in REPO.glob("*.py")}
    for folder in ("flows", "deployments"):
        stems = {p.stem for p in (REPO / folder).glob("*.py")}
        assert not stems & (packages | modules), f"{folder}/ shadows {stems & (packages | modules)}"


def test_each_entry_takes_a_config_path_and_the_parameters_of_its_flow():
    """Every step of the table has an entry; a deployment's form asks for a config path and
    the flow's own parameters; the run carries the flow's name."""
    import inspect

    from prefect.utilities.callables import parameter_schema

    from flows import entry
    from flows.steps import STEPS

    typed = {name: step.load_flow() for name, step in STEPS.items()}
    assert set(typed) == set(entry.__all__)
    for name, flow in typed.items():
        start = getattr(entry, name)
        assert start.name == flow.name
        assert parameter_schema(start).properties["config"]["type"] == "string"
        assert "$ref" in str(parameter_schema(flow).properties["config"]), "a PipelineConfig"
        ours = inspect.signature(start.fn).parameters
        theirs = inspect.signature(flow.fn).parameters
        assert list(ours)[1:] == list(theirs)[1:], name
        for p in list(ours)[1:]:
            assert (ours[p].annotation, ours[p].default) == (
                theirs[p].annotation,
                theirs[p].default,
            ), (name, p)


@pytest.mark.integration  # a Prefect flow run
def test_an_entry_loads_and_checks_its_path(tmp_path):
    """A bad path fails in the entry's own load, naming the file, before the flow's work."""
    from flows import entry
    from kiln_config import ConfigError

    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {stages: []}\n")
    state = entry.validate(str(bad), return_state=True)
    assert state.is_failed()
    with pytest.raises(ConfigError, match=str(bad)):
        state.result()
