"""The train and register flows with a validation split: the stage's Prefect summary shows the
held-out loss and gap, the loss curves land in the stage folder and the MLflow run, and the
registered version carries the last stage's validation metrics."""

import json
import shutil

import pytest
from mlflow.tracking import MlflowClient

from kiln_config import load_config
from tests.flows.artifacts import run_artifacts

pytestmark = pytest.mark.integration  # Prefect flow runs, accelerate launches


def test_train_and_register_flows_show_the_validation_loss(
    tmp_path, tiny_shards, demo_src, make_config
):
    from flows.register import register_flow
    from flows.train import train_flow

    _, shared_root, version = tiny_shards
    root = tmp_path / "root"
    shutil.copytree(shared_root, root)  # the session's root is shared: never modify it
    assert (root / "shards" / version / "32-val" / "index.json").is_file(), "no held-out split"
    stage = {"resolution": 32, "batch_size": 4, "learning_rate": 5e-4, "max_steps": 2}
    cfg = make_config(
        tmp_path / "c.yaml",
        root,
        demo_src,
        **{
            "train.stages": [stage],
            "train.eval_every": 1,
            "train.val_max_samples": 4,
            "train.val_timesteps": 2,
            "train.log_every": 1,
            "launch.health_check": False,
        },
    )
    state = train_flow(load_config(cfg), dataset_version=version, return_state=True)
    record = state.result()
    stage_dir = root / "runs" / record["run_id"] / "stage-32"
    val = record["stages"]["32"]["val"]
    assert val["step"] == 2 and {"ema/val/loss", "raw/val/cond_gap"} <= val.keys()
    md = run_artifacts("stage-32", state)[0].data
    assert "### Validation at step 2" in md and "| conditioning gap |" in md
    assert f"{val['ema/val/loss']:.5g}" in md
    assert (stage_dir / "loss-curves.png").is_file() and str(stage_dir / "loss-curves.png") in md
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    run_id = record["mlflow_run_id"]
    assert [a.path for a in client.list_artifacts(run_id, "stage-32")] == [
        "stage-32/loss-curves.png"
    ]
    history = client.get_metric_history(run_id, "stage32/ema/val/loss")
    assert [m.step for m in history] == [1, 2]
    assert history[-1].value == val["ema/val/loss"]
    info = register_flow(load_config(cfg), run_id=record["run_id"])
    version_ = client.get_model_version(info["name"], info["version"])
    logged = client.get_logged_model(version_.source.removeprefix("models:/"))
    metrics = {m.key: m.value for m in logged.metrics}
    assert metrics["ema/val/loss"] == val["ema/val/loss"]
    assert metrics["ema/val/cond_gap"] == val["ema/val/cond_gap"]
    assert json.loads((root / "runs" / record["run_id"] / "run.json").read_text())["stages"]
