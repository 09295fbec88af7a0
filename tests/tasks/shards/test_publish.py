"""Publishing a dataset version to S3 (moto's server) and streaming it back."""

import threading
from pathlib import Path

import pytest

from kiln_config import IngestConfig, QualityConfig, ShardsConfig
from tasks.ingest.run import ingest_source
from tasks.quality.validate import validate_catalog
from tasks.shards.publish import publish_dataset
from tasks.shards.write import write_shards
from tasks.storage.objects import Storage


class RecordingStorage(Storage):
    """Records the order of uploads; with `fail_after`, the network drops after that many."""

    def __init__(self, *args, fail_after: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.fail_after, self.sent, self.lock = fail_after, [], threading.Lock()

    def upload_file(self, key: str, path: Path) -> None:
        with self.lock:
            if self.fail_after is not None and len(self.sent) >= self.fail_after:
                raise ConnectionError("connection reset by peer")
            self.sent.append(key)
        super().upload_file(key, path)


@pytest.fixture
def version(tmp_path, demo_src):
    """A finished version: a square 32 px stage and a 64 px stage in aspect buckets, each
    with its held-out validation split."""
    root = tmp_path / "root"
    ing = ingest_source(IngestConfig(source=str(demo_src), workers=1), str(root))
    rules = QualityConfig(min_side=32, max_reject_fraction=0.25)
    validate_catalog.fn(str(root), ing.ingest_id, rules)
    res = write_shards.fn(
        ShardsConfig(bucket_step=8, size_limit=16384, workers=2, val_fraction=0.2),
        str(root),
        ing.ingest_id,
        [32, 64],
        bucket_stages=[64],
    )
    return root / "shards" / res.dataset_version


def _local_objects(base: Path) -> dict[str, int]:
    return {
        f"{base.name}/{p.relative_to(base).as_posix()}": p.stat().st_size
        for p in base.rglob("*")
        if p.is_file()
    }


def test_publish_is_atomic_resumes_and_streams_back_like_local(
    version, tmp_path, s3_bucket, s3_endpoint, monkeypatch
):
    from kiln_config import PROJECT_DIR, load_config
    from models.components.factory import build_tokenizer
    from models.data.loader import build_loader

    bucket, _ = s3_bucket
    remote = f"s3://{bucket}/datasets"
    v = version.name
    # The network drops after 3 uploads: nothing is published, so no loader can open it.
    failing = RecordingStorage(remote, endpoint_url=s3_endpoint, fail_after=3)
    with pytest.raises(ConnectionError):
        publish_dataset(version, failing)
    dest = Storage(remote, endpoint_url=s3_endpoint)
    keys = {o.key for o in dest.list(v)}
    assert len(keys) == 3 and not any(k.endswith(".json") for k in keys), keys

    # The next run sends only what is missing, data first and each dataset's top file last.
    rec = RecordingStorage(remote, endpoint_url=s3_endpoint)
    res = publish_dataset(version, rec)
    local = _local_objects(version)
    assert {o.key: o.size for o in dest.list(v)} == local
    datasets = ["32", "32-val", "64", "64-val"]  # the splits are published like the stages
    assert res.already_there == 3 and sorted(res.published) == datasets and not res.reused
    assert set(rec.sent) == set(local) - keys
    order = {k: i for i, k in enumerate(rec.sent)}
    for stage, top in (("32", "index.json"), ("64", "buckets.json"), ("64-val", "buckets.json")):
        last = order[f"{v}/{stage}/{top}"]
        assert all(
            i < last
            for k, i in order.items()
            if k.startswith(f"{v}/{stage}/") and k != f"{v}/{stage}/{top}"
        )
    for name in {k.split("/")[2] for k in local if k.startswith(f"{v}/64/") and k.count("/") > 3}:
        # every bucket's index comes after its data
        idx = order[f"{v}/64/{name}/index.json"]
        assert all(
            i < idx
            for k, i in order.items()
            if k.startswith(f"{v}/64/{name}/part-") and not k.endswith("index.json")
        )
    assert rec.sent[-1] == f"{v}/shards.json"

    # Published datasets are not sent again.
    again = RecordingStorage(remote, endpoint_url=s3_endpoint)
    res = publish_dataset(version, again)
    assert sorted(res.reused) == datasets and again.sent == [f"{v}/shards.json"]

    # Streamed from S3 through a cache, each stage (square, and bucketed) gives the same
    # batches as the local copy.
    monkeypatch.setenv("S3_ENDPOINT_URL", s3_endpoint)  # streaming's S3 endpoint setting
    train = load_config(PROJECT_DIR / "configs" / "tiny.yaml").train
    tok = build_tokenizer(train.model.tokenizer)
    for stage in ("32", "64"):
        res_px = int(stage)
        want = [b["key"] for b in build_loader(train, str(version / stage), tok, res_px, 2)]
        cache = tmp_path / "cache" / v / stage
        got = [
            b["key"]
            for b in build_loader(train, str(cache), tok, res_px, 2, remote=f"{remote}/{v}/{stage}")
        ]
        assert got == want and len(got) >= 5
        assert any(cache.rglob("*.mds")), "shards were streamed into the cache"

    with pytest.raises(FileNotFoundError, match="neither index.json nor buckets.json"):
        build_loader(train, str(tmp_path / "c2"), tok, 32, 2, remote=f"{remote}/nope")


def test_publishing_an_unfinished_version_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="run `kiln shard` first"):
        publish_dataset(tmp_path / "ds-unfinished", Storage(str(tmp_path / "remote")))
