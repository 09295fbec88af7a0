import json

import pandas as pd
import pytest

from data_quality.verdict import QualityGateError, gate_for_sharding
from kiln_config import IngestConfig, QualityConfig
from kiln_config.errors import InputError
from tasks.catalog.clean import read_clean
from tasks.catalog.view import read_view, scan_view
from tasks.ingest.run import ingest_source
from tasks.quality.validate import validate_catalog
from tasks.storage.layout import Layout

RULES = QualityConfig(min_side=32, max_reject_fraction=0.25)


def _quarantine(root, ingest_id):
    return pd.read_parquet(root / "quality" / ingest_id / "quarantine.parquet")


def test_validate_quarantines_planted_items_and_builds_data_docs(tmp_path, demo_src):
    root = tmp_path / "root"
    ing = ingest_source(IngestConfig(source=str(demo_src), workers=1), str(root))
    res = validate_catalog.fn(str(root), ing.ingest_id, RULES)
    q = _quarantine(root, ing.ingest_id)
    reasons = dict(zip(q["key"], q["reason"], strict=True))
    assert reasons["bad-no-caption.jpg"] == "caption_blank"
    assert reasons["bad-duplicate.jpg"] == "duplicate_sha256"
    assert "00000.jpg" not in reasons, "the original of a duplicate stays"
    assert res.clean + len(q) == res.listed == 60
    assert res.reasons["too_small"] >= 1
    docs = root / "quality" / ing.ingest_id
    assert res.data_docs == str(docs / "index.html") and (docs / "index.html").is_file()
    assert list((docs / "validations" / "kiln_catalog").rglob("*.html"))
    # Re-running replaces the validate rows instead of appending them again.
    validate_catalog.fn(str(root), ing.ingest_id, RULES)
    assert len(_quarantine(root, ing.ingest_id)) == len(q)
    # A run that fails on the way leaves no verdict behind: the shard step refuses the catalog
    # instead of trusting the one from before.
    licensed = RULES.model_copy(update={"allowed_licenses": ["cc0"]})
    with pytest.raises(InputError, match="no 'license' column"):
        validate_catalog.fn(str(root), ing.ingest_id, licensed)
    with pytest.raises(QualityGateError, match="has no quality verdict"):
        gate_for_sharding(Layout(root).catalog(ing.ingest_id), ing.ingest_id)


def test_gate_fails_with_a_reason_table_and_keeps_the_quarantine(tmp_path, demo_src):
    root = tmp_path / "root"
    ing = ingest_source(IngestConfig(source=str(demo_src), workers=1), str(root))
    with pytest.raises(QualityGateError) as e:
        validate_catalog.fn(
            str(root), ing.ingest_id, QualityConfig(min_side=100, max_reject_fraction=0.1)
        )
    msg = str(e.value)
    assert "quality.max_reject_fraction" in msg and "| `too_small` |" in msg
    assert (root / "quality" / ing.ingest_id / "summary.json").is_file()
    assert (_quarantine(root, ing.ingest_id)["reason"] == "too_small").sum() > 10
    verdict = json.loads((root / "catalog" / ing.ingest_id / "verdict.json").read_text())
    assert verdict["passed"] is False and verdict["reasons"]["too_small"] > 10
    # The pipeline's override: the failure is logged and recorded, not raised.
    res = validate_catalog.fn(
        str(root),
        ing.ingest_id,
        QualityConfig(min_side=100, max_reject_fraction=0.1),
        allow_failed_gate=True,
    )
    assert not res.passed and res.reasons == verdict["reasons"]


def _add_images(src, names, caption="a new photo", size=(64, 64), color=(10, 120, 240)):
    from PIL import Image, ImageDraw

    rows = []
    for i, name in enumerate(names):
        img = Image.new("RGB", size, color)
        ImageDraw.Draw(img).rectangle((i % 30, 5, 40, 30), fill=(250, 250, 20))
        img.save(src / name, quality=90)
        rows.append(json.dumps({"file_name": name, "text": f"{caption} {i}"}) + "\n")
    with open(src / "metadata.jsonl", "a") as f:
        f.writelines(rows)


