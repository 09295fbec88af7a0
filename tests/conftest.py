"""Tiny, seeded fixtures: demo images, a tiny pipeline config, moto's S3 server, Prefect."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DRAWBENCH = REPO.parent / "shared" / "data" / "drawbench.csv"


@pytest.fixture(scope="session")
def drawbench_csv() -> Path:
    assert DRAWBENCH.is_file(), f"DrawBench prompts expected beside the repo at {DRAWBENCH}"
    return DRAWBENCH


@pytest.fixture(scope="session", autouse=True)
def prefect_harness(tmp_path_factory):
    """One temporary Prefect API (SQLite) for every in-process flow run of the session."""
    from prefect.testing.utilities import prefect_test_harness

    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def demo_src(tmp_path_factory) -> Path:
    """60 demo files (5 planted bad) in the imagefolder layout; shared, so never modify it."""
    from tasks.demo_data import write_demo_dataset

    out = tmp_path_factory.mktemp("demo") / "src"
    write_demo_dataset(out, n=60, seed=0)
    return out


def _write_tiny_config(
    path: Path, root: Path, source: Path | str, prompts: Path, **overrides
) -> Path:
    """configs/tiny.yaml with root, source and prompts pointed at test folders."""
    cfg = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    cfg["storage"]["root"] = str(root)
    cfg["ingest"]["source"] = str(source)
    cfg["evaluate"]["prompts_csv"] = str(prompts)
    cfg["launch"]["accelerate_config"] = str(REPO / "configs" / "accelerate" / "single.yaml")
    for dotted, value in overrides.items():
        node = cfg
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@pytest.fixture(scope="session")
def make_config(drawbench_csv):
    """make_config(path, root, source, **{"dotted.key": value}) writes a tiny pipeline YAML."""

    def make(path: Path, root: Path, source: Path | str, **overrides) -> Path:
        return _write_tiny_config(path, root, source, drawbench_csv, **overrides)

    return make


@pytest.fixture
def tiny_config(tmp_path, demo_src, make_config) -> Path:
    return make_config(tmp_path / "tiny.yaml", tmp_path / "root", demo_src)


@pytest.fixture(scope="session")
def tiny_shards(tmp_path_factory, demo_src, make_config):
    """Validated demo catalog sharded for the tiny stages: (config path, root, dataset version)."""
    from flows.config import load_config
    from tasks.ingest import ingest_source
    from tasks.quality import validate_catalog
    from tasks.shard import write_shards

    base = tmp_path_factory.mktemp("shards")
    cfg_path = make_config(base / "tiny.yaml", base / "root", demo_src)
    cfg = load_config(cfg_path)
    root = cfg.storage.root
    ing = ingest_source.fn(str(demo_src), root, workers=2)
    validate_catalog.fn(root, ing.ingest_id, min_side=32, max_reject_fraction=0.25)
    res = write_shards.fn(
        root,
        ing.ingest_id,
        str(demo_src),
        [s.resolution for s in cfg.train.stages],
        size_limit=cfg.shards.size_limit,
        workers=2,
    )
    return cfg_path, Path(root), res.dataset_version


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server on 127.0.0.1: a real HTTP endpoint, not an in-process mock."""
    from moto.server import ThreadedMotoServer

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint):
    """A fresh bucket on the moto server; returns (bucket name, boto3 client)."""
    import uuid

    import boto3

    client = boto3.client("s3", endpoint_url=s3_endpoint)
    name = f"kiln-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=name)
    return name, client


@pytest.fixture
def upload_dir():
    """upload_dir(client, bucket, prefix, folder): copy a local folder into the bucket."""

    def upload(client, bucket: str, prefix: str, folder: Path) -> None:
        for p in sorted(folder.rglob("*")):
            if p.is_file():
                client.upload_file(str(p), bucket, f"{prefix}/{p.relative_to(folder).as_posix()}")

    return upload
