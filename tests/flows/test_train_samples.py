"""The train flow's sample-grid artifact: a real flow run of one short stage."""

import re
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from mlflow.tracking import MlflowClient

from kiln_config import load_config
from tests.flows.artifacts import run_artifacts

pytestmark = pytest.mark.integration


def test_each_stage_publishes_its_newest_grid(tmp_path, tiny_shards, demo_src, make_config):
    from flows.train import train_flow

    _, shared, version = tiny_shards
    root = tmp_path / "root"
    root.mkdir()
    (shared / "vae").mkdir(exist_ok=True)
    for kind in ("catalog", "shards", "vae"):  # the session's shards and fitted VAE
        (root / kind).symlink_to(shared / kind)
    cfg = make_config(
        tmp_path / "c.yaml",
        root,
        demo_src,
        **{
            "train.stages": [
                {"resolution": 32, "batch_size": 4, "learning_rate": 1e-3, "max_steps": 2}
            ],
            "train.sample_every": 1,
            "launch.health_check": False,
            "launch.max_restarts": 0,
        },
    )
    state = train_flow(load_config(cfg), dataset_version=version, return_state=True)
    record = state.result()
    stage = root / "runs" / record["run_id"] / "stage-32"
    grids = [str(stage / "samples" / f"step-{s:06d}.png") for s in (1, 2)]
    assert record["stages"]["32"]["samples"] == grids
    (artifact,) = run_artifacts("samples-32", state)
    md = artifact.data
    assert md.startswith("## Samples of stage 32px at step 2\n")
    assert f"On disk: `{grids[1]}` (2 grids" in md
    url = re.search(r"!\[samples of stage 32px at step 2\]\((\S+)\)", md).group(1)
    assert url.startswith("http://127.0.0.1:5000/get-artifact?")  # `kiln mlflow-ui` serves it
    query = parse_qs(urlsplit(url).query)
    assert query["run_uuid"] == [record["mlflow_run_id"]]
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    logged = {a.path for a in client.list_artifacts(record["mlflow_run_id"], "images")}
    assert query["path"][0] in logged and "+step+2+" in query["path"][0]
    assert Path(grids[0]).is_file()
