"""The catalog's Delta tables: migration of a chain-layout root, other engines, and the
data team's commands (show, sql, export, compact)."""

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from tasks.catalog import legacy as catalog_legacy
from tasks.catalog.admin import compact, export, migrate, query, show
from tasks.catalog.view import chain, read_view, scan_view, table_path
from tasks.storage.layout import Layout

# Written by Kiln's chain-layout ingest (tests/data/chain_catalog/make.py): source a (12
# files), source b (8), then a again with 3 files added and 1 removed.
FIXTURE = Path(__file__).parents[2] / "data" / "chain_catalog"


def _sorted(df: pd.DataFrame) -> pd.DataFrame:
    cols = sorted(c for c in df.columns if c != "ingest_seq")
    out = df[cols].sort_values(["source", "key"], kind="stable").reset_index(drop=True)
    return out.astype(object).where(out.notna(), None)


@pytest.fixture
def migrated(tmp_path):
    root = tmp_path / "root"
    shutil.copytree(FIXTURE / "catalog", root / "catalog")
    layout = Layout(root)
    ids = [s["id"] for s in catalog_legacy.chain(layout, layout.latest_or_none("catalog"))]
    before = {i: catalog_legacy.read_view(layout, i) for i in ids}
    with pytest.raises(ValueError, match="kiln catalog migrate"):
        read_view(layout, ids[-1])
    assert migrate(str(root)) == ids
    return root, ids, before


def test_migration_keeps_every_ingest_view(migrated):
    root, ids, before = migrated
    layout = Layout(root)
    assert len(ids) == 3
    for i in ids:  # each ingest id reads back its own view, by time travel
        acc, q, seq = read_view(layout, i)
        old_acc, old_q, old_seq = before[i]
        assert seq == old_seq
        pd.testing.assert_frame_equal(_sorted(acc), _sorted(old_acc))
        pd.testing.assert_frame_equal(_sorted(q), _sorted(old_q[q.columns.drop("ingest_seq")]))
    assert [s["table_versions"]["accepted"] for s in chain(layout, ids[-1])] == [0, 1, 2]
    assert not list((root / "catalog").glob("*/accepted.parquet"))
    assert migrate(str(root)) == []  # once
    # The last ingest removed one file of source a and added three: one commit, and the rows
    # it added are its own partition.
    uids = [set(zip(before[i][0]["source"], before[i][0]["key"], strict=True)) for i in ids]
    assert len(uids[1] - uids[2]) == 1 and len(uids[2] - uids[1]) == 3
    added = pd.concat(scan_view(layout, ids[2], "accepted", ["key"], after_seq=2))
    assert sorted(added["key"]) == ["new-0.jpg", "new-1.jpg", "new-2.jpg"]


def test_polars_and_duckdb_read_the_tables(migrated):
    import duckdb
    import polars as pl
    from deltalake import DeltaTable

    root, ids, _ = migrated
    acc = read_view(Layout(root), ids[-1])[0]
    path = str(table_path(Layout(root), "accepted"))
    frame = pl.read_delta(path)
    assert frame.height == len(acc)
    assert sorted(frame["key"].to_list()) == sorted(acc["key"])
    data = DeltaTable(path).to_pyarrow_dataset()  # noqa: F841 (DuckDB reads it by name)
    by = duckdb.sql("SELECT source, count(*) AS n FROM data GROUP BY source").fetchall()
    assert dict(by) == acc.groupby("source").size().to_dict()
    first = pl.read_delta(path, version=0)  # time travel from another engine
    assert first.height == len(read_view(Layout(root), ids[0])[0])


def test_show_sql_export_and_compact(migrated, tmp_path):
    root, ids, before = migrated
    acc, q, _ = before[ids[-1]]
    info = show(str(root))
    assert info["ingest_id"] == ids[-1] and info["table_versions"]["accepted"] == 2
    assert info["accepted_by_source"] == acc.groupby("source").size().to_dict()
    assert info["quarantined_by_reason"] == q.groupby("reason").size().to_dict()
    assert [h["version"] for h in info["history"]["accepted"]] == [2, 1, 0]
    assert info["rejects"] == {}, "not validated: nothing rejected"

    n = query(str(root), "SELECT count(*) AS n FROM clean").column("n")[0].as_py()
    assert n == len(acc)  # not validated: nothing rejected
    old = query(str(root), "SELECT count(*) AS n FROM accepted", version=0).column("n")[0]
    assert old.as_py() == len(before[ids[0]][0])
    with pytest.raises(ValueError, match="--version 9"):
        query(str(root), "SELECT 1", version=9)
    with pytest.raises(ValueError, match="catalog sql: .*nope"):
        query(str(root), "SELECT * FROM nope")
    with pytest.raises(ValueError, match="no catalog tables under .*run `kiln ingest` first"):
        query(str(tmp_path / "empty-root"), "SELECT 1")

    out = tmp_path / "clean.csv"
    assert export(str(root), str(out), "csv") == len(acc)
    assert sorted(pd.read_csv(out)["key"]) == sorted(acc["key"])
    assert export(str(root), str(tmp_path / "clean.parquet")) == len(acc)
    with pytest.raises(ValueError, match="--format must be parquet or csv, got 'xls'"):
        export(str(root), str(tmp_path / "x"), "xls")

    killed = root / "catalog" / "ing-killed.staging" / "accepted"  # an ingest killed mid-run
    killed.mkdir(parents=True)
    (killed / "part-000000.parquet").write_bytes(b"rows")
    done = compact(str(root), retain_hours=0)
    assert not killed.parent.exists(), "compaction removes a killed ingest's staged rows"
    # The removal rewrote source a's first file: with no horizon, the old copy goes.
    assert done["accepted"]["vacuumed"] >= 1
    layout = Layout(root)
    pd.testing.assert_frame_equal(_sorted(read_view(layout, ids[-1])[0]), _sorted(acc))
    with pytest.raises(FileNotFoundError, match="vacuumed"):
        read_view(layout, ids[0])
    with pytest.raises(ValueError, match=r"compact_retain_hours\) must be >= 0, got -1"):
        compact(str(root), retain_hours=-1)
    assert json.loads((root / "catalog" / ids[-1] / "summary.json").read_text())["table_versions"]


