"""Real Prefect flow runs (session-wide prefect_test_harness), steps run on their own."""

import asyncio
import json
import re
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient
from streaming import StreamingDataset

from data_quality.verdict import QualityGateError
from flows.ingest import ingest_flow
from flows.shard import shard_flow
from flows.validate import validate_flow
from kiln_config import load_config
from tests.flows.artifacts import run_artifacts

pytestmark = pytest.mark.integration  # accelerate launches / Prefect flow runs


def _data_docs_run(root: Path, markdown: str, ingest_id: str):
    """The MLflow run that the quality-gate artifact's http link points at; asserts the link
    is one, and that the run holds the Data Docs site."""
    m = re.search(
        r"\(http://127\.0\.0\.1:5000/#/experiments/(\w+)/runs/(\w+)/artifacts/"
        r"(validations/\S+\.html)\)",
        markdown,
    )
    assert m, f"no http link to the Data Docs' validation results in:\n{markdown}"
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    run = client.get_run(m.group(2))
    assert run.info.experiment_id == m.group(1) and run.info.run_name == f"quality-{ingest_id}"
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"index.html", "static", "summary.json", "quarantine_sample.parquet"} <= names, names
    assert "quarantine.parquet" not in names, "the whole quarantine stays on disk"
    folder = m.group(3).rsplit("/", 1)[0]
    assert m.group(3) in {a.path for a in client.list_artifacts(run.info.run_id, folder)}
    exp = client.get_experiment(run.info.experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    return run


def test_steps_run_alone_from_an_s3_source(
    tmp_path, demo_src, make_config, s3_bucket, s3_endpoint, upload_dir
):
    bucket, client = s3_bucket
    upload_dir(client, bucket, "raw", demo_src)
    cfg = make_config(
        tmp_path / "c.yaml",
        tmp_path / "root",
        f"s3://{bucket}/raw",
        **{"storage.endpoint_url": s3_endpoint},
    )
    ing_state = ingest_flow(load_config(cfg), return_state=True)
    ing = ing_state.result()
    assert ing["listed"] == 60 and ing["source"] == f"s3://{bucket}/raw"
    q_state = validate_flow(load_config(cfg), return_state=True)  # finds the catalog through LATEST
    q = q_state.result()
    assert q["ingest_id"] == ing["ingest_id"] and q["passed"]
    shards = shard_flow(load_config(cfg))  # re-reads the images from S3
    s32 = shards["stages"][32]
    assert s32["samples"] + s32["val_samples"] == q["clean"], "every clean image is >= 32 px"
    assert s32["val_samples"] > 0, "tiny.yaml holds some images out for validation"
    assert (
        tmp_path / "root" / "shards" / shards["dataset_version"] / "64" / "index.json"
    ).is_file()
    assert all("60** items listed" in a.data for a in run_artifacts("ingest-summary", ing_state))
    docs = tmp_path / "root" / "quality" / ing["ingest_id"] / "index.html"
    (gate,) = run_artifacts("quality-gate", q_state)
    assert str(docs) in gate.data, "Data Docs on disk"
    run = _data_docs_run(tmp_path / "root", gate.data, ing["ingest_id"])
    assert run.data.metrics["clean"] == q["clean"]
    assert run.data.tags["kiln.quality_gate"] == "passed"


def test_a_flow_run_records_its_config_without_credentials(tmp_path, demo_src, make_config):
    """A flow given the loaded config (as `kiln run` and its subflows pass it) records it as
    the run's parameters in Prefect's database: credentials in its URIs are masked there,
    while the flow itself, and the run's snapshot, use them."""
    from prefect.client.orchestration import get_client

    from kiln_config import load_config
    from kiln_config.pipeline import _snapshot_text

    cfg = load_config(make_config(tmp_path / "c.yaml", tmp_path / "root", demo_src))
    cfg.storage.endpoint_url = "http://AKIDKILN:endpoint-s3cr3t@127.0.0.1:9"  # unused: a folder
    cfg.human_eval.database_url = "postgresql://kiln:db-s3cr3t@127.0.0.1:9/ratings"  # unused
    state = ingest_flow(cfg, return_state=True)
    assert state.is_completed(), state

    async def read():
        async with get_client() as client:
            return await client.read_flow_run(state.state_details.flow_run_id)

    recorded = asyncio.run(read()).parameters["config"]
    assert "s3cr3t" not in json.dumps(recorded)
    assert recorded["storage"]["endpoint_url"] == "http://AKIDKILN:***@127.0.0.1:9"
    assert recorded["human_eval"]["database_url"] == "postgresql://kiln:***@127.0.0.1:9/ratings"
    assert recorded["storage"]["root"] == cfg.storage.root, "only the secrets are masked"
    assert "endpoint-s3cr3t" in _snapshot_text(cfg), "the snapshot loads back to the same config"


def test_quality_gate_fails_the_flow_and_publishes_the_reasons(tmp_path, demo_src, make_config):
    cfg = make_config(
        tmp_path / "c.yaml",
        tmp_path / "root",
        demo_src,
        **{"quality.min_side": 90, "quality.max_reject_fraction": 0.05},
    )
    ingest_flow(load_config(cfg))
    state = validate_flow(load_config(cfg), return_state=True)
    with pytest.raises(QualityGateError, match="quality gate failed"):
        state.result()
    summary = json.loads(next((tmp_path / "root" / "quality").glob("*/summary.json")).read_text())
    assert not summary["passed"] and summary["reasons"]["too_small"] > 0
    (gate,) = run_artifacts("quality-gate", state)
    assert "FAILED" in gate.data and "too_small" in gate.data
    run = _data_docs_run(tmp_path / "root", gate.data, summary["ingest_id"])
    assert run.data.tags["kiln.quality_gate"] == "failed", "a failed gate's docs are linked too"
    assert run.data.metrics["quarantined.too_small"] == summary["reasons"]["too_small"]


def test_shard_before_validate_says_so(tmp_path, demo_src, make_config):
    cfg = make_config(tmp_path / "c.yaml", tmp_path / "root", demo_src)
    ingest_flow(load_config(cfg))
    with pytest.raises(FileNotFoundError, match="run `kiln validate` first"):
        shard_flow(load_config(cfg))


@pytest.mark.e2e
def test_precompute_in_the_shard_flow_and_training_on_latents(
    tmp_path, demo_src, make_config, s3_bucket, s3_endpoint
):
    """Precomputed latents for a stage in aspect buckets (and its validation split), published
    to S3 (moto's server), and training that streams them from there through a local cache.
    One 64 px stage: each stage is a precompute launch and a training launch, and the flows
    treat every stage alike (tests/models/test_precompute.py checks a square 32 px stage's
    latents against the training path)."""
    from flows.train import train_flow
    from tasks.storage.objects import Storage

    bucket, _ = s3_bucket
    stages = [
        {
            "resolution": 64,
            "batch_size": 4,
            "learning_rate": 2.0e-4,
            "max_steps": 4,
            "gradient_accumulation_steps": 2,
        }
    ]
    cfg = make_config(
        tmp_path / "c.yaml",
        tmp_path / "root",
        demo_src,
        **{
            "shards.precompute": True,
            "train.checkpoint_every": 100,
            "train.stages": stages,
            "shards.aspect_buckets": True,
            "shards.bucket_step": 8,
            "shards.remote": f"s3://{bucket}/datasets",
            "storage.endpoint_url": s3_endpoint,
        },
    )
    ingest_flow(load_config(cfg))
    validate_flow(load_config(cfg))
    shards = shard_flow(load_config(cfg))
    version = shards["dataset_version"]
    assert shards["remote"] == f"s3://{bucket}/datasets/{version}"
    published = {o.key for o in Storage(f"s3://{bucket}/datasets", s3_endpoint).list(version)}
    latents_64 = Path(shards["stages"][64]["latents"]).name
    val_latents_64 = Path(shards["stages"][64]["val_latents"]).name
    tops = (
        "64/buckets.json",
        f"{latents_64}/buckets.json",
        "64-val/buckets.json",
        f"{val_latents_64}/buckets.json",
    )  # the split too
    for key in ("shards.json", *tops):
        assert f"{version}/{key}" in published, key
    for res, stage in shards["stages"].items():
        assert stage["latents"].split("/")[-1].startswith(f"{res}-latents-")
        assert (tmp_path / "root" / "shards" / shards["dataset_version"]).is_dir()
    assert len(shards["stages"][64]["buckets"]) >= 3
    latents_64 = Path(shards["stages"][64]["latents"])
    buckets = json.loads((latents_64 / "buckets.json").read_text())["buckets"]
    for b in buckets:
        ds = StreamingDataset(local=str(latents_64 / b["name"]), batch_size=1)
        assert len(ds) == b["samples"]
        assert ds[0]["latent_mean"].shape[1:] == (b["height"] // 4, b["width"] // 4)
    train_state = train_flow(load_config(cfg), return_state=True)
    record = train_state.result()
    assert record["health"]["world_size"] == 1
    assert list(record["stages"]) == ["64"]
    res = "64"
    stage_yaml = tmp_path / "root" / "runs" / record["run_id"] / f"stage-{res}" / "stage.yaml"
    run = yaml.safe_load(stage_yaml.read_text())
    assert f"/{res}-latents-" in run["shards"], "training read the latents"
    assert f"/{version}/{res}-val-latents-" in run["val_shards"], "and validates on latents"
    assert run["shards_remote"].startswith(f"s3://{bucket}/datasets/{version}/{res}-latents-")
    assert any(Path(run["shards_cache"]).rglob("*.mds")), "streamed from S3 into the cache"
    assert run["shards_cache"].startswith(str(tmp_path / "root" / "cache"))
    stage_64 = run_artifacts("stage-64", train_state)
    assert all("Plan vs actual" not in a.data and "mfu" in a.data for a in stage_64)
