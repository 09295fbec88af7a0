import pandas as pd
import pytest

from data_quality.rules import QualityConfig
from tasks.ingest import ingest_source
from tasks.quality import QualityGateError, validate_catalog


def test_validate_quarantines_planted_items(tmp_path, demo_src):
    root = tmp_path / "root"
    ing = ingest_source(str(demo_src), str(root), workers=1)
    res = validate_catalog.fn(
        str(root), ing.ingest_id, QualityConfig(min_side=32, max_reject_fraction=0.25)
    )
    q = pd.read_parquet(root / "catalog" / ing.ingest_id / "quarantine.parquet")
    reasons = dict(zip(q["key"], q["reason"], strict=True))
    assert reasons["bad-no-caption.jpg"] == "caption_blank"
    assert reasons["bad-duplicate.jpg"] == "duplicate_sha256"
    assert "00000.jpg" not in reasons, "the original of a duplicate stays"
    assert res.clean + len(q) == res.listed == 60
    assert res.reasons["too_small"] >= 1
    # Re-running replaces the validate rows instead of appending them again.
    validate_catalog.fn(
        str(root), ing.ingest_id, QualityConfig(min_side=32, max_reject_fraction=0.25)
    )
    assert len(pd.read_parquet(root / "catalog" / ing.ingest_id / "quarantine.parquet")) == len(q)


def test_gate_fails_with_a_reason_table_and_keeps_the_quarantine(tmp_path, demo_src):
    root = tmp_path / "root"
    ing = ingest_source(str(demo_src), str(root), workers=1)
    with pytest.raises(QualityGateError) as e:
        validate_catalog.fn(
            str(root), ing.ingest_id, QualityConfig(min_side=100, max_reject_fraction=0.1)
        )
    msg = str(e.value)
    assert "quality.max_reject_fraction" in msg and "| `too_small` |" in msg
    assert (root / "quality" / ing.ingest_id / "summary.json").is_file()
    q = pd.read_parquet(root / "catalog" / ing.ingest_id / "quarantine.parquet")
    assert (q["reason"] == "too_small").sum() > 10
