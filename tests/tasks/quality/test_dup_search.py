"""The validate step's duplicate checks in hash-prefix partitions (tasks/quality/dup_search.py) give
the driver search's verdict: on the hostile corpus, across runs, incrementally and on Dask."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest

from kiln_config import IngestConfig, QualityConfig
from tasks.catalog.clean import read_clean
from tasks.ingest.run import ingest_source
from tasks.quality.dup_search import dup_partitions_for
from tasks.quality.validate import validate_catalog
from tests.tasks.quality.test_validate import RULES, _add_images, _outputs, _three_ingests


def _same(a_root, b_root, ingest_id) -> None:
    a, b = _outputs(a_root, ingest_id), _outputs(b_root, ingest_id)
    pd.testing.assert_frame_equal(a[0], b[0])
    pd.testing.assert_frame_equal(a[1], b[1])
    assert a[2] == b[2]
    for name in ("quarantine.parquet", "summary.json"):
        qa, qb = (r / "quality" / ingest_id / name for r in (a_root, b_root))
        if name.endswith(".json"):
            docs = {"data_docs": None}  # a path under each root
            assert json.loads(qa.read_text()) | docs == json.loads(qb.read_text()) | docs
        else:
            pd.testing.assert_frame_equal(pd.read_parquet(qa), pd.read_parquet(qb))


def test_partitions_are_used_past_one_check_partition():
    assert dup_partitions_for(10_000_000, 10_000, 131_072) == 0, "incremental: the driver"
    assert dup_partitions_for(10_000_000, 10_000_000, 131_072) == 20
    assert dup_partitions_for(300_000, 300_000, 131_072) == 2


def test_hostile_corpus_gets_the_same_verdict_in_partitions(tmp_path, hostile_src):
    src, _ = hostile_src
    root = tmp_path / "root"
    ing = ingest_source(IngestConfig(source=str(src), workers=1), str(root))
    other = tmp_path / "parts"
    shutil.copytree(root, other)
    rules = QualityConfig(min_side=32, max_caption_chars=500, max_reject_fraction=1.0)
    one = validate_catalog.fn(str(root), ing.ingest_id, rules)
    many = validate_catalog.fn(str(other), ing.ingest_id, rules, dup_partitions=5)
    assert one.to_dict() | {"data_docs": None} == many.to_dict() | {"data_docs": None}
    _same(root, other, ing.ingest_id)
    assert not (other / "catalog" / ing.ingest_id / "dup-hashes").exists(), "scratch removed"


def test_copies_across_runs_are_caught_in_partitions(tmp_path):
    from PIL import Image

    src, root = tmp_path / "src", tmp_path / "root"
    src.mkdir()
    _add_images(src, ["orig.jpg"], color=(200, 40, 40))
    _add_images(src, ["other.jpg"], size=(90, 64), color=(20, 20, 20))
    first = ingest_source(IngestConfig(source=str(src)), str(root))
    validate_catalog.fn(str(root), first.ingest_id, RULES, dup_partitions=3)
    (src / "copy.jpg").write_bytes((src / "orig.jpg").read_bytes())
    Image.open(src / "orig.jpg").resize((60, 60)).save(src / "resized.jpg", quality=70)
    with open(src / "metadata.jsonl", "a") as f:
        f.write(json.dumps({"file_name": "copy.jpg", "text": "same bytes, new name"}) + "\n")
        f.write(json.dumps({"file_name": "resized.jpg", "text": "smaller, recompressed"}) + "\n")
    second = ingest_source(IngestConfig(source=str(src)), str(root))
    flagged = validate_catalog.fn(str(root), second.ingest_id, RULES, dup_partitions=4)
    assert flagged.incremental_from == first.ingest_id and flagged.checked_rows == 2
    q = pd.read_parquet(root / "quality" / second.ingest_id / "quarantine.parquet")
    q = q.set_index("key")
    assert q.loc["copy.jpg", "reason"] == "duplicate_sha256"
    assert q.loc["copy.jpg", "detail"].endswith("/orig.jpg"), "the earlier run's copy is kept"
    near = read_clean(str(root), second.ingest_id).set_index("key")["near_duplicate_of"]
    assert near["resized.jpg"].endswith("/orig.jpg") and flagged.near_duplicates == 1
    with pytest.raises(ValueError, match="dup_partitions: expected None or an int >= 0, got -1"):
        validate_catalog.fn(str(root), second.ingest_id, RULES, dup_partitions=-1)


def test_incremental_and_full_validates_in_partitions_match_the_driver(tmp_path, demo_src):
    root, ids = _three_ingests(tmp_path, demo_src)
    roots = {name: tmp_path / name for name in ("full", "parts", "parts_full")}
    for r in roots.values():
        shutil.copytree(root, r)
    rules = RULES.model_copy(update={"drop_near_duplicates": True})
    validate_catalog.fn(str(root), ids[0], rules)
    validate_catalog.fn(str(roots["parts"]), ids[0], rules, dup_partitions=2)
    inc = validate_catalog.fn(str(root), ids[2], rules)
    inc_parts = validate_catalog.fn(str(roots["parts"]), ids[2], rules, dup_partitions=3)
    assert inc.incremental_from == inc_parts.incremental_from == ids[0]
    _same(root, roots["parts"], ids[2])
    validate_catalog.fn(str(roots["full"]), ids[2], rules)
    full = validate_catalog.fn(str(roots["parts_full"]), ids[2], rules, dup_partitions=4)
    assert full.incremental_from is None
    _same(roots["full"], roots["parts_full"], ids[2])
    reasons = _outputs(roots["parts_full"], ids[2])[1].set_index("key")["reason"]
    assert {reasons[f"copy-{i}.jpg"] for i in (0, 1)} == {"duplicate_sha256"}
    assert {reasons[f"near-{i}.jpg"] for i in (0, 1)} == {"near_duplicate"}


@pytest.mark.integration
def test_partitions_on_a_dask_cluster_match_one_machine(tmp_path, demo_src):
    from distributed import LocalCluster

    root, ids = _three_ingests(tmp_path, demo_src)
    dask_root = tmp_path / "dask"
    shutil.copytree(root, dask_root)
    rules = RULES.model_copy(update={"drop_near_duplicates": True})
    validate_catalog.fn(str(root), ids[2], rules)
    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
    ) as cluster:
        validate_catalog.fn(
            str(dask_root), ids[2], rules, dask_address=cluster.scheduler_address, dup_partitions=3
        )
        ran = set(cluster.scheduler.task_prefixes)
    assert {"exact_partition", "split_files", "near_partition"} <= ran, ran
    _same(root, dask_root, ids[2])