@pytest.mark.integration
def test_a_migrated_root_validates_and_sql_sees_the_verdict(migrated):
    from data_quality.verdict import read_verdict
    from kiln_config import QualityConfig
    from tasks.catalog.clean import read_clean
    from tasks.quality.validate import validate_catalog

    root, ids, _ = migrated
    res = validate_catalog.fn(
        str(root), ids[-1], QualityConfig(min_side=60, max_reject_fraction=0.9)
    )
    assert res.rejected_validate > 0  # the demo's small images
    verdict = read_verdict(Layout(root).catalog(ids[-1]))
    assert verdict["table_versions"] == {"accepted": 2, "quarantine": 2}
    clean = read_clean(str(root), ids[-1])
    got = query(str(root), "SELECT source, key FROM clean").to_pandas()
    assert sorted(zip(got["source"], got["key"], strict=True)) == sorted(
        zip(clean["source"], clean["key"], strict=True)
    )
    rejects = query(str(root), "SELECT count(*) AS n FROM rejects").column("n")[0].as_py()
    assert rejects == res.rejected_validate


@pytest.mark.integration
def test_kiln_catalog_commands(tmp_path, demo_src, make_config):
    import subprocess
    import sys

    root = tmp_path / "root"
    shutil.copytree(FIXTURE / "catalog", root / "catalog")
    cfg = make_config(tmp_path / "tiny.yaml", root, demo_src)

    def kiln(*args):
        return subprocess.run(
            [sys.executable, "-m", "kiln_cli", "catalog", *args, "--config", str(cfg)],
            capture_output=True,
            text=True,
            timeout=300,
        )

    refused = kiln("show")
    assert refused.returncode == 1 and "kiln catalog migrate" in refused.stderr
    assert "migrated 3 ingest(s)" in kiln("migrate").stdout
    assert "nothing to migrate" in kiln("migrate").stdout
    info = json.loads(kiln("show").stdout)
    assert info["table_versions"] == {"accepted": 2, "quarantine": 2}
    out = kiln("sql", "SELECT count(*) AS n FROM accepted", "--version", "0").stdout
    assert out.split() == ["n", "9"]  # source a's first ingest
    bad = kiln("sql", "SELECT nope FROM clean")
    assert bad.returncode == 1 and "nope" in bad.stderr and "Traceback" not in bad.stderr
    got = kiln("export", str(tmp_path / "clean.csv"), "--format", "csv")
    assert got.returncode == 0, got.stderr
    assert len(pd.read_csv(tmp_path / "clean.csv")) == sum(info["accepted_by_source"].values())


def test_vacuum_keeps_the_versions_a_registered_model_was_cut_from(migrated, tmp_path):
    from mlflow.tracking import MlflowClient

    from tasks.catalog.admin import registered_versions

    root, ids, before = migrated
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri, registry_uri=uri)
    client.create_registered_model("kiln-t2i")
    (tmp_path / "model").mkdir()
    client.create_model_version(
        "kiln-t2i", str(tmp_path / "model"), tags={"dataset_version": "ds-old"}
    )
    meta = Layout(root).shards("ds-old") / "shards.json"
    meta.parent.mkdir(parents=True)
    meta.write_text(json.dumps({"catalog_versions": {"accepted": 0, "quarantine": 0}}))
    keep = registered_versions(str(root), uri, "kiln-t2i")
    assert keep == {"accepted": 0, "quarantine": 0}
    done = compact(str(root), retain_hours=0, keep=keep)
    assert done["accepted"]["vacuumed"] == 0 and done["accepted"]["retain_hours"] >= 1
    old = read_view(Layout(root), ids[0])[0]  # the registered model's rows still read back
    pd.testing.assert_frame_equal(_sorted(old), _sorted(before[ids[0]][0]))
