"""An incremental validate's shortcuts give what a full one gives: the quarantine merged from
the earlier verdict's, and the old rows' hashes read from the hash cache."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from data_quality import hash_cache
from data_quality.suite import hash_columns
from kiln_config import IngestConfig, QualityConfig
from tasks.catalog.takedown import add_takedown
from tasks.catalog.view import read_part, view_parts
from tasks.ingest.run import ingest_source
from tasks.quality import validate
from tasks.quality.dup_search import old_hash_batches
from tasks.quality.validate import validate_catalog
from tasks.storage.layout import Layout

RULES = QualityConfig(min_side=32, max_reject_fraction=0.5, drop_near_duplicates=True)


@pytest.fixture
def merges(monkeypatch) -> list:
    """The earlier quarantine file each write_quarantine merged from (None: rebuilt)."""
    seen = []
    real = validate.write_quarantine

    def spy(*args, base=None, **kwargs):
        seen.append(base)
        return real(*args, base=base, **kwargs)

    monkeypatch.setattr(validate, "write_quarantine", spy)
    return seen


def _ingest(src, root) -> str:
    return ingest_source(IngestConfig(source=str(src), workers=1), str(root)).ingest_id


def _add(src, name: str, copy_of: str | None = None, size=(64, 64)) -> None:
    from PIL import Image

    if copy_of:
        (src / name).write_bytes((src / copy_of).read_bytes())
    else:
        Image.new("RGB", size, (len(name) * 9 % 256, 80, 160)).save(src / name)
    with open(src / "metadata.jsonl", "a") as f:
        f.write(json.dumps({"file_name": name, "text": f"a photo called {name}"}) + "\n")


def _root(tmp_path, demo_src):
    """A root with one ingest of the demo images (some quarantined at ingest), validated."""
    src, root = tmp_path / "src", tmp_path / "root"
    shutil.copytree(demo_src, src)
    first = _ingest(src, root)
    validate_catalog.fn(str(root), first, RULES)
    return src, root, first


def _same_as_full(tmp_path, root, ingest_id) -> None:
    """Validate `ingest_id` again on a copy of the root with no verdict to start from, and
    compare every output with the incremental run's: the quarantine row for row, the
    verdict's rows as sets (an incremental run lists the earlier verdict's first)."""
    full = tmp_path / f"full-{ingest_id}"
    shutil.copytree(root, full)
    for v in (full / "catalog").glob("*/verdict.json"):
        v.unlink()
    shutil.rmtree(hash_cache.cache_folder(Layout(full).folder("catalog")))
    assert validate_catalog.fn(str(full), ingest_id, RULES).incremental_from is None
    for rel in ("quality/{}/quarantine.parquet", "quality/{}/quarantine_sample.parquet"):
        a = pd.read_parquet(root / rel.format(ingest_id))
        pd.testing.assert_frame_equal(a, pd.read_parquet(full / rel.format(ingest_id)))
    for rel in ("catalog/{}/rejects.parquet", "catalog/{}/near_duplicates.parquet"):
        a, b = (
            pd.read_parquet(r / rel.format(ingest_id))
            .sort_values(["source", "key"])
            .reset_index(drop=True)
            for r in (root, full)
        )
        pd.testing.assert_frame_equal(a, b)
    va, vb = (
        json.loads((r / "catalog" / ingest_id / "verdict.json").read_text()) for r in (root, full)
    )
    for v in (va, vb):
        for k in ("validated_at", "verdict_table_versions"):
            v.pop(k)
    assert va == vb


def test_the_quarantine_is_merged_from_the_earlier_verdicts_and_equals_a_rebuild(
    tmp_path, demo_src, merges
):
    src, root, first = _root(tmp_path, demo_src)
    names = sorted(p.name for p in src.glob("*.jpg"))
    _add(src, "copy.jpg", copy_of=names[0])
    _add(src, "tiny.jpg", size=(20, 20))
    _add(src, "aaa-first.jpg")  # sorts before every old key
    (src / "broken.jpg").write_bytes(b"not an image")  # quarantined at ingest
    second = _ingest(src, root)
    merges.clear()
    result = validate_catalog.fn(str(root), second, RULES)
    assert result.incremental_from == first
    assert merges == [root / "quality" / first / "quarantine.parquet"]
    reasons = pd.read_parquet(root / "quality" / second / "quarantine.parquet").set_index("key")
    assert reasons.loc["copy.jpg", "reason"] == "duplicate_sha256"
    assert reasons.loc["tiny.jpg", "reason"] == "too_small"
    assert reasons.loc["broken.jpg", "step"] == "ingest"
    _same_as_full(tmp_path, root, second)


def test_the_quarantine_is_rebuilt_when_an_ingest_replaced_quarantined_rows(
    tmp_path, demo_src, merges
):
    from PIL import Image

    src, root, first = _root(tmp_path, demo_src)
    q = pd.read_parquet(root / "quality" / first / "quarantine.parquet").set_index("key")
    assert q.loc["bad-text.jpg", "step"] == "ingest"
    Image.new("RGB", (64, 64), (200, 30, 30)).save(src / "bad-text.jpg")  # fixed in place
    _add(src, "new.jpg")
    second = _ingest(src, root)
    merges.clear()
    result = validate_catalog.fn(str(root), second, RULES)
    assert result.incremental_from == first, "no accepted row left the view"
    assert merges == [None], "a quarantined row of the earlier view left: no merge"
    q = pd.read_parquet(root / "quality" / second / "quarantine.parquet")
    assert "bad-text.jpg" not in set(q["key"])
    _same_as_full(tmp_path, root, second)


def test_the_quarantine_is_rebuilt_when_the_licensing_terms_changed(tmp_path, demo_src, merges):
    src, root, first = _root(tmp_path, demo_src)
    _add(src, "new.jpg")
    second = _ingest(src, root)
    old = read_part(view_parts(Layout(root), first)[0], ["source", "key"]).iloc[0]
    add_takedown(str(root), "a request", images=[(old["source"], old["key"])])
    merges.clear()
    result = validate_catalog.fn(str(root), second, RULES)
    assert result.incremental_from == first and result.takedowns == 1
    assert merges == [None]
    _same_as_full(tmp_path, root, second)


def test_old_hashes_come_from_the_cache_and_equal_the_rows_own(tmp_path, demo_src):
    src, root, first = _root(tmp_path, demo_src)
    layout = Layout(root)
    old = view_parts(layout, first)
    cache = hash_cache.cache_folder(layout.folder("catalog"))
    _add(src, "new.jpg")
    new = [p for p in view_parts(layout, _ingest(src, root)) if p.seq > old[-1].seq]
    for p in old:
        want = hash_columns(read_part(p, ["sha256", "phash"]))
        got = [read() for read in old_hash_batches([p], new, str(cache))]
        for i in range(3):
            np.testing.assert_array_equal(np.concatenate([g[i] for g in got]), want[i])
        assert hash_cache.load(cache, p.path, 0, pq.ParquetFile(p.path).metadata.num_rows)


def test_a_cache_entry_is_used_only_for_the_file_and_row_count_it_was_built_from(tmp_path):
    table, cache = tmp_path / "table", tmp_path / "cache"
    (table / "ingest_seq=1").mkdir(parents=True)
    data = table / "ingest_seq=1" / "part-0.parquet"
    data.write_bytes(b"x" * 100)
    hashes = tuple(np.arange(i, i + 5, dtype=np.uint64) for i in (0, 10, 20))
    hash_cache.save(cache, data, [0, 1], [3, 2], hashes)
    np.testing.assert_array_equal(hash_cache.load(cache, data, 1, 2)[2], [23, 24])
    assert hash_cache.load(cache, data, 1, 3) is None, "another row count"
    assert hash_cache.load(cache, data, 2, 2) is None, "no such row group"
    entry = next(cache.rglob("000001.npy"))
    whole = entry.read_bytes()
    for cut in (b"", whole[:40]):  # a damaged entry is dropped, and the next save rewrites it
        entry.write_bytes(cut)
        assert hash_cache.load(cache, data, 1, 2) is None and not entry.exists()
        hash_cache.save(cache, data, [0, 1], [3, 2], hashes)
        np.testing.assert_array_equal(hash_cache.load(cache, data, 1, 2)[2], [23, 24])
    (entry.parent / ".000001.dead.tmp.npy").write_bytes(b"partial")
    assert hash_cache.prune(cache, table) == 0 and not any(cache.rglob(".*.tmp.npy"))
    data.write_bytes(b"x" * 101)  # the same name, other contents: a stale entry
    assert hash_cache.load(cache, data, 0, 3) is None
    assert hash_cache.prune(cache, table) == 1 and not any(cache.rglob("*.npy"))
    with pytest.raises(ValueError, match="hashes"):
        hash_cache.save(cache, data, [0], [4], hashes)


def test_the_partitioned_search_reads_old_hashes_from_the_cache(tmp_path, demo_src, monkeypatch):
    src, root, first = _root(tmp_path, demo_src)
    names = sorted(p.name for p in src.glob("*.jpg"))
    _add(src, "copy.jpg", copy_of=names[1])
    _add(src, "new.jpg")
    second = _ingest(src, root)
    hits = []
    real = hash_cache.load

    def spy(*args):
        got = real(*args)
        hits.append(got is not None)
        return got

    monkeypatch.setattr(hash_cache, "load", spy)
    result = validate_catalog.fn(str(root), second, RULES, dup_partitions=2)
    assert result.incremental_from == first and hits and all(hits)
    q = pd.read_parquet(root / "quality" / second / "quarantine.parquet").set_index("key")
    assert q.loc["copy.jpg", "reason"] == "duplicate_sha256"
    monkeypatch.undo()
    _same_as_full(tmp_path, root, second)


@pytest.mark.parametrize("dup_partitions", [None, 2], ids=["driver", "partitioned"])
def test_old_files_without_entries_are_hashed_once_and_kept(tmp_path, demo_src, dup_partitions):
    """Data files with no cache entry (those compaction writes, or an emptied cache): the
    incremental validate hashes their rows, keeps them in the cache for the next one, and
    gives what a full validate gives."""
    src, root, first = _root(tmp_path, demo_src)
    layout = Layout(root)
    cache = hash_cache.cache_folder(layout.folder("catalog"))
    shutil.rmtree(cache)
    _add(src, "copy.jpg", copy_of=sorted(p.name for p in src.glob("*.jpg"))[2])
    second = _ingest(src, root)
    result = validate_catalog.fn(str(root), second, RULES, dup_partitions=dup_partitions)
    assert result.incremental_from == first
    old = view_parts(layout, first)
    for p in old:
        want = hash_columns(read_part(p, ["sha256", "phash"]))
        got = hash_cache.load(cache, p.path, 0, pq.ParquetFile(p.path).metadata.num_rows)
        assert got is not None, "kept for the next validate"
        for i in range(3):
            np.testing.assert_array_equal(got[i], want[i])
    q = pd.read_parquet(root / "quality" / second / "quarantine.parquet").set_index("key")
    assert q.loc["copy.jpg", "reason"] == "duplicate_sha256"
    _same_as_full(tmp_path, root, second)
