"""MLflow's fluent URI setters write os.environ; Kiln's MLflow calls must not leak it.

A leaked `MLFLOW_REGISTRY_URI` made every later subprocess (a worker's next flow run,
`mlflow models serve`, a consumer loading `models:/kiln-t2i@candidate`) read another run's
registry: the e2e serving test got a 32 px model from an earlier test's database.
"""

import os

import mlflow
import pytest

from tasks.registry.tracking import mlflow_uris


@pytest.mark.parametrize("before", [None, "sqlite:////elsewhere/mlflow.db"])
def test_the_uris_are_put_back_in_the_module_and_the_environment(tmp_path, monkeypatch, before):
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):
        if before is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, before)
    outside = (mlflow.get_tracking_uri(), mlflow.get_registry_uri())
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with mlflow_uris(uri):
        assert mlflow.get_tracking_uri() == mlflow.get_registry_uri() == uri
        assert os.environ["MLFLOW_REGISTRY_URI"] == uri
    assert (mlflow.get_tracking_uri(), mlflow.get_registry_uri()) == outside
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):
        assert os.environ.get(name) == before


def test_the_uris_are_put_back_when_the_block_raises(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    with pytest.raises(RuntimeError, match="boom"), mlflow_uris(f"sqlite:///{tmp_path}/m.db"):
        raise RuntimeError("boom")
    assert "MLFLOW_REGISTRY_URI" not in os.environ
