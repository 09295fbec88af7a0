import pandas as pd
import pytest

from data_quality.suite import run_suite


def test_suite_flags_each_failure_with_a_reason():
    df = pd.DataFrame(
        {
            "key": ["a", "b", "c", "d", "e", "f"],
            "caption": ["ok", "  ", None, "small", "dup", "dup"],
            "width": [64, 64, 64, 20, 64, 64],
            "height": [64, 64, 64, 64, 64, 64],
            "sha256": ["1", "2", "3", "4", "5", "5"],
        }
    )
    v = run_suite(df, min_side=32)
    got = dict(zip(v.rejected["key"], v.rejected["reason"], strict=True))
    assert got == {
        "b": "caption_blank",
        "c": "caption_missing",
        "d": "too_small",
        "f": "duplicate_sha256",
    }
    assert list(v.clean["key"]) == ["a", "e"], "the first copy of a duplicate is kept"
    assert "same sha256 as e" in v.rejected.set_index("key").loc["f", "detail"]
    assert {e["reason"]: e["unexpected"] for e in v.expectations} == {
        "caption_missing": 1, "caption_blank": 1, "too_small": 1, "duplicate_sha256": 1,
    }  # fmt: skip


def test_suite_on_clean_and_empty_catalogs():
    ok = pd.DataFrame(
        {"key": ["a"], "caption": ["x"], "width": [40], "height": [50], "sha256": ["1"]}
    )
    assert run_suite(ok, min_side=32).rejected.empty
    assert run_suite(ok.iloc[:0], min_side=32).clean.empty
    with pytest.raises(ValueError, match="missing columns"):
        run_suite(ok.drop(columns=["sha256"]), min_side=32)
