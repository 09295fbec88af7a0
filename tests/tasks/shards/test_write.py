import io
import json

import pytest
from PIL import Image
from streaming import StreamingDataset

from data_quality.verdict import QualityGateError
from kiln_config import IngestConfig, QualityConfig, ShardsConfig
from tasks.catalog.clean import read_clean
from tasks.ingest.run import ingest_source
from tasks.quality.validate import validate_catalog
from tasks.shards.write import write_shards


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
    # The dataset version names the catalog table version it was cut from: time travel reads
    # the same rows back.
    from deltalake import DeltaTable

    version = meta["catalog_versions"]["accepted"]
    rows = DeltaTable(str(root / "catalog" / "tables" / "accepted"), version=version).to_pandas()
    assert set(read_clean(str(root), ingest_id)["key"]) <= set(rows["key"])


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

    from kiln_config import TokenizerConfig
    from models.components.factory import build_tokenizer
    from models.data.tokenization import CaptionTokenizer

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
    assert all(
        sh["column_encodings"][sh["column_names"].index("input_ids")] == "ndarray:int32:24"
        for sh in index["shards"]
    )
    ds = StreamingDataset(local=str(path), batch_size=1)
    samples = [ds[i] for i in range(len(ds))]
    want = tokenize([s["caption"] for s in samples]).numpy()
    got = np.stack([s["input_ids"] for s in samples])
    assert got.dtype == np.int32 and np.array_equal(got, want)
    plain_ds = StreamingDataset(
        local=str(root / "shards" / plain.dataset_version / "32"), batch_size=1
    )
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
    assert (root / "catalog" / ing.ingest_id / "rejects.parquet").is_file()
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

    # A catalog without a verdict (never validated) is refused too.
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
    """Square stage 32 and bucketed stage 48 alike, with their validation splits: a failed
    partition publishes nothing and the next run redoes only the unfinished partitions."""
    import shutil

    from kiln_demo.data import write_demo_dataset

    src, root = tmp_path / "src", tmp_path / "root"
    write_demo_dataset(src, n=40, seed=3)
    ing = ingest_source(IngestConfig(source=str(src), workers=1), str(root))
    validate_catalog.fn(str(root), ing.ingest_id, QualityConfig(min_side=32))
    last = sorted(p for p in src.glob("0*.*"))[-1]
    saved = last.read_bytes()
    last.unlink()  # the source changes under the conversion: the last partition fails
    cfg = ShardsConfig(partition_size=8, bucket_step=8, workers=2, val_fraction=0.2)
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
    assert (version_dir / "32-val" / "index.json").is_file()
    assert (version_dir / "48-val" / "buckets.json").is_file()
    assert res.stages[32]["val_samples"] > 0 and res.stages[48]["val_samples"] > 0
    ds = StreamingDataset(local=str(version_dir / "32"), batch_size=1, shuffle=False)
    assert ds.num_samples == res.stages[32]["samples"] > 8
    assert not list((version_dir / "48").glob("*.done"))
    shutil.rmtree(version_dir / "48")  # a stage lost after its split was published
    again = write_shards.fn(
        cfg.model_copy(update={"workers": 1}), str(root), ing.ingest_id, [32, 48], **kw
    )
    assert (version_dir / "48" / "buckets.json").is_file()
    for key in ("samples", "val_samples", "buckets"):
        assert again.stages[48][key] == res.stages[48][key], key
    assert set(_keys(version_dir / "48-val")).isdisjoint(_keys(version_dir / "48"))


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
        ds = StreamingDataset(local=str(root / "shards" / res.dataset_version / "32"), batch_size=1)
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

    from tasks.ingest.render import aspect_buckets, nearest_bucket, nearest_buckets, resize_crop

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
    from kiln_config import PROJECT_DIR, load_config
    from models.components.factory import build_tokenizer
    from models.data.loader import build_loader
    from tasks.ingest.render import aspect_buckets, nearest_bucket

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


def _keys(path) -> list[str]:
    """Every sample's key in an MDS dataset, square or in aspect buckets, read back with
    StreamingDataset."""
    from models.data.loader import dataset_buckets

    buckets = dataset_buckets(str(path))
    folders = [path / b["name"] for b in buckets] if buckets else [path]
    keys = []
    for folder in folders:
        ds = StreamingDataset(local=str(folder), batch_size=1, shuffle=False)
        keys += [ds[i]["key"] for i in range(len(ds))]
    return keys


