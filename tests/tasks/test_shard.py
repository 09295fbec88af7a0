import io
import json

import pytest
from PIL import Image
from streaming import StreamingDataset

from data_quality.rules import QualityConfig
from flows.config import IngestConfig, ShardsConfig
from tasks.ingest import ingest_source
from tasks.quality import QualityGateError, validate_catalog
from tasks.shard import write_shards


@pytest.fixture
def validated(tmp_path, demo_src):
    root = tmp_path / "root"
    ing = ingest_source(IngestConfig(source=str(demo_src), workers=1), str(root))
    validate_catalog.fn(
        str(root), ing.ingest_id, QualityConfig(min_side=32, max_reject_fraction=0.25)
    )
    return root, ing.ingest_id, demo_src


def test_shards_per_stage_are_readable_and_bucketed(validated):
    root, ingest_id, _ = validated
    res = write_shards.fn(ShardsConfig(size_limit=16384, workers=2), str(root), ingest_id, [32, 64])
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
    a = write_shards.fn(ShardsConfig(workers=1), str(root), ingest_id, [32])
    b = write_shards.fn(ShardsConfig(workers=1), str(root), ingest_id, [32])
    c = write_shards.fn(ShardsConfig(jpeg_quality=70, workers=1), str(root), ingest_id, [32])
    assert a.dataset_version == b.dataset_version and b.reused
    assert c.dataset_version != a.dataset_version


def test_token_ids_are_the_loaders_and_part_of_the_version(validated):
    """With the model's tokenizer, every sample stores its caption's ids exactly as the
    loader's tokenizer makes them (fixed-size int32), and the tokenizer is in the version."""
    import numpy as np

    from models.config import TokenizerConfig
    from models.factory import build_tokenizer
    from models.tokenization import CaptionTokenizer

    root, ingest_id, _ = validated
    spec = TokenizerConfig(builtin="bytes", model_max_length=24)
    plain = write_shards.fn(ShardsConfig(workers=1), str(root), ingest_id, [32])
    res = write_shards.fn(
        ShardsConfig(workers=1, size_limit=16384),
        str(root),
        ingest_id,
        [32],
        tokenizer=spec.model_dump(),
    )
    assert res.dataset_version != plain.dataset_version and not res.reused
    tokenize = CaptionTokenizer(build_tokenizer(spec))
    path = root / "shards" / res.dataset_version / "32"
    index = json.loads((path / "index.json").read_text())
    assert len(index["shards"]) > 1
    assert all(sh["column_encodings"][sh["column_names"].index("input_ids")] ==
               "ndarray:int32:24" for sh in index["shards"])  # fmt: skip
    ds = StreamingDataset(local=str(path), batch_size=1)
    samples = [ds[i] for i in range(len(ds))]
    want = tokenize([s["caption"] for s in samples]).numpy()
    got = np.stack([s["input_ids"] for s in samples])
    assert got.dtype == np.int32 and np.array_equal(got, want)
    plain_ds = StreamingDataset(local=str(root / "shards" / plain.dataset_version / "32"),
                                batch_size=1)  # fmt: skip
    assert "input_ids" not in plain_ds[0]
    other = TokenizerConfig(builtin="bytes", model_max_length=16).model_dump()
    again = write_shards.fn(
        ShardsConfig(workers=1, size_limit=16384), str(root), ingest_id, [32], tokenizer=other
    )
    assert again.dataset_version != res.dataset_version