def test_incremental_runs_decode_only_what_is_new(tmp_path):
    from kiln_demo.data import write_demo_dataset

    src, root = tmp_path / "src", tmp_path / "root"
    write_demo_dataset(src, n=20, seed=1)
    first = ingest_source(IngestConfig(source=str(src), workers=2), str(root))
    assert first.new_items == 20 and not first.reused

    again = ingest_source(IngestConfig(source=str(src), workers=2), str(root))
    assert again.reused and again.new_items == 0 and again.ingest_id == first.ingest_id
    assert {p.name for p in (root / "catalog").iterdir()} == {first.ingest_id, "LATEST", "tables"}

    _add_images(src, [f"new-{i:02d}.jpg" for i in range(10)])
    third = ingest_source(IngestConfig(source=str(src), workers=2), str(root))
    assert (third.new_items, third.unchanged_items, third.removed_items) == (10, 20, 0)
    # What this run added: the files of its partition, read without opening the others.
    delta = pd.concat(scan_view(Layout(root), third.ingest_id, "accepted", ["key"], after_seq=1))
    assert sorted(delta["key"]) == [f"new-{i:02d}.jpg" for i in range(10)]
    view = read_view(Layout(root), third.ingest_id)[0]
    assert len(view) == first.accepted + 10 and third.listed == 30
    assert set(view.loc[view["key"].str.startswith("new-"), "ingest_seq"]) == {2}
    seen = pd.read_parquet(root / "catalog" / third.ingest_id / "listing.parquet")
    # The run's listing holds what it decoded: the ten new images, and the changed manifest.
    assert len(seen) == 11 and seen["version"].str.len().gt(0).all()
    assert set(seen["key"]) == {*delta["key"], "metadata.jsonl"}

    (src / "new-03.jpg").unlink()
    fourth = ingest_source(IngestConfig(source=str(src), workers=1), str(root))
    assert (fourth.new_items, fourth.removed_items) == (0, 1)
    gone = read_view(Layout(root), fourth.ingest_id)[0]
    assert "new-03.jpg" not in set(gone["key"]) and len(gone) == len(view) - 1
    # The manifest row of the deleted file is now a problem row, reported, not dropped.
    mq = read_view(Layout(root), fourth.ingest_id)[1]
    assert "new-03.jpg" in set(mq.loc[mq["reason"] == "manifest_missing_file", "key"])
    # The removal is one commit; the third ingest's view still reads it back (time travel).
    assert read_view(Layout(root), third.ingest_id)[0]["key"].eq("new-03.jpg").sum() == 1
    versions = [
        json.loads((root / "catalog" / i.ingest_id / "summary.json").read_text())["table_versions"][
            "accepted"
        ]
        for i in (first, third, fourth)
    ]
    assert versions == [1, 2, 3], "one commit an ingest (version 0: the empty table created)"


def test_exact_and_near_duplicates_are_caught_across_runs(tmp_path):
    from PIL import Image

    src, root = tmp_path / "src", tmp_path / "root"
    src.mkdir()
    _add_images(src, ["orig.jpg"], color=(200, 40, 40))
    _add_images(src, ["other.jpg"], size=(90, 64), color=(20, 20, 20))
    first = ingest_source(IngestConfig(source=str(src)), str(root))
    validate_catalog.fn(str(root), first.ingest_id, RULES)

    (src / "copy.jpg").write_bytes((src / "orig.jpg").read_bytes())
    Image.open(src / "orig.jpg").resize((60, 60)).save(src / "resized.jpg", quality=70)
    with open(src / "metadata.jsonl", "a") as f:
        f.write(json.dumps({"file_name": "copy.jpg", "text": "same bytes, new name"}) + "\n")
        f.write(json.dumps({"file_name": "resized.jpg", "text": "smaller, recompressed"}) + "\n")
    second = ingest_source(IngestConfig(source=str(src)), str(root))
    assert second.new_items == 2

    flagged = validate_catalog.fn(str(root), second.ingest_id, RULES)
    q = _quarantine(root, second.ingest_id).set_index("key")
    assert q.loc["copy.jpg", "reason"] == "duplicate_sha256"
    assert q.loc["copy.jpg", "detail"].endswith("/orig.jpg"), "the earlier run's copy is kept"
    clean = read_clean(str(root), second.ingest_id)
    near = clean.set_index("key")["near_duplicate_of"]
    assert near["resized.jpg"].endswith("/orig.jpg") and flagged.near_duplicates == 1

    strict = RULES.model_copy(update={"drop_near_duplicates": True, "max_reject_fraction": 1})
    validate_catalog.fn(str(root), second.ingest_id, strict)
    q = _quarantine(root, second.ingest_id).set_index("key")
    assert q.loc["resized.jpg", "reason"] == "near_duplicate"


