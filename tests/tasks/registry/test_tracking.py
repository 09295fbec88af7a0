"""Registry helpers against a real SQLite tracking store in tmp_path (no server, no flow run)."""

from __future__ import annotations

import logging

import pytest
from mlflow.tracking import MlflowClient

from data_quality.verdict import ValidateResult
from kiln_config import EvaluateConfig
from kiln_config.errors import InputError
from tasks.registry.tracking import (
    EXPERIMENT_DESCRIPTION,
    EXPERIMENT_KIND,
    ensure_experiment,
    log_data_docs,
    mlflow_ui_url,
    resolve_pipeline,
    version_description,
)

KEY, KIND = EXPERIMENT_KIND
SUMMARY = ValidateResult(
    ingest_id="ing-1",
    listed=60,
    clean=50,
    rejected_ingest=4,
    rejected_validate=6,
    reject_fraction=10 / 60,
    max_reject_fraction=0.05,
    near_duplicates=1,
    manifest_problems=0,
    reasons={"too_small": 6},
).to_dict()  # summary.json, as validate writes it


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory) -> str:
    """One SQLite store for the module: creating one takes MLflow seconds of migrations."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def test_experiment_is_tagged_for_model_training_new_or_old(tmp_path, tracking_uri):
    assert (KEY, KIND) == ("mlflow.experimentKind", "custom_model_development")
    client = MlflowClient(tracking_uri)
    new = ensure_experiment(client, "kiln", str(tmp_path / "art"))
    assert client.get_experiment(new).tags[KEY] == KIND
    old = client.create_experiment("made-before-kiln-tagged-it", (tmp_path / "o").as_uri())
    assert ensure_experiment(client, "made-before-kiln-tagged-it", None) == old
    assert client.get_experiment(old).tags[KEY] == KIND
    chosen = client.create_experiment(
        "chosen", (tmp_path / "c").as_uri(), tags={KEY: "genai_development"}
    )
    ensure_experiment(client, "chosen", None)
    assert client.get_experiment(chosen).tags[KEY] == "genai_development", "a choice is kept"


def test_experiment_has_kilns_description_unless_a_person_wrote_one(tmp_path, tracking_uri):
    client = MlflowClient(tracking_uri)
    new = ensure_experiment(client, "described", str(tmp_path / "d"))
    note = client.get_experiment(new).tags["mlflow.note.content"]
    assert note == EXPERIMENT_DESCRIPTION and note.startswith("Kiln: text-to-image")
    old = client.create_experiment("undescribed", (tmp_path / "u").as_uri())
    ensure_experiment(client, "undescribed", None)
    assert client.get_experiment(old).tags["mlflow.note.content"] == EXPERIMENT_DESCRIPTION
    mine = client.create_experiment(
        "mine", (tmp_path / "m").as_uri(), tags={"mlflow.note.content": "my notes"}
    )
    ensure_experiment(client, "mine", None)
    assert client.get_experiment(mine).tags["mlflow.note.content"] == "my notes", "kept"


def test_ui_url_is_the_tracking_server_without_credentials_or_the_local_ui():
    assert mlflow_ui_url("sqlite:////r/mlflow.db") == "http://127.0.0.1:5000"
    assert mlflow_ui_url("postgresql://u:pw@db/mlflow") == "http://127.0.0.1:5000"
    assert mlflow_ui_url("https://u:pw@mlflow.example.com:8443/team/") == (
        "https://mlflow.example.com:8443/team"
    )


def test_data_docs_become_run_artifacts_behind_an_http_link(tmp_path, tracking_uri):
    docs = tmp_path / "quality" / "ing-1"
    (docs / "static").mkdir(parents=True)
    (docs / "index.html").write_text("<html>Data Docs</html>")
    (docs / "static" / "style.css").write_text("body {}")
    (docs / "validations" / "suite").mkdir(parents=True)
    (docs / "validations" / "suite" / "batch.html").write_text("<html>results</html>")
    uri = tracking_uri
    url = log_data_docs.fn(uri, "docs", "ing-1", str(docs), SUMMARY, str(tmp_path / "art"))
    client = MlflowClient(uri)
    (run,) = client.search_runs([ensure_experiment(client, "docs", None)])
    exp_id, run_id = run.info.experiment_id, run.info.run_id
    page = f"http://127.0.0.1:5000/#/experiments/{exp_id}/runs/{run_id}/artifacts"
    assert url == f"{page}/validations/suite/batch.html", "the results, not the index"
    assert run.info.run_name == "quality-ing-1" and run.info.status == "FINISHED"
    assert run.data.tags["kiln.quality_gate"] == "failed", "10/60 rejected > 5%"
    assert run.data.metrics["clean"] == 50 and run.data.metrics["quarantined.too_small"] == 6
    assert run.data.params["ingest_id"] == "ing-1"
    assert {a.path for a in client.list_artifacts(run_id)} == {
        "index.html",
        "static",
        "validations",
    }
    assert [a.path for a in client.list_artifacts(run_id, "static")] == ["static/style.css"]


def test_a_tracking_store_that_fails_gives_no_link_and_a_warning(tmp_path, caplog):
    (tmp_path / "docs").mkdir()
    (tmp_path / "a-file").write_text("not a folder")
    broken = f"sqlite:///{tmp_path / 'a-file' / 'mlflow.db'}"
    with caplog.at_level(logging.WARNING, logger="tasks.registry.tracking"):
        url = log_data_docs.fn(broken, "kiln", "ing-1", str(tmp_path / "docs"), SUMMARY)
    assert url is None
    assert any("not logged to MLflow" in r.getMessage() for r in caplog.records)


def test_version_description_names_data_run_and_how_to_load():
    text = version_description(
        "kiln-t2i",
        "3",
        {
            "run_id": "run-1",
            "mlflow_run_id": "abc",
            "dataset_version": "ds-9",
            "ingest_id": "ing-1",
            "source": "s3://b/raw",
            "study_id": "",
            "config_sha256": "f00",
        },
    )
    for part in ("`run-1`", "`abc`", "`ds-9`", "`ing-1`", "models:/kiln-t2i/3", "f00"):
        assert part in text, part
    assert "study" not in text, "no study was recorded"


def _tiny_export(dest) -> str:
    """A tiny exported pipeline, as models.train writes final/."""
    from pathlib import Path

    from diffusers import StableDiffusionPipeline

    from kiln_config import load_config
    from models.components.factory import build_components, sampling_scheduler

    repo = Path(__file__).resolve().parents[3]
    comps = build_components(load_config(repo / "configs" / "tiny.yaml").train.model)
    StableDiffusionPipeline(
        vae=comps.vae,
        text_encoder=comps.text_encoder,
        tokenizer=comps.tokenizer,
        unet=comps.unet,
        scheduler=sampling_scheduler(comps.noise_scheduler),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    ).save_pretrained(dest)
    return str(dest)


def test_registered_version_carries_the_validation_metrics(tmp_path, tracking_uri):
    """The last stage's validation loss and gap are logged on the logged model that the
    version is registered from (MLflow 3's model metrics); the curves PNG is a run artifact."""
    from tasks.registry.tracking import log_run_artifact, register_model

    client = MlflowClient(tracking_uri)
    exp = ensure_experiment(client, "kiln-val", str(tmp_path / "art"))
    run_id = client.create_run(exp).info.run_id
    client.set_terminated(run_id)
    png = tmp_path / "loss-curves.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n")
    assert log_run_artifact.fn(tracking_uri, run_id, str(png), "stage-32")
    assert [a.path for a in client.list_artifacts(run_id, "stage-32")] == [
        "stage-32/loss-curves.png"
    ]
    metrics = {"ema/val/loss": 0.25, "ema/val/cond_gap": 0.0125}
    info = register_model.fn(
        tracking_uri,
        run_id,
        _tiny_export(tmp_path / "final"),
        "kiln-val",
        "candidate",
        {"run_id": "run-1"},
        metrics,
        evaluate=EvaluateConfig(),
    )
    version = client.get_model_version("kiln-val", info["version"])
    model_id = version.source.removeprefix("models:/")
    logged = {m.key: m.value for m in client.get_logged_model(model_id).metrics}
    assert logged == metrics
    run_metrics = client.get_run(run_id).data.metrics
    assert {k: run_metrics[k] for k in metrics} == metrics, "the run has them too (promotion)"