def test_a_catalog_that_failed_the_gate_is_sharded_only_with_the_override(tmp_path, demo_src):
    root = tmp_path / "root"
    ing = ingest_source(IngestConfig(source=str(demo_src), workers=1), str(root))
    strict = QualityConfig(min_side=32, max_reject_fraction=0.01)
    with pytest.raises(QualityGateError, match="quality gate failed"):
        validate_catalog.fn(str(root), ing.ingest_id, strict)
    assert (root / "catalog" / ing.ingest_id / "clean.parquet").is_file()
    with pytest.raises(QualityGateError) as e:
        write_shards.fn(ShardsConfig(workers=1), str(root), ing.ingest_id, [32])
    msg = str(e.value)
    assert "failed the quality gate" in msg and "--allow-failed-gate" in msg
    assert "| `caption_blank` | 1 |" in msg and "| `duplicate_sha256` | 1 |" in msg
    assert not (root / "shards").exists(), "nothing written"

    verdict = json.loads((root / "catalog" / ing.ingest_id / "verdict.json").read_text())
    assert verdict["passed"] is False and verdict["max_reject_fraction"] == 0.01
    assert verdict["reject_fraction"] > 0.01 and verdict["reasons"]["caption_blank"] == 1
    res = write_shards.fn(
        ShardsConfig(workers=1), str(root), ing.ingest_id, [32], allow_failed_gate=True
    )
    lineage = json.loads((root / "shards" / res.dataset_version / "shards.json").read_text())
    gate = lineage["quality_gate"]
    assert gate["passed"] is False and gate["overridden"] is True
    assert gate["reasons"] == verdict["reasons"] and gate["max_reject_fraction"] == 0.01

    # Validated again under rules it passes: no override needed, and the lineage says so.
    validate_catalog.fn(
        str(root), ing.ingest_id, strict.model_copy(update={"max_reject_fraction": 0.5})
    )
    again = write_shards.fn(ShardsConfig(workers=1), str(root), ing.ingest_id, [32])
    assert again.dataset_version == res.dataset_version and again.reused
    lineage = json.loads((root / "shards" / res.dataset_version / "shards.json").read_text())
    assert lineage["quality_gate"]["passed"] is True
    assert lineage["quality_gate"]["overridden"] is False

    # A catalog without a verdict (never validated by this version) is refused too.
    (root / "catalog" / ing.ingest_id / "verdict.json").unlink()
    with pytest.raises(QualityGateError, match="no quality verdict.*--allow-failed-gate"):
        write_shards.fn(ShardsConfig(workers=1), str(root), ing.ingest_id, [32])


def test_stage_without_images_is_a_clear_error(validated):
    root, ingest_id, _ = validated
    with pytest.raises(ValueError, match="stage 4096px has no images"):
        write_shards.fn(ShardsConfig(workers=1), str(root), ingest_id, [32, 4096])


def test_shards_from_webdataset_tars_on_s3_use_ranged_reads(
    tmp_path, layouts, s3_bucket, s3_endpoint, upload_dir
):
    src = tmp_path / "wds"
    keys = layouts("webdataset", src)
    bucket, client = s3_bucket
    upload_dir(client, bucket, "raw", src)
    root = tmp_path / "root"
    ing = ingest_source(
        IngestConfig(source=f"s3://{bucket}/raw"), str(root), endpoint_url=s3_endpoint
    )
    validate_catalog.fn(str(root), ing.ingest_id, QualityConfig(min_side=32))
    res = write_shards.fn(
        ShardsConfig(workers=2), str(root), ing.ingest_id, [32], endpoint_url=s3_endpoint
    )
    ds = StreamingDataset(local=str(root / "shards" / res.dataset_version / "32"), batch_size=1)
    got = {ds[i]["key"]: ds[i]["caption"] for i in range(len(ds))}
    assert got == keys
    assert all(Image.open(io.BytesIO(ds[i]["image"])).size == (32, 32) for i in range(len(ds)))


