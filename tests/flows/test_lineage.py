"""Licensed data, traced: the lineage of an image and of a registered model, contributors'
draws, takedowns and ended licenses (real flow runs, a real `accelerate launch`, a real
sqlite registry, the real `kiln` commands)."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner
from mlflow.tracking import MlflowClient

from flows.ingest import ingest_flow
from flows.pipeline import kiln_pipeline
from flows.promote import promote_flow
from flows.register import register_flow
from flows.shard import shard_flow
from flows.train import train_flow
from flows.validate import validate_flow
from kiln_cli.main import main
from kiln_config import load_config
from kiln_demo.data import licensing
from tasks.catalog.clean import read_clean
from tasks.catalog.dataset_lineage import REPORT_ARTIFACT, dataset_rows
from tasks.registry.promotion import PromotionRefused

from .test_run_config import ONE_STAGE

pytestmark = pytest.mark.integration


def _kiln(*args: str) -> str:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def _contributor(key: str) -> str:
    """What the demo set wrote for this file (kiln_demo/data.py), independent of Kiln."""
    return licensing(int(key[:5]))["contributor"]


def _quarantine(root: Path, ingest_id: str) -> pd.DataFrame:
    return pd.read_parquet(root / "quality" / ingest_id / "quarantine.parquet")


def test_lineage_takedown_and_promotion_through_the_commands(
    tmp_path, tiny_shards, demo_src, make_config
):
    _, shared, _ = tiny_shards
    root = tmp_path / "root"
    root.mkdir()
    (shared / "vae").mkdir(exist_ok=True)
    (root / "vae").symlink_to(shared / "vae")  # the tiny preset's VAE, fitted once per session
    cfg = str(make_config(tmp_path / "tiny.yaml", root, demo_src, **ONE_STAGE))
    loaded = load_config(cfg)  # the flows take the loaded config; the commands its path
    ingest_id = ingest_flow(loaded)["ingest_id"]
    validate_flow(loaded)
    version = shard_flow(loaded)["dataset_version"]
    run = train_flow(loaded, dataset_version=version)
    v1 = register_flow(loaded, run_id=run["run_id"])
    assert v1["licensing"]["report"] == REPORT_ARTIFACT

    # The model's lineage: its rows, and each contributor's draws equal to what was drawn.
    out = _kiln(
        "lineage",
        "model",
        f"models:/kiln-t2i/{v1['version']}",
        "--config",
        cfg,
        "--csv",
        str(tmp_path / "share.csv"),
    )
    assert f"dataset version {version}" in out and "(candidate)" in out
    rows = dataset_rows(root, version)
    assert set(rows["key"]) == set(read_clean(str(root), ingest_id)["key"])
    assert "ada-studio" in out and "licensed" in out
    drawn = [
        k
        for line in (root / "runs" / run["run_id"] / "stage-32" / "samples-rank0.jsonl")
        .read_text()
        .splitlines()
        for k in json.loads(line)["keys"]
    ]
    assert len(drawn) == 2 * 4, "2 steps of 4 images on one process"
    expected = Counter(_contributor(k) for k in drawn)
    share = pd.read_csv(tmp_path / "share.csv").set_index("contributor")
    assert share["draws_32"].to_dict() == {c: expected.get(c, 0) for c in share.index}
    assert share["draws_total"].sum() == 8 and abs(share["share"].sum() - 1) < 1e-6
    assert share["images"].sum() == len(rows)
    ends = {licensing(int(k[:5]))["license_end"] for k in rows["key"]} - {None}
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    mv = client.get_model_version("kiln-t2i", v1["version"])
    assert mv.tags["kiln.earliest_license_end"] == min(ends)
    assert "Contributors' report" in mv.description and REPORT_ARTIFACT in mv.description
    logged = [a.path for a in client.list_artifacts(mv.run_id, "lineage")]
    assert logged == [REPORT_ARTIFACT]

    # The lineage of one image: its dataset version, the run and the registered version.
    key = drawn[0]
    out = _kiln("lineage", "image", key, "--config", cfg)
    assert version in out and run["run_id"] in out and f"{v1['version']} (candidate)" in out
    with pytest.raises(AssertionError, match="no catalog row"):
        _kiln("lineage", "image", "no-such-image.jpg", "--config", cfg)

    # A takedown: appended with who, when and why; the version is tagged; a retrain is due.
    out = _kiln(
        "takedown",
        "add",
        "--key",
        key,
        "--reason",
        "contract ended",
        "--by",
        "legal",
        "--config",
        cfg,
    )
    added = json.loads(out)
    assert added["images"] == 1 and added["tagged_versions"] == {v1["version"]: 1}
    assert added["retrain_due"] and added["taken_down_since_training"] == 1
    listed = _kiln("takedown", "list", "--config", cfg)
    assert key in listed and "contract ended" in listed and "legal" in listed
    tags = client.get_model_version("kiln-t2i", v1["version"]).tags
    assert tags["kiln.takedown.images"] == "1"
    # The next standalone ingest's event asks for the retrain, though no image is new.
    fresh = ingest_flow(loaded)["new_data"]
    assert fresh["new_since_training"] == 0 and fresh["retrain_due"]

    # The next validate quarantines it, whatever else it passes; then a whole contributor.
    result = validate_flow(loaded)
    assert result["takedowns"] == 1 and result["reasons"]["takedown"] == 1
    q = _quarantine(root, result["ingest_id"])
    assert q[q["reason"] == "takedown"]["key"].tolist() == [key]
    _kiln("takedown", "add", "--contributor", "cy-shoots", "--reason", "withdrawn", "--config", cfg)
    result = validate_flow(loaded)
    q = _quarantine(root, result["ingest_id"])
    gone = set(q[q["reason"] == "takedown"]["key"])
    meta = {
        r["file_name"]: r["contributor"]
        for r in map(json.loads, (demo_src / "metadata.jsonl").read_text().splitlines())
    }
    cy = {k for k in rows["key"] if _contributor(k) == "cy-shoots"}
    # Every accepted row of the contributor, the suite's rejects too (now under `takedown`).
    assert cy | {key} <= gone and {meta[k] for k in gone - {key}} == {"cy-shoots"}
    assert not gone & set(read_clean(str(root), result["ingest_id"])["key"])
    assert result["passed"], "takedowns are not counted against the quality gate's limit"

    # A file of keys, by key or by <source>/<key> path.
    more = sorted(k for k in rows["key"] if _contributor(k) == "ada-studio" and k != key)[:2]
    (tmp_path / "keys.csv").write_text(f"key\n{more[0]}\n{demo_src}/{more[1]}\n")
    added = json.loads(
        _kiln(
            "takedown",
            "add",
            "--file",
            str(tmp_path / "keys.csv"),
            "--reason",
            "court order",
            "--config",
            cfg,
        )
    )
    assert added["images"] == 2 and added["tagged_versions"] == {v1["version"]: len(cy | {key}) + 2}
    assert _kiln("takedown", "list", "--config", cfg).count("court order") == 2

    # Promotion refuses the version that saw a taken-down image, unless told why.
    ref = f"models:/kiln-t2i/{v1['version']}"
    with pytest.raises(PromotionRefused, match="taken-down"):
        promote_flow(loaded, candidate=ref, first=True)
    done = promote_flow(
        loaded,
        candidate=ref,
        first=True,
        allow_takedown=True,
        reason="interim release approved by legal",
    )
    assert done["outcome"] == "first"
    tags = client.get_model_version("kiln-t2i", v1["version"]).tags
    assert tags["kiln.promotion.takedown_override"] == "interim release approved by legal"
    assert tags["kiln.takedown.images"] == str(len(cy | {key}) + 2)

    # The retrain the takedown made due trains, though no image is new, on a dataset without
    # the taken-down images; the image's lineage still names the old version only.
    retrained = kiln_pipeline(loaded, only_new_data=True)
    assert "skipped" not in retrained
    new_rows = dataset_rows(root, retrained["shards"]["dataset_version"])
    assert not set(new_rows["key"]) & (cy | {key} | set(more)) and len(new_rows)
    v2 = retrained["model"]["version"]
    assert "kiln.takedown.images" not in client.get_model_version("kiln-t2i", v2).tags
    out = _kiln("lineage", "image", key, "--config", cfg)
    assert f"image {key}: in 1 dataset version(s)" in out and version in out


def test_an_ended_license_is_quarantined(tmp_path, demo_src, make_config):
    """Rows whose license ended by validation time (or whose end is not a date) are
    quarantined; the validate step's artifact counts them; the gate's limit does not."""
    src = tmp_path / "src"
    shutil.copytree(demo_src, src)
    lines = [json.loads(x) for x in (src / "metadata.jsonl").read_text().splitlines()]
    ended = {"00001.jpg", "00002.jpg", "00005.jpg"}
    for r in lines:
        if r["file_name"] in ended:
            r["license_end"] = "2021-01-31"
        if r["file_name"] == "00003.jpg":
            r["license_end"] = "end of next year"
    (src / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    cfg = load_config(make_config(tmp_path / "tiny.yaml", tmp_path / "root", src))
    ingest_flow(cfg)
    result = validate_flow(cfg)
    assert result["license_expired"] == 4 and result["takedowns"] == 0
    q = _quarantine(tmp_path / "root", result["ingest_id"])
    files = q[q["step"] != "ingest-manifest"]
    assert result["reject_fraction"] == round((len(files) - 4) / result["listed"], 4)
    by_reason = q.groupby("reason")["key"].apply(set).to_dict()
    assert by_reason["license_expired"] == ended
    assert by_reason["license_end_invalid"] == {"00003.jpg"}
    detail = q[q["key"] == "00001.jpg"]["detail"].iloc[0]
    assert "license_end='2021-01-31'" in detail
    from tasks.reports import quality_report

    summary = json.loads(
        (tmp_path / "root" / "quality" / result["ingest_id"] / "summary.json").read_text()
    )
    assert "0 rows on the takedown list, 4 with an ended" in quality_report(summary)