def test_registered_model_defaults_to_the_steps_and_guidance_it_was_evaluated_with(
    tmp_path, tracking_uri
):
    """The pyfunc's default steps and guidance come from `evaluate`, in its signature and in
    `predict`; the params no config section holds keep the pyfunc's own defaults."""
    import mlflow

    from kiln_pyfunc import SERVING_PARAMS
    from tasks.registry.tracking import mlflow_uris, register_model

    client = MlflowClient(tracking_uri)
    run_id = client.create_run(ensure_experiment(client, "kiln-gen", str(tmp_path))).info.run_id
    client.set_terminated(run_id)
    evaluate = EvaluateConfig(num_inference_steps=3, guidance_scale=2.5)
    info = register_model.fn(
        tracking_uri,
        run_id,
        _tiny_export(tmp_path / "final"),
        "kiln-gen",
        "candidate",
        {"run_id": "run-1"},
        evaluate=evaluate,
    )
    with mlflow_uris(tracking_uri):
        model = mlflow.pyfunc.load_model(info["model_uri"])
    params = {p.name: p.default for p in model.metadata.signature.params}
    expected = {"num_inference_steps": 3, "guidance_scale": 2.5, **SERVING_PARAMS}
    assert params == expected
    assert model.unwrap_python_model().defaults == expected


def test_a_run_artifact_that_cannot_be_logged_is_a_warning(tmp_path, caplog):
    from tasks.registry.tracking import log_run_artifact

    with caplog.at_level(logging.WARNING):
        ok = log_run_artifact.fn(
            f"sqlite:///{tmp_path / 'm.db'}",
            "no-such-run",
            str(tmp_path / "missing.png"),
            "stage-32",
        )
    assert ok is False and "stays on disk" in caplog.text


def test_a_version_cannot_choose_where_kiln_reads_or_writes(tmp_path, tracking_uri):
    """A registered version's `run_id` tag and its MLmodel's artifact path are the registry's
    writers' words: one that leaves its folder is refused, naming it, before any file is
    read or written through it."""
    client = MlflowClient(tracking_uri, registry_uri=tracking_uri)
    root = tmp_path / "root"
    client.create_registered_model("escapes")
    model = tmp_path / "model"
    (model / "pipe").mkdir(parents=True)
    (model / "MLmodel").write_text(
        "flavors:\n  python_function:\n    artifacts:\n      pipeline:\n"
        "        path: ../../../outside\n"
    )
    tagged = client.create_model_version("escapes", str(model), tags={"run_id": "../../runs-x"})
    with pytest.raises(InputError, match=r"escapes version 1's run_id tag: .*'\.\./\.\./runs-x'"):
        resolve_pipeline(f"models:/escapes/{tagged.version}", tracking_uri, root)
    plain = client.create_model_version("escapes", str(model))
    with pytest.raises(
        InputError, match=r"path '\.\./\.\./\.\./outside' leaves the model's folder"
    ):
        resolve_pipeline(f"models:/escapes/{plain.version}", tracking_uri, root)
    assert not (tmp_path / "outside").exists()