def test_failed_conversion_publishes_nothing_and_the_next_run_finishes_it(tmp_path):
    """Square stage 32 and bucketed stage 48 alike: a failed partition publishes nothing and
    the next run redoes only the unfinished partitions."""
    import shutil

    from tasks.demo_data import write_demo_dataset

    src, root = tmp_path / "src", tmp_path / "root"
    write_demo_dataset(src, n=40, seed=3)
    ing = ingest_source(IngestConfig(source=str(src), workers=1), str(root))
    validate_catalog.fn(str(root), ing.ingest_id, QualityConfig(min_side=32))
    last = sorted(p for p in src.glob("0*.*"))[-1]
    saved = last.read_bytes()
    last.unlink()  # the source changes under the conversion: the last partition fails
    cfg = ShardsConfig(partition_size=8, bucket_step=8, workers=2)
    kw = {"bucket_stages": [48]}
    with pytest.raises(RuntimeError, match="shard partitions failed"):
        write_shards.fn(cfg, str(root), ing.ingest_id, [32, 48], **kw)
    version_dir = next((root / "shards").glob("ds-*"))
    assert not list(version_dir.glob("*/index.json")), "nothing published"
    assert not list(version_dir.glob("*/buckets.json")), "nothing published"
    partial = version_dir / ".partial"
    first = partial / "32" / "part-00000" / "index.json"
    assert (partial / "48" / "part-00000.done").is_file()
    bucket_part = next((partial / "48").glob("*x*/part-00000/index.json"))
    before = first.stat().st_mtime_ns, bucket_part.stat().st_mtime_ns
    last.write_bytes(saved)
    res = write_shards.fn(cfg, str(root), ing.ingest_id, [32, 48], **kw)
    assert res.dataset_version == version_dir.name and not res.reused
    done = version_dir / "32" / "part-00000" / "index.json"
    done_bucket = version_dir / "48" / bucket_part.relative_to(partial / "48")
    after = done.stat().st_mtime_ns, done_bucket.stat().st_mtime_ns
    assert after == before, "a finished partition is not redone"
    assert not (version_dir / ".partial").exists()
    ds = StreamingDataset(local=str(version_dir / "32"), batch_size=1, shuffle=False)
    assert ds.num_samples == res.stages[32]["samples"] > 8
    assert not list((version_dir / "48").glob("*.done"))
    shutil.rmtree(version_dir / "48")
    again = write_shards.fn(
        cfg.model_copy(update={"workers": 1}), str(root), ing.ingest_id, [32, 48], **kw
    )
    assert (version_dir / "48" / "buckets.json").is_file() and again.stages[48]["samples"] > 0


def test_webp_encoding_and_pass_through_metadata(tmp_path, layouts):
    src, root = tmp_path / "src", tmp_path / "root"
    layouts("imagefolder", src)
    ing = ingest_source(IngestConfig(source=str(src), metadata_columns=("license",)), str(root))
    validate_catalog.fn(str(root), ing.ingest_id, QualityConfig(min_side=32))
    res = write_shards.fn(
        ShardsConfig(image_format="webp", workers=1), str(root), ing.ingest_id, [32]
    )
    ds = StreamingDataset(local=str(root / "shards" / res.dataset_version / "32"), batch_size=1)
    for i in range(len(ds)):
        s = ds[i]
        assert Image.open(io.BytesIO(s["image"])).format == "WEBP"
        assert s["meta"] == {"license": "cc0"}


def test_changed_metadata_gives_a_new_version_with_the_new_metadata(tmp_path, layouts):
    src, root = tmp_path / "src", tmp_path / "root"
    layouts("imagefolder", src)
    rules = QualityConfig(min_side=32)

    def shard():
        ing = ingest_source(IngestConfig(source=str(src), metadata_columns=("license",)), str(root))
        validate_catalog.fn(str(root), ing.ingest_id, rules)
        res = write_shards.fn(ShardsConfig(workers=1), str(root), ing.ingest_id, [32])
        ds = StreamingDataset(local=str(root / "shards" / res.dataset_version / "32"),
                              batch_size=1)  # fmt: skip
        return res, {ds[i]["key"]: ds[i]["meta"]["license"] for i in range(len(ds))}

    first, licenses = shard()
    assert set(licenses.values()) == {"cc0"}
    manifest = src / "metadata.jsonl"
    manifest.write_text(manifest.read_text().replace('"cc0"', '"cc-by-4.0"', 1))
    second, licenses = shard()
    assert second.dataset_version != first.dataset_version and not second.reused
    assert sorted(licenses.values()) == ["cc-by-4.0"] + ["cc0"] * 5


