"""The ingest flow's `kiln.ingest.completed` event data: new images since the newest training,
and when a retrain is due (real ingest flow runs; the trigger itself is tested on a real
server in tests/test_scheduler.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flows.ingest import ingest_flow
from kiln_config import load_config
from tasks.quality.validate import validate_catalog
from tasks.registry.new_data import new_data
from tasks.reports import new_data_report
from tasks.shards.write import write_shards
from tasks.storage.layout import Layout

pytestmark = pytest.mark.integration


def _train_on(cfg_path, ingest_id: str, run_id: str, finished: bool = True) -> str:
    """What a training run leaves for the count: shards of `ingest_id` and a run.json naming
    them (with an export once it finished)."""
    cfg = load_config(cfg_path)
    root = cfg.storage.root
    validate_catalog.fn(root, ingest_id, cfg.quality)
    res = write_shards.fn(
        cfg.shards,
        root,
        ingest_id,
        [cfg.train.stages[0].resolution],
        tokenizer=cfg.train.model.tokenizer.model_dump(),
    )
    layout = Layout(Path(root))
    layout.run(run_id).mkdir(parents=True)
    record = {"dataset_version": res.dataset_version}
    if finished:
        record["export"] = str(layout.run(run_id) / "stage-32" / "final")
    (layout.run(run_id) / "run.json").write_text(json.dumps(record))
    layout.set_latest("runs", run_id)
    return run_id


def test_new_images_since_the_last_training_make_a_retrain_due(tmp_path, landing_src, make_config):
    src, land = landing_src
    cfg = make_config(
        tmp_path / "tiny.yaml", tmp_path / "root", src, **{"retrain.min_new_images": 10}
    )
    first = ingest_flow(load_config(cfg))["new_data"]
    accepted = first["view_accepted"]
    assert first["new_since_training"] == accepted == first["new_accepted"] > 10
    # Nothing to continue from yet: the first model is trained from scratch.
    assert first["trained_run_id"] is None and not first["retrain_due"]
    text = new_data_report(new_data(tmp_path / "root", first["ingest_id"], 0, 10, True))
    assert "no finished training to continue from" in text

    done = _train_on(cfg, first["ingest_id"], "run-20260101-000000")
    again = ingest_flow(load_config(cfg))["new_data"]
    assert (again["new_accepted"], again["new_since_training"]) == (0, 0)
    assert again["trained_run_id"] == done and not again["retrain_due"]
    assert "not due (0 < 10)" in new_data_report(
        new_data(tmp_path / "root", again["ingest_id"], 0, 10, True)
    )

    landed = land()
    after = ingest_flow(load_config(cfg))["new_data"]
    assert after["new_accepted"] == after["new_since_training"] == landed == 15
    assert after["trained_ingest_id"] == first["ingest_id"] and after["retrain_due"]
    text = new_data_report(new_data(tmp_path / "root", after["ingest_id"], 15, 10, True))
    assert "15 accepted images are new or changed since the catalog" in text
    assert "Retrain: **due**" in text

    # The pipeline's own ingest never asks for another pipeline.
    inner = ingest_flow(load_config(cfg), standalone=False)["new_data"]
    assert inner["new_since_training"] == 15 and not inner["retrain_due"]

    # A newer run that never finished (crashed, cancelled) trained on nothing: the baseline
    # stays the finished one.
    _train_on(cfg, after["ingest_id"], "run-20260102-000000", finished=False)
    crashed = ingest_flow(load_config(cfg))["new_data"]
    assert crashed["trained_run_id"] == done and crashed["new_since_training"] == 15


def test_a_training_in_progress_holds_the_retrain_back(tmp_path, landing_src, make_config):
    src, land = landing_src
    root = tmp_path / "root"
    cfg = make_config(tmp_path / "tiny.yaml", root, src, **{"retrain.min_new_images": 10})
    _train_on(cfg, ingest_flow(load_config(cfg))["ingest_id"], "run-20260101-000000")
    land()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from tasks.storage.lock import root_lock\n"
            f"with root_lock({str(root)!r}, 'kiln train'):\n"
            "    print('held', flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        busy = ingest_flow(load_config(cfg))["new_data"]
    finally:
        holder.kill()
        holder.wait()
    assert busy["root_busy"] and not busy["retrain_due"]
    assert busy["new_since_training"] >= 10
    assert ingest_flow(load_config(cfg))["new_data"]["retrain_due"], "due once the training is gone"
