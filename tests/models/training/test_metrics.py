"""System metrics into a real SQLite tracking store: stopped however the block ends."""

from __future__ import annotations

import threading

import pytest
from mlflow.tracking import MlflowClient

from models.training.metrics import system_metrics

CPU = "system/cpu_utilization_percentage"


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory) -> str:
    """One SQLite store for the module: creating one takes MLflow seconds of migrations."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def _monitor_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "SystemMetricsMonitor"]


def test_a_failing_stage_stops_the_monitor_and_keeps_a_closing_sample(tmp_path, tracking_uri):
    uri = tracking_uri
    client = MlflowClient(uri)
    exp = client.create_experiment("failing", artifact_location=(tmp_path / "art").as_uri())
    run_id = client.create_run(exp).info.run_id
    with (
        pytest.raises(RuntimeError, match="stage failed"),
        system_metrics(uri, run_id, is_main=True) as monitor,
    ):
        assert monitor is not None and _monitor_threads()
        raise RuntimeError("stage failed")
    assert not _monitor_threads(), "stopped on the error"
    with system_metrics(uri, run_id, is_main=True):  # the next stage, same run
        pass
    history = client.get_metric_history(run_id, CPU)
    assert [m.step for m in history] == [0, 1], "one closing sample each, steps continue"
    assert all(0 <= m.value <= 100 for m in history)
    assert client.get_run(run_id).data.metrics["system/system_memory_usage_megabytes"] > 0


def test_other_ranks_and_runs_without_tracking_log_nothing(tmp_path, tracking_uri):
    uri = tracking_uri
    client = MlflowClient(uri)
    exp = client.create_experiment("other-ranks", artifact_location=(tmp_path / "a").as_uri())
    run_id = client.create_run(exp).info.run_id
    with system_metrics(uri, run_id, is_main=False) as monitor:
        assert monitor is None
    with system_metrics(None, None, is_main=True) as monitor:
        assert monitor is None
    assert client.get_metric_history(run_id, CPU) == []
