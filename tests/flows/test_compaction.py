"""Compaction after every N ingests (`ingest.compact_every`): real ingest flow runs into real
Delta tables, validated between ingests as a team's nightly runs are."""

from __future__ import annotations

import pandas as pd
import pytest
from deltalake import DeltaTable

from flows.ingest import ingest_flow
from kiln_config import load_config
from tasks.catalog.admin import compact, query
from tasks.catalog.clean import read_clean
from tasks.catalog.view import read_view, table_path
from tasks.quality.validate import validate_catalog
from tasks.storage.layout import Layout
from tests.flows.artifacts import run_artifacts

pytestmark = pytest.mark.integration

TABLES = ("accepted", "quarantine", "rejects", "flags")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Three small demo sources (8 files each, 3 of them bad), one per ingest."""
    from kiln_demo.data import write_demo_dataset

    base = tmp_path_factory.mktemp("compact-sources")
    for i, name in enumerate("abc"):
        write_demo_dataset(base / name, n=8, seed=i)
    return [base / name for name in "abc"]


def _ingest_and_validate(tmp_path, make_config, root, src, validate=True, **settings):
    """One ingest flow run of `src` into `root` (then validate it); the flow's result, with
    its `ingest-summary` artifact as `artifact`."""
    path = make_config(
        tmp_path / f"{root.name}.yaml",
        root,
        src,
        **{"quality.max_reject_fraction": 0.9, **settings},
    )
    cfg = load_config(path)
    state = ingest_flow(cfg, return_state=True)
    got = {**state.result(), "artifact": run_artifacts("ingest-summary", state)[0].data}
    if validate and not got["reused"]:
        validate_catalog.fn(str(root), got["ingest_id"], cfg.quality)
    return got


def _operations(root, table: str) -> list[str]:
    path = table_path(Layout(root), table)
    return (
        [h["operation"] for h in DeltaTable(str(path)).history()][::-1]
        if (path / "_delta_log").is_dir()
        else []
    )


def _files(root, table: str) -> int:
    return len(DeltaTable(str(table_path(Layout(root), table))).file_uris())


def _sorted(df: pd.DataFrame) -> pd.DataFrame:
    out = df[sorted(df.columns)].sort_values(["source", "key"], kind="stable")
    out = out.reset_index(drop=True)
    return out.astype(object).where(out.notna(), None)


def test_every_third_ingest_compacts_and_the_view_reads_the_same_rows(
    tmp_path, make_config, sources
):
    on, off = tmp_path / "every-3", tmp_path / "never"
    every = {"ingest.compact_every": 3, "ingest.compact_retain_hours": 0}
    runs = {on: [], off: []}
    for src in sources:
        for root, settings in ((on, every), (off, {"ingest.compact_every": 0})):
            runs[root].append(_ingest_and_validate(tmp_path, make_config, root, src, **settings))
        if src != sources[-1]:
            assert runs[on][-1]["compaction"] is None  # ingest_seq 1 and 2: not due
    # Each validate added a file to the unpartitioned verdict tables: two before the third
    # ingest, which merged them (and vacuumed the two, older than the 0 h horizon).
    third = runs[on][-1]["compaction"]
    assert third["ingest_seq"] == 3 and "error" not in third
    assert third["tables"]["rejects"]["files_removed"] == 2
    assert third["tables"]["rejects"]["files_added"] == 1
    assert third["tables"]["rejects"]["vacuumed"] == 2
    assert third["tables"]["rejects"]["vacuumed_bytes"] > 0
    assert "OPTIMIZE" in _operations(on, "rejects")
    assert "### Catalog compaction (ingest_seq 3)" in runs[on][-1]["artifact"]
    assert "| rejects | 2 (" in runs[on][-1]["artifact"]  # files merged, with their bytes
    assert not any("Catalog compaction" in r["artifact"] for r in runs[on][:2] + runs[off])
    for table in TABLES:  # a setting of 0 never compacts
        assert not {"OPTIMIZE", "VACUUM START"} & set(_operations(off, table)), table

    ids = [r["ingest_id"] for r in runs[on]]
    assert ids == [r["ingest_id"] for r in runs[off]]
    for a, b in zip(
        read_view(Layout(on), ids[-1])[:2], read_view(Layout(off), ids[-1])[:2], strict=True
    ):
        pd.testing.assert_frame_equal(_sorted(a), _sorted(b))
    assert len(read_view(Layout(on), ids[-1])[0]) == 15  # 5 good files a source

    # A re-run over an unchanged source commits nothing: no compaction, though its
    # ingest_seq (3) is still due.
    history = {t: _operations(on, t) for t in TABLES}
    again = _ingest_and_validate(tmp_path, make_config, on, sources[-1], **every)
    assert again["reused"] and again["compaction"] is None
    assert {t: _operations(on, t) for t in TABLES} == history

    # A verdict read back after a later compaction: `clean` resolves the verdict's table
    # version past the OPTIMIZE whose files replaced the ones it named.
    compact(str(on), retain_hours=0)
    clean = read_clean(str(on), ids[-1])
    n = query(str(on), "SELECT count(*) AS n FROM clean").column("n")[0].as_py()
    assert n == len(clean) == len(read_clean(str(off), ids[-1]))


def test_a_failed_compaction_keeps_the_ingest(tmp_path, make_config, sources, caplog):
    root = tmp_path / "root"
    every = {"ingest.compact_every": 1}
    first = _ingest_and_validate(tmp_path, make_config, root, sources[0], **every)
    assert first["compaction"]["ingest_seq"] == 1 and "error" not in first["compaction"]
    # A verdict table whose log cannot be read: the ingest never touches it, compaction does.
    log = table_path(Layout(root), "rejects") / "_delta_log" / "00000000000000000000.json"
    log.write_text("{not a commit")
    path = make_config(tmp_path / "second.yaml", root, sources[1], **every)
    state = ingest_flow(load_config(path), return_state=True)
    assert state.is_completed()
    assert "Failed, the ingest is committed: `RuntimeError: compacting catalog table rejects" in (
        run_artifacts("ingest-summary", state)[0].data
    )
    second = state.result()
    assert second["compaction"]["ingest_seq"] == 2 and not second["reused"]
    error = second["compaction"]["error"]
    assert "tables" not in second["compaction"], error
    assert error.startswith("RuntimeError: compacting catalog table rejects at ") and (
        "Json error" in error and "\n" not in error
    )
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("compaction after ingest" in m and "the ingest is committed" in m for m in warned), (
        warned
    )
    acc = read_view(Layout(root), second["ingest_id"])[0]
    assert sorted(set(acc["source"])) == sorted(str(s) for s in sources[:2])
    assert len(acc) == 10


def test_kiln_catalog_compact_defaults_to_the_configs_horizon(tmp_path, make_config, sources):
    import json
    import subprocess
    import sys

    root = tmp_path / "root"
    settings = {"ingest.compact_every": 0, "ingest.compact_retain_hours": 0}
    _ingest_and_validate(tmp_path, make_config, root, sources[0], validate=False, **settings)
    cfg = tmp_path / f"{root.name}.yaml"

    def kiln(*args):
        got = subprocess.run(
            [
                sys.executable,
                "-m",
                "kiln_cli",
                "catalog",
                "compact",
                "--config",
                str(cfg),
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert got.returncode == 0, got.stderr
        return json.loads(got.stdout)

    assert kiln()["accepted"]["retain_hours"] == 0
    assert kiln("--retain-hours", "5")["accepted"]["retain_hours"] == 5
