import json
import re
from pathlib import Path

import pytest

from kiln_config.errors import InputError
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


def test_every_folder_under_the_root_is_a_layout_path(tmp_path):
    layout = Layout(tmp_path)
    assert layout.folder("runs") == tmp_path / "runs"
    assert layout.run_record("run-a") == tmp_path / "runs" / "run-a" / "run.json"
    assert layout.plan() == tmp_path / "runs" / "plan.json"
    assert layout.catalog_tables() == tmp_path / "catalog" / "tables"
    assert layout.ratings_db() == tmp_path / "human_eval" / "ratings.db"
    assert layout.comparison("cmp-1") == tmp_path / "human_eval" / "cmp-1"
    assert layout.registered_model("kiln-t2i", 3) == tmp_path / "models" / "kiln-t2i-v3"
    assert layout.mlflow_artifacts() == tmp_path / "mlartifacts"
    assert layout.train_lock() == tmp_path / ".kiln-train.lock"
    with pytest.raises(AssertionError):
        layout.folder("human_eval")  # not a kind with a LATEST pointer


def test_no_path_under_the_root_is_built_outside_layout():
    """`<root> / "name"` appears only in tasks/storage/layout.py, so that the storage map is
    the one place that says where a step's output lives."""
    repo = Path(__file__).resolve().parents[3]
    by_hand = re.compile(r"""\broot\)* / f?["']""")
    found = [
        f"{path.relative_to(repo)}:{n}: {line.strip()}"
        for pkg in (
            "kiln_cli",
            "flows",
            "tasks",
            "models",
            "human_eval",
            "kiln_demo",
            "deployments",
        )
        for path in sorted((repo / pkg).rglob("*.py"))
        if path != repo / "tasks" / "storage" / "layout.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if by_hand.search(line)
    ]
    assert found == []


@pytest.mark.parametrize("bad", ["../escape", "..", ".hidden", "a/b", "a\\b", "", "x" * 129, None])
def test_an_id_that_is_not_one_path_component_is_refused(tmp_path, bad):
    layout = Layout(tmp_path)
    for build in (layout.run, layout.catalog, layout.shards, layout.study, layout.comparison):
        with pytest.raises(InputError, match="an id is letters, digits"):
            build(bad)
    with pytest.raises(InputError):
        layout.registered_model(bad, 1)
    assert layout.run("run-20260101-000000.1_a") == tmp_path / "runs" / "run-20260101-000000.1_a"