def test_aspect_buckets_cover_the_stage():
    import numpy as np

    from tasks.decode import aspect_buckets, nearest_bucket, nearest_buckets, resize_crop

    b = aspect_buckets(1024)
    assert (1024, 1024) in b and {(h, w) for w, h in b} == set(b), "square, and mirrored"
    for w, h in b:
        assert w % 64 == 0 and h % 64 == 0 and max(w / h, h / w) <= 2
        assert 0.85 * 1024**2 <= w * h <= 1024**2
    assert nearest_bucket(3000, 2000, b) == (1216, 832)
    assert nearest_bucket(2000, 3000, b) == (832, 1216)
    assert nearest_bucket(5000, 100, b) == (1408, 704), "beyond the widest: the widest"
    assert nearest_bucket(700, 700, b) == (1024, 1024)
    rng = np.random.default_rng(0)
    w, h = rng.integers(10, 5000, 5000), rng.integers(10, 5000, 5000)
    want = [nearest_bucket(x, y, b) for x, y in zip(w, h, strict=True)]
    assert nearest_buckets(w, h, b) == want, "the column version agrees"
    with pytest.raises(ValueError, match="multiple of the bucket step"):
        aspect_buckets(1000)
    crop, (top, left) = resize_crop(Image.new("RGB", (300, 100)), 160, 96)
    assert crop.size == (160, 96) and (top, left) == (0, 64)  # resized to 288x96, centred


def test_bucketed_stage_has_one_dataset_per_bucket_and_batches_per_bucket(validated):
    from flows.config import PROJECT_DIR, load_config
    from models.factory import build_tokenizer
    from models.loader import build_loader
    from tasks.decode import aspect_buckets, nearest_bucket

    root, ingest_id, _ = validated
    res = write_shards.fn(
        ShardsConfig(bucket_step=8, size_limit=16384, workers=2),
        str(root),
        ingest_id,
        [32, 64],
        bucket_stages=[64],
    )
    base = root / "shards" / res.dataset_version
    assert (base / "32" / "index.json").is_file(), "the other stage stays square"
    listed = json.loads((base / "64" / "buckets.json").read_text())["buckets"]
    assert len(listed) >= 3, "the demo has portrait, square and landscape images"
    assert sum(b["samples"] for b in listed) == res.stages[64]["samples"] > 0
    assert res.stages[64]["buckets"] == {b["name"]: b["samples"] for b in listed}
    buckets = aspect_buckets(64, 8)
    for b in listed:
        ds = StreamingDataset(local=str(base / "64" / b["name"]), batch_size=1)
        assert len(ds) == b["samples"]
        for i in range(len(ds)):
            s = ds[i]
            size = (b["width"], b["height"])
            assert Image.open(io.BytesIO(s["image"])).size == size
            assert nearest_bucket(s["orig_width"], s["orig_height"], buckets) == size
            assert s["orig_width"] >= size[0] and s["orig_height"] >= size[1], "no upscale"
    plain = write_shards.fn(
        ShardsConfig(size_limit=16384, workers=2), str(root), ingest_id, [32, 64]
    )
    assert plain.dataset_version != res.dataset_version

    # The loader streams each bucket and batches per bucket: one shape per batch.
    train = load_config(PROJECT_DIR / "configs" / "tiny.yaml").train
    tok = build_tokenizer(train.model.tokenizer)
    shapes = []
    for batch in build_loader(train, str(base / "64"), tok, 64, 2):
        h, w = batch["pixel_values"].shape[2:]
        assert (w, h) in {(b["width"], b["height"]) for b in listed}
        shapes.append((w, h))
    assert len(set(shapes)) >= 2 and len(shapes) >= 5