def _three_ingests(tmp_path, demo_src):
    """A root with three ingests of one source: the demo images, then exact and near copies
    and planted failures, then more of both."""
    import shutil

    from PIL import Image

    src, root = tmp_path / "src", tmp_path / "root"
    shutil.copytree(demo_src, src)
    ids = [ingest_source(IngestConfig(source=str(src), workers=1), str(root)).ingest_id]
    names = sorted(p.name for p in src.glob("*.jpg"))
    for round_, (a, b) in enumerate([(names[0], names[1]), (names[2], names[3])]):
        (src / f"copy-{round_}.jpg").write_bytes((src / a).read_bytes())
        Image.open(src / b).resize((60, 60)).save(src / f"near-{round_}.jpg", quality=70)
        _add_images(src, [f"tiny-{round_}.jpg"], size=(20, 20))
        with open(src / "metadata.jsonl", "a") as f:
            for n in (f"copy-{round_}.jpg", f"near-{round_}.jpg"):
                f.write(json.dumps({"file_name": n, "text": f"a copy {n}"}) + "\n")
        ids.append(ingest_source(IngestConfig(source=str(src), workers=1), str(root)).ingest_id)
    return root, ids


def _outputs(root, ingest_id):
    cat = root / "catalog" / ingest_id
    verdict = json.loads((cat / "verdict.json").read_text())
    verdict.pop("validated_at")
    verdict.pop("verdict_table_versions")  # which commit of the root's verdict tables
    return (
        read_clean(str(root), ingest_id).sort_values(["source", "key"]).reset_index(drop=True),
        pd.read_parquet(cat / "rejects.parquet")
        .sort_values(["source", "key"])
        .reset_index(drop=True),
        verdict,
    )


def test_incremental_validate_checks_only_new_rows_and_matches_a_full_one(tmp_path, demo_src):
    import shutil

    root, ids = _three_ingests(tmp_path, demo_src)
    full_root = tmp_path / "full"
    shutil.copytree(root, full_root)
    rules = RULES.model_copy(update={"drop_near_duplicates": True})
    first = validate_catalog.fn(str(root), ids[0], rules)
    accepted = len(read_view(Layout(root), ids[0])[0])
    assert first.incremental_from is None and first.checked_rows == accepted
    last = validate_catalog.fn(str(root), ids[2], rules)
    assert last.incremental_from == ids[0] and last.checked_rows == 6, "two ingests of 3 rows"
    # Every row checked at once, with no earlier verdict, reaches the same outcome.
    full = validate_catalog.fn(str(full_root), ids[2], rules)
    assert full.incremental_from is None and full.checked_rows == accepted + 6
    for a, b in zip(_outputs(root, ids[2]), _outputs(full_root, ids[2]), strict=True):
        if isinstance(a, dict):
            a.pop("validated_at", None)
            assert a == b
        else:
            pd.testing.assert_frame_equal(a, b)
    reasons = _outputs(root, ids[2])[1].set_index("key")["reason"]
    assert {reasons[f"copy-{i}.jpg"] for i in (0, 1)} == {"duplicate_sha256"}
    assert {reasons[f"near-{i}.jpg"] for i in (0, 1)} == {"near_duplicate"}
    # Other rules: every row is checked again, not only the new ones.
    other = validate_catalog.fn(str(root), ids[2], rules.model_copy(update={"min_side": 30}))
    assert other.incremental_from is None and other.checked_rows == full.checked_rows


