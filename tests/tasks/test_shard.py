import io
import json

import pytest
from PIL import Image
from streaming import StreamingDataset

from data_quality.rules import QualityConfig
from tasks.ingest import ingest_source
from tasks.quality import validate_catalog
from tasks.shard import write_shards


@pytest.fixture
def validated(tmp_path, demo_src):
    root = tmp_path / "root"
    ing = ingest_source(str(demo_src), str(root), workers=1)
    validate_catalog.fn(
        str(root), ing.ingest_id, QualityConfig(min_side=32, max_reject_fraction=0.25)
    )
    return root, ing.ingest_id, demo_src


def test_shards_per_stage_are_readable_and_bucketed(validated):
    root, ingest_id, _ = validated
    res = write_shards.fn(str(root), ingest_id, [32, 64], size_limit=16384, workers=2)
    assert res.stages[32]["samples"] > res.stages[64]["samples"] > 0
    assert res.stages[32]["shards"] > 1, "tiny size limit gives several shards"
    for r in (32, 64):
        ds = StreamingDataset(
            local=str(root / "shards" / res.dataset_version / str(r)), batch_size=1
        )
        assert len(ds) == res.stages[r]["samples"]
        for i in range(len(ds)):
            s = ds[i]
            assert Image.open(io.BytesIO(s["image"])).size == (r, r)
            assert s["caption"].strip()
            assert min(s["orig_width"], s["orig_height"]) >= r
    meta = json.loads((root / "shards" / res.dataset_version / "shards.json").read_text())
    assert meta["ingest_id"] == ingest_id


def test_same_input_same_version_and_reuse(validated):
    root, ingest_id, _ = validated
    a = write_shards.fn(str(root), ingest_id, [32], workers=1)
    b = write_shards.fn(str(root), ingest_id, [32], workers=1)
    c = write_shards.fn(str(root), ingest_id, [32], jpeg_quality=70, workers=1)
    assert a.dataset_version == b.dataset_version and b.reused
    assert c.dataset_version != a.dataset_version


def test_stage_without_images_is_a_clear_error(validated):
    root, ingest_id, _ = validated
    with pytest.raises(ValueError, match="stage 4096px has no images"):
        write_shards.fn(str(root), ingest_id, [32, 4096], workers=1)


def test_shards_from_webdataset_tars_on_s3_use_ranged_reads(
    tmp_path, layouts, s3_bucket, s3_endpoint, upload_dir
):
    src = tmp_path / "wds"
    keys = layouts("webdataset", src)
    bucket, client = s3_bucket
    upload_dir(client, bucket, "raw", src)
    root = tmp_path / "root"
    ing = ingest_source(f"s3://{bucket}/raw", str(root), endpoint_url=s3_endpoint)
    validate_catalog.fn(str(root), ing.ingest_id, QualityConfig(min_side=32))
    res = write_shards.fn(str(root), ing.ingest_id, [32], workers=2, endpoint_url=s3_endpoint)
    ds = StreamingDataset(local=str(root / "shards" / res.dataset_version / "32"), batch_size=1)
    got = {ds[i]["key"]: ds[i]["caption"] for i in range(len(ds))}
    assert got == keys
    assert all(Image.open(io.BytesIO(ds[i]["image"])).size == (32, 32) for i in range(len(ds)))


def test_failed_conversion_publishes_nothing_and_the_next_run_finishes_it(tmp_path):
    import shutil

    from tasks.demo_data import write_demo_dataset

    src, root = tmp_path / "src", tmp_path / "root"
    write_demo_dataset(src, n=40, seed=3)
    ing = ingest_source(str(src), str(root), workers=1)
    validate_catalog.fn(str(root), ing.ingest_id, QualityConfig(min_side=32))
    last = sorted(p for p in src.glob("0*.*"))[-1]
    saved = last.read_bytes()
    last.unlink()  # the source changes under the conversion: the last partition fails
    with pytest.raises(RuntimeError, match="shard partitions failed"):
        write_shards.fn(str(root), ing.ingest_id, [32, 48], partition_size=8, workers=2)
    version_dir = next((root / "shards").glob("ds-*"))
    assert not list(version_dir.glob("*/index.json")), "nothing published"
    first = version_dir / ".partial" / "32" / "part-00000" / "index.json"
    before = first.stat().st_mtime_ns
    last.write_bytes(saved)
    res = write_shards.fn(str(root), ing.ingest_id, [32, 48], partition_size=8, workers=2)
    assert res.dataset_version == version_dir.name and not res.reused
    done = version_dir / "32" / "part-00000" / "index.json"
    assert done.stat().st_mtime_ns == before, "a finished partition is not redone"
    assert not (version_dir / ".partial").exists()
    ds = StreamingDataset(local=str(version_dir / "32"), batch_size=1, shuffle=False)
    assert ds.num_samples == res.stages[32]["samples"] > 8
    shutil.rmtree(version_dir / "48")
    again = write_shards.fn(str(root), ing.ingest_id, [32, 48], partition_size=8, workers=1)
    assert (version_dir / "48" / "index.json").is_file() and again.stages[48]["samples"] > 0


def test_webp_encoding_and_pass_through_metadata(tmp_path, layouts):
    src, root = tmp_path / "src", tmp_path / "root"
    layouts("imagefolder", src)
    ing = ingest_source(str(src), str(root), metadata_columns=("license",))
    validate_catalog.fn(str(root), ing.ingest_id, QualityConfig(min_side=32))
    res = write_shards.fn(str(root), ing.ingest_id, [32], image_format="webp", workers=1)
    ds = StreamingDataset(local=str(root / "shards" / res.dataset_version / "32"), batch_size=1)
    for i in range(len(ds)):
        s = ds[i]
        assert Image.open(io.BytesIO(s["image"])).format == "WEBP"
        assert s["meta"] == {"license": "cc0"}
