import json

import pandas as pd
import pytest

from data_quality.rules import QualityConfig
from flows.config import IngestConfig
from tasks.catalog_view import read_view
from tasks.ingest import ingest_source
from tasks.layout import Layout
from tasks.quality import QualityGateError, read_clean, validate_catalog

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
        str(root), ing.ingest_id, QualityConfig(min_side=100, max_reject_fraction=0.1),
        allow_failed_gate=True,
    )  # fmt: skip
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
    from flows.demo_data import write_demo_dataset

    src, root = tmp_path / "src", tmp_path / "root"
    write_demo_dataset(src, n=20, seed=1)
    first = ingest_source(IngestConfig(source=str(src), workers=2), str(root))
    assert first.new_items == 20 and not first.reused

    again = ingest_source(IngestConfig(source=str(src), workers=2), str(root))
    assert again.reused and again.new_items == 0 and again.ingest_id == first.ingest_id
    assert {p.name for p in (root / "catalog").iterdir()} == {first.ingest_id, "LATEST"}

    _add_images(src, [f"new-{i:02d}.jpg" for i in range(10)])
    third = ingest_source(IngestConfig(source=str(src), workers=2), str(root))
    assert (third.new_items, third.unchanged_items, third.removed_items) == (10, 20, 0)
    delta = pd.read_parquet(root / "catalog" / third.ingest_id / "accepted.parquet")
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
