"""The validate step's verdict rows written as files and streamed (data_quality/verdict_rows.py)
give the rows that the in-memory merge gives (`data_quality.suite.apply_cross`, a pandas sort
of the quarantine), on a real ingested root, with the quarantine sorted in runs on disk."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from data_quality import external_sort
from data_quality.suite import CrossCheck, RowCheck, apply_cross, cross_hits
from data_quality.verdict_rows import FLAG_SCHEMA, REJECT_SCHEMA, write_rows
from kiln_config import IngestConfig, QualityConfig
from tasks.catalog.view import read_part, read_view, view_parts
from tasks.ingest.run import ingest_source
from tasks.quality.verdict_tables import resolve_hits, write_quarantine
from tasks.storage.layout import Layout


@pytest.fixture
def hostile_root(tmp_path, hostile_src):
    src, _ = hostile_src
    root = tmp_path / "root"
    ing = ingest_source(IngestConfig(source=str(src), workers=1), str(root))
    return Layout(root), ing.ingest_id


def _random_cross(n: int, seed: int) -> tuple[CrossCheck, np.ndarray]:
    """Duplicates and near-duplicates of earlier rows at random, and row-local rejects."""
    rng = np.random.default_rng(seed)
    pos = np.arange(n)
    dup = np.where(rng.random(n) < 0.3, (rng.random(n) * pos).astype(np.int64), -1)
    near = np.where(rng.random(n) < 0.3, (rng.random(n) * pos).astype(np.int64), -1)
    dup[0] = near[0] = -1
    return CrossCheck(dup, near), np.flatnonzero(rng.random(n) < 0.2)


@pytest.mark.parametrize("drop_near", [False, True])
def test_resolved_hits_are_apply_cross_rows(hostile_root, tmp_path, drop_near):
    layout, ingest_id = hostile_root
    accepted = read_view(layout, ingest_id)[0]
    parts = view_parts(layout, ingest_id, "accepted")
    n = len(accepted)
    assert n > 10
    rules = QualityConfig(drop_near_duplicates=drop_near)
    cross, rejected = _random_cross(n, seed=3)
    src, key = accepted["source"].to_numpy(object), accepted["key"].to_numpy(object)
    local = pd.DataFrame(
        {
            "source": src[rejected],
            "key": key[rejected],
            "reason": "too_small",
            "detail": "width=1",
            "pos": rejected,
        }
    )
    want = apply_cross(
        RowCheck(rows=n, rejected=local, counts={}, sample=None),
        cross,
        rules,
        lambda at: (src[at], key[at]),
    )
    hits = cross_hits(rejected, cross, rules)
    assert len(hits["dup"][0]) and len(hits["near"][0])
    got_rejects, got_flags = resolve_hits(parts, hits, drop_near, tmp_path)
    pd.testing.assert_frame_equal(
        pd.read_parquet(got_rejects).astype(object),
        want["rejected"].iloc[len(local) :].reset_index(drop=True).astype(object),
    )
    pd.testing.assert_frame_equal(
        pd.read_parquet(got_flags).astype(object),
        want["flags"].reset_index(drop=True).astype(object),
        check_index_type=False,
    )


def test_rows_stream_with_terms_taking_their_place(tmp_path):
    base = tmp_path / "base.parquet"
    write_rows(
        base,
        [
            pd.DataFrame(
                {
                    "source": ["s"] * 3,
                    "key": ["a", "b", "c"],
                    "reason": ["too_small", "takedown", "caption_blank"],
                    "detail": ["w=1", "on the list", "''"],
                }
            )
        ],
        REJECT_SCHEMA,
    )
    staged = pd.DataFrame(
        {
            "source": ["s", "s"],
            "key": ["d", "e"],
            "reason": ["too_small"] * 2,
            "detail": ["w=2", "w=3"],
        }
    )
    terms = pd.DataFrame(
        {
            "source": ["s", "s"],
            "key": ["c", "e"],
            "reason": ["takedown"] * 2,
            "detail": ["on the takedown list"] * 2,
        }
    )
    gone = pa.array(["s\0c", "s\0e"], pa.string())
    out = tmp_path / "rejects.parquet"
    n = write_rows(
        out,
        [base, staged],
        REJECT_SCHEMA,
        gone=gone,
        drop_reasons=["takedown", "license_expired"],
        then=[terms],
    )
    got = pd.read_parquet(out)
    assert n == len(got) == 4
    assert got["key"].tolist() == ["a", "d", "c", "e"]
    assert got["reason"].tolist() == ["too_small", "too_small", "takedown", "takedown"]
    assert not list(tmp_path.glob("*.tmp")), "written atomically"
    empty = tmp_path / "flags.parquet"
    assert write_rows(empty, [], FLAG_SCHEMA) == 0
    assert pd.read_parquet(empty).columns.tolist() == FLAG_SCHEMA.names


def test_quarantine_sorted_on_disk_matches_a_pandas_sort(hostile_root, tmp_path, monkeypatch):
    layout, ingest_id = hostile_root
    monkeypatch.setattr(external_sort, "RUN_ROWS", 10_000)  # 13 runs, merged
    monkeypatch.setattr(external_sort, "MERGE_ROWS", 1_000)
    rng = np.random.default_rng(0)
    n = 120_000
    rejects = pd.DataFrame(
        {
            "source": rng.choice(["s3://b/x", "s3://a/y", "/data/z"], n),
            "key": [f"{i:07d}.jpg" for i in rng.integers(0, n // 2, n)],  # ties on (source, key)
            "reason": rng.choice(["too_small", "caption_blank", "duplicate_sha256"], n),
            "detail": [f"row {i}" for i in range(n)],
        }
    )
    path = tmp_path / "rejects.parquet"
    write_rows(path, [rejects], REJECT_SCHEMA)
    qdir = layout.quality(ingest_id)
    qdir.mkdir(parents=True)
    counts = write_quarantine(layout, ingest_id, path, qdir)

    ingest_q = pd.concat(
        [read_part(p) for p in view_parts(layout, ingest_id, "quarantine")], ignore_index=True
    )
    assert len(ingest_q)
    want = pd.concat(
        [ingest_q, rejects.assign(step="validate", ingest_id=ingest_id)], ignore_index=True
    ).sort_values(["source", "key"], kind="stable")
    got = pd.read_parquet(qdir / "quarantine.parquet")
    assert got.columns.tolist() == want.columns.tolist()
    cols = ["source", "key", "reason", "detail", "step"]
    pd.testing.assert_frame_equal(
        got[cols].astype(object), want[cols].reset_index(drop=True).astype(object)
    )
    sample = pd.read_parquet(qdir / "quarantine_sample.parquet")
    pd.testing.assert_frame_equal(
        sample[cols].astype(object),
        want.groupby("reason").head(20)[cols].reset_index(drop=True).astype(object),
    )
    by = counts.set_index(["step", "reason"])["n"].to_dict()
    assert by == want.groupby(["step", "reason"]).size().to_dict()
    assert not list(qdir.parent.glob(".*-sort")), "the sort's runs are removed"