@pytest.mark.integration
def test_a_dask_cluster_validates_and_plans_like_one_machine(tmp_path, demo_src):
    import shutil

    from distributed import LocalCluster

    from kiln_config import ShardsConfig
    from tasks.shards.write import write_shards

    root, ids = _three_ingests(tmp_path, demo_src)
    dask_root = tmp_path / "dask"
    shutil.copytree(root, dask_root)
    # The offline content rules too: scored on the driver, joined in the partitions.
    rules = RULES.model_copy(
        update={"drop_near_duplicates": True, "max_unsafe": 0.6, "allowed_languages": ["en"]}
    )
    shards = ShardsConfig(val_fraction=0.2, workers=1)
    local = validate_catalog.fn(str(root), ids[2], rules)
    local_plan = write_shards.fn(shards, str(root), ids[2], [32, 64], dry_run=True)
    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
    ) as cluster:
        remote = validate_catalog.fn(
            str(dask_root), ids[2], rules, dask_address=cluster.scheduler_address
        )
        assert "check_partition" in cluster.scheduler.task_prefixes, "checks ran on Dask"
        remote_plan = write_shards.fn(
            shards,
            str(dask_root),
            ids[2],
            [32, 64],
            dry_run=True,
            dask_address=cluster.scheduler_address,
        )
    assert remote.checked_rows == local.checked_rows == len(read_view(Layout(root), ids[2])[0])
    a, b = _outputs(root, ids[2]), _outputs(dask_root, ids[2])
    pd.testing.assert_frame_equal(a[0], b[0])
    pd.testing.assert_frame_equal(a[1], b[1])
    assert a[2] == b[2] and a[2]["passed"]
    assert local_plan.dataset_version == remote_plan.dataset_version
    assert local_plan.stages == remote_plan.stages and local_plan.dry_run
    # The plan, a row group at a time, is what the conversion then writes.
    written = write_shards.fn(shards, str(root), ids[2], [32, 64])
    assert written.dataset_version == local_plan.dataset_version and not written.dry_run
    for r, planned in local_plan.stages.items():
        got = written.stages[r]
        assert (got["samples"], got["val_samples"]) == (planned["samples"], planned["val_samples"])


def test_the_verdicts_pairs_are_found_exactly_even_when_the_high_hash_is_shared(
    tmp_path, monkeypatch
):
    """`scan_clean`'s look-up of quarantined and flagged rows by (source, key): every pair
    found at its own value, none found that is not one, also when many pairs share the first
    64-bit hash (forced here by a weak one) and only the second tells them apart."""
    import numpy as np
    import pandas as pd

    import tasks.catalog.clean as gate

    rows = pd.DataFrame(
        {"source": ["s3://a"] * 500 + ["/b"] * 500, "key": [f"{i:05d}.jpg" for i in range(1000)]}
    )
    rows["near_duplicate_of"] = "of-" + rows["key"]
    path = tmp_path / "pairs.parquet"
    rows.iloc[::3].to_parquet(path, row_group_size=97)
    strong = gate._pair_hashes
    for hashes in (strong, lambda p: (np.array([len(s) % 3 for s in p], np.uint64), strong(p)[1])):
        monkeypatch.setattr(gate, "_pair_hashes", hashes)
        pairs = gate._Pairs(path, "near_duplicate_of")
        at = pairs.find(rows["source"], rows["key"])
        assert ((at >= 0) == (rows.index % 3 == 0)).all()
        got = pairs.values.take(at[at >= 0]).to_pylist()
        assert got == rows["near_duplicate_of"].iloc[::3].tolist()
        # the same key under another source is another pair
        assert (pairs.find(["s3://other"] * 3, ["00000.jpg", "00003.jpg", "00999.jpg"]) < 0).all()
