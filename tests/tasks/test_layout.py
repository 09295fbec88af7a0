import json

import pytest

from tasks.storage.layout import Layout


def test_latest_pointer_and_missing_input(tmp_path):
    layout = Layout(tmp_path)
    with pytest.raises(FileNotFoundError, match="run `kiln shard` first"):
        layout.latest("shards", "train")
    layout.set_latest("shards", "ds-1")
    assert layout.latest("shards", "train") == "ds-1"


def test_finished_run_requires_an_export(tmp_path):
    layout = Layout(tmp_path)
    layout.run("run-a").mkdir(parents=True)
    (layout.run("run-a") / "run.json").write_text(json.dumps({"run_id": "run-a"}))
    layout.set_latest("runs", "run-a")
    with pytest.raises(FileNotFoundError, match="kiln train --run-id run-a"):
        layout.finished_run(None, "evaluate")
    (layout.run("run-a") / "run.json").write_text(json.dumps({"run_id": "run-a", "export": "x"}))
    assert layout.finished_run(None, "evaluate") == ("run-a", {"run_id": "run-a", "export": "x"})
    with pytest.raises(FileNotFoundError, match="no training run run-b"):
        layout.finished_run("run-b", "register")