def _columns(path) -> list[str]:
    index = json.loads((path / "index.json").read_text())
    return index["shards"][0]["column_names"]


def test_validation_split_is_held_out_by_key_at_every_stage(validated):
    """The same images (by key hash) are held out of every stage, square or bucketed; each
    stage's split has the stage's columns and layout, and no held-out key is in training."""

    from tasks.reports import shards_report
    from tasks.shards.write import held_out

    root, ingest_id, _ = validated
    cfg = ShardsConfig(val_fraction=0.3, bucket_step=8, size_limit=16384, workers=2)
    spec = {"builtin": "bytes", "model_max_length": 24}
    res = write_shards.fn(cfg, str(root), ingest_id, [32, 64], bucket_stages=[64], tokenizer=spec)
    clean = read_clean(str(root), ingest_id)
    uids = list(zip(clean["source"], clean["key"], strict=True))
    want = {k for _, k in held_out(uids, 0.3, 2000)}
    assert len(want) >= 5
    base = root / "shards" / res.dataset_version
    split = {}
    for r in (32, 64):
        train, val = _keys(base / str(r)), _keys(base / f"{r}-val")
        split[r] = set(val)
        assert len(val) == len(set(val)) == res.stages[r]["val_samples"] > 0
        assert len(train) == res.stages[r]["samples"]
        assert set(val) <= want and not set(train) & want, "held out of training, by key"
    assert split[32] == want, "every clean image is >= 32 px, so all held-out keys are in"
    assert split[64] < split[32], "the 64 px split is the held-out images that 64 px accepts"
    assert res.stages[32]["samples"] + res.stages[32]["val_samples"] == len(clean)
    assert _columns(base / "32-val") == _columns(base / "32")
    assert "input_ids" in _columns(base / "32-val")
    listed = json.loads((base / "64-val" / "buckets.json").read_text())["buckets"]
    assert sum(b["samples"] for b in listed) == res.stages[64]["val_samples"]
    for b in listed:  # rendered to its bucket, as the stage's images are
        ds = StreamingDataset(local=str(base / "64-val" / b["name"]), batch_size=1)
        assert Image.open(io.BytesIO(ds[0]["image"])).size == (b["width"], b["height"])
        assert _columns(base / "64-val" / b["name"]) == _columns(base / "64" / b["name"])
    meta = json.loads((base / "shards.json").read_text())
    assert meta["settings"]["val"] == {"fraction": 0.3, "max": 2000}
    assert meta["stages"]["32"]["val_samples"] == len(want)
    report = shards_report(res, ingest_id, str(base), None)
    assert f"| 32px | {res.stages[32]['samples']} | {len(want)} |" in report

    # Deterministic: the choice depends on the keys alone, not their order or company.
    assert held_out(uids[::-1], 0.3, 2000) == held_out(uids, 0.3, 2000)
    some = uids[: len(uids) // 2]
    assert held_out(some, 0.3, 2000) == held_out(uids, 0.3, 2000) & set(some)
    again = write_shards.fn(cfg, str(root), ingest_id, [32, 64], bucket_stages=[64], tokenizer=spec)
    assert again.reused and again.stages == res.stages


def test_validation_split_respects_val_max_and_is_part_of_the_version(validated):

    from tasks.shards.write import _key_unit

    root, ingest_id, _ = validated
    clean = read_clean(str(root), ingest_id)
    cfg = ShardsConfig(val_fraction=0.5, workers=2)
    full = write_shards.fn(cfg, str(root), ingest_id, [32])
    capped = write_shards.fn(cfg.model_copy(update={"val_max": 3}), str(root), ingest_id, [32])
    assert capped.dataset_version != full.dataset_version
    assert full.stages[32]["val_samples"] > 3 == capped.stages[32]["val_samples"]
    smallest = sorted(clean["key"], key=_key_unit)[:3]
    held = _keys(root / "shards" / capped.dataset_version / "32-val")
    assert sorted(held) == sorted(smallest), "the cap keeps the smallest hashes"
    assert set(held) <= set(_keys(root / "shards" / full.dataset_version / "32-val"))

    other = write_shards.fn(
        cfg.model_copy(update={"val_fraction": 0.3}), str(root), ingest_id, [32]
    )
    assert other.dataset_version not in (full.dataset_version, capped.dataset_version)

    # A split that selects nothing writes no folder and records 0; its images all train.
    none = write_shards.fn(ShardsConfig(val_fraction=1e-9, workers=2), str(root), ingest_id, [32])
    assert none.stages[32]["val_samples"] == 0
    assert not (root / "shards" / none.dataset_version / "32-val").exists()
    assert none.stages[32]["samples"] == full.stages[32]["samples"] + full.stages[32]["val_samples"]
    # No split at all (fraction or cap 0): the version has no val settings, so it is the same.
    off = write_shards.fn(ShardsConfig(val_fraction=0, workers=2), str(root), ingest_id, [32])
    zero = write_shards.fn(ShardsConfig(val_max=0, workers=2), str(root), ingest_id, [32])
    assert off.dataset_version == zero.dataset_version and zero.reused
    assert off.dataset_version != none.dataset_version and off.stages[32]["val_samples"] == 0


def test_a_stage_held_out_whole_is_a_clear_error(validated):
    root, ingest_id, _ = validated
    cfg = ShardsConfig(val_fraction=0.999, workers=1)
    with pytest.raises(ValueError, match="stage 32px has no training images.*val_fraction"):
        write_shards.fn(cfg, str(root), ingest_id, [32])


def test_a_shard_write_logs_none_of_streamings_routine_notices(validated, caplog, capfd):
    """streaming warns on every part ("Directory ... exists and not empty. But continue to
    mkdir ...", "A temporary folder ... is created to store index files"): nothing a user
    acts on, so none of it reaches Kiln's log (or stderr)."""
    import logging

    root, ingest_id, _ = validated
    with caplog.at_level(logging.WARNING):
        res = write_shards.fn(ShardsConfig(size_limit=16384, workers=1), str(root), ingest_id, [32])
    assert res.stages[32]["shards"] > 1
    out = capfd.readouterr()
    text = "\n".join(r.getMessage() for r in caplog.records) + out.out + out.err
    assert "continue to mkdir" not in text
    assert "is created to store index files" not in text
    # Streaming's own records still pass when they are something else: only the two go.
    logging.getLogger("streaming.base.storage.upload").warning("something else")
    assert "something else" in caplog.text


def test_the_plans_split_holds_only_the_capped_candidates_and_matches_the_whole(monkeypatch):
    """`kiln shard --dry-run` keeps the `val_max` first held-out candidates across row groups
    instead of every key below `val_fraction`: the split it counts is the one the conversion
    takes from all the clean rows at once (`held_out_mask`)."""
    import numpy as np
    import pandas as pd

    import tasks.shards.write as write

    rng = np.random.default_rng(3)
    n = 5000
    rows = pd.DataFrame(
        {
            "source": rng.choice(["s3://a", "/b"], n),
            "key": [f"{i % 3000:06d}.jpg" for i in range(n)],  # keys shared by the two sources
            "sha256": [f"{i:064x}" for i in range(n)],
            "caption": "a photo",
            "width": rng.integers(16, 128, n),
            "height": rng.integers(16, 128, n),
        }
    )
    rows = rows.drop_duplicates(["source", "key"]).reset_index(drop=True)
    monkeypatch.setattr(write, "_plan_columns", lambda layout, ingest_id: list(rows.columns))
    monkeypatch.setattr(
        write,
        "scan_clean",
        lambda root, ingest_id, columns: (rows.iloc[i : i + 331] for i in range(0, len(rows), 331)),
    )
    for fraction, cap in ((0.3, 25), (0.3, 100_000), (0.002, 25)):
        cfg = ShardsConfig(val_fraction=fraction, val_max=cap)
        settings = {"resolutions": [32, 64]}
        got = write._plan("root", "ing", None, settings, {}, cfg)
        held = write.held_out_mask(rows["source"], rows["key"], fraction, cap)
        assert 0 < held.sum() <= cap
        for r in (32, 64):
            ok = np.minimum(rows["width"], rows["height"]).to_numpy() >= r
            assert got.stages[r] == {
                "samples": int((ok & ~held).sum()),
                "val_samples": int((ok & held).sum()),
            }
