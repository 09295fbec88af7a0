"""A run's config is loaded once and snapshotted; its MLflow run ends with the training."""

import json
import os
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from flows.evaluate import evaluate_flow
from flows.register import register_flow
from flows.train import train_flow
from kiln_config import load_config, stable_hash
from tasks.launch.accelerate import LaunchError

pytestmark = pytest.mark.integration

ONE_STAGE = {
    "train.stages": [{"resolution": 32, "batch_size": 4, "learning_rate": 1e-3, "max_steps": 2}],
    "launch.health_check": False,
    "launch.max_restarts": 0,
    "evaluate.limit": 2,
    "evaluate.num_inference_steps": 1,
    "evaluate.batch_size": 2,
}


def _root_with_shards(tmp_path: Path, tiny_shards) -> tuple[Path, str]:
    """A fresh root that sees the session's catalog and shards (read-only use)."""
    _, shared, version = tiny_shards
    root = tmp_path / "root"
    root.mkdir()
    (shared / "vae").mkdir(exist_ok=True)  # the tiny preset's fitted VAE: fitted once, shared
    for kind in ("catalog", "shards", "vae"):
        (root / kind).symlink_to(shared / kind)
    return root, version


def _edit(path: Path, **dotted) -> None:
    cfg = yaml.safe_load(path.read_text())
    for key, value in dotted.items():
        *parents, leaf = key.split(".")
        node = cfg
        for p in parents:
            node = node[p]
        node[leaf] = value
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))


def test_editing_the_file_after_training_changes_neither_evaluate_nor_register(
    tmp_path, tiny_shards, demo_src, make_config
):
    root, dataset_version = _root_with_shards(tmp_path, tiny_shards)
    # The file's root is not the one used: --root overrides it, and the snapshot records that.
    user = make_config(tmp_path / "user.yaml", tmp_path / "not-this-root", demo_src, **ONE_STAGE)
    record = train_flow(load_config(user, root=str(root)), dataset_version=dataset_version)
    snapshot = root / "runs" / record["run_id"] / "config.yaml"
    snap = yaml.safe_load(snapshot.read_text())
    assert snap["storage"]["root"] == str(root), "overrides applied in the snapshot"
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    trained_run = client.get_run(record["mlflow_run_id"])
    trained = trained_run.info
    assert trained.status == "FINISHED", "ended when training ended, before register"
    # System metrics while the stage trained (one closing sample at least, however short).
    assert trained_run.data.metrics["system/cpu_utilization_percentage"] >= 0
    assert trained_run.data.metrics["system/system_memory_usage_megabytes"] > 0
    (ds,) = trained_run.inputs.dataset_inputs  # the MLflow UI's Datasets column
    assert ds.dataset.digest == dataset_version and ds.dataset.name == f"kiln-{dataset_version}"
    assert str(root / "shards" / dataset_version) in ds.dataset.source
    assert [t.value for t in ds.tags] == ["training"]
    exp = client.get_experiment(trained.experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development", "UI opens on runs"

    _edit(
        user,
        **{
            "evaluate.seeds": [7, 8],
            "registry.alias": "edited",
            "registry.model_name": "edited-name",
        },
    )
    study = evaluate_flow(load_config(user, root=str(root)), run_id=record["run_id"])
    items = json.loads((Path(study["path"]) / "study.json").read_text())["items"]
    assert {it["seed"] for it in items} == {0} and len(items) == 2, "the snapshot's settings"
    info = register_flow(
        load_config(user, root=str(root)), run_id=record["run_id"], study_id=study["study_id"]
    )
    assert (info["name"], info["alias"]) == ("kiln-t2i", "candidate")
    assert info["lineage"]["config_sha256"] == stable_hash(snap, 16)

    run = client.get_run(record["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.info.end_time == trained.end_time
    assert run.data.tags["kiln.model_version"] == info["version"]
    assert run.data.tags["kiln.config_sha256"] == stable_hash(snap, 16)
    version = client.get_model_version(info["name"], info["version"])
    assert version.run_id == record["mlflow_run_id"], "the model was logged into the run"
    leaked = {
        k: os.environ[k]
        for k in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")
        if os.environ.get(k) == uri
    }
    assert not leaked, "registering must not point this process's later subprocesses at it"
    for part in (
        record["run_id"],
        record["mlflow_run_id"],
        dataset_version,
        study["study_id"],
        f"models:/kiln-t2i/{info['version']}",
    ):
        assert part in version.description, part
    described = client.get_registered_model("kiln-t2i").description
    assert 'mlflow.pyfunc.load_model("models:/kiln-t2i@candidate")' in described


def test_a_failed_stage_ends_the_mlflow_run_failed(tmp_path, tiny_shards, demo_src, make_config):
    root, version = _root_with_shards(tmp_path, tiny_shards)
    broken = tmp_path / "broken-topology.yaml"
    broken.write_text("distributed_type: NOT_A_TYPE\nnum_processes: 1\n")
    user = make_config(
        tmp_path / "user.yaml",
        root,
        demo_src,
        **{**ONE_STAGE, "launch.accelerate_config": str(broken)},
    )
    with pytest.raises(LaunchError):
        train_flow(load_config(user), dataset_version=version, run_id="run-broken")
    record = json.loads((root / "runs" / "run-broken" / "run.json").read_text())
    run = MlflowClient(f"sqlite:///{root / 'mlflow.db'}").get_run(record["mlflow_run_id"])
    assert run.info.status == "FAILED"
