import pandas as pd
import pytest

from data_quality.suite import run_suite
from kiln_config import QualityConfig


def _catalog(**cols) -> pd.DataFrame:
    n = len(cols["key"])
    base = {
        "source": ["/src"] * n,
        "caption": ["a photo"] * n,
        "width": [64] * n,
        "height": [64] * n,
        "sha256": [str(i) for i in range(n)],
        # Far-apart hashes, so that nothing is a near-duplicate unless a test says so.
        "phash": [f"{(0x9E3779B97F4A7C15 * (i + 1)) % 2**64:016x}" for i in range(n)],
        "ingest_seq": [1] * n,
    }
    return pd.DataFrame({**base, **cols})


def test_suite_flags_each_failure_with_a_reason(tmp_path):
    df = _catalog(
        key=["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k"],
        caption=[
            "ok",
            "  ",
            None,
            "small",
            "dup",
            "dup",
            "x" * 50,
            "日本語の説明文",
            "wide",
            "unlicensed",
            "ugly",
        ],
        width=[64, 64, 64, 20, 64, 64, 64, 64, 400, 64, 64],
        sha256=["1", "2", "3", "4", "5", "5", "7", "8", "9", "10", "11"],
        license=["cc0", "cc0", "cc0", "cc0", "cc0", "cc0", "cc0", "cc0", "cc0", None, "cc0"],
        aesthetic=[6.0, 6.0, 6.0, 6.0, 6.0, 6.0, 6.0, 6.0, 6.0, 6.0, 3.2],
        ingest_seq=[1, 1, 1, 1, 2, 1, 1, 1, 1, 1, 1],
    )
    rules = QualityConfig(
        min_side=32, max_caption_chars=40, allowed_licenses=["cc0"], min_aesthetic=4.5
    )
    v = run_suite(df, rules, docs_dir=tmp_path / "docs")
    got = dict(zip(v.rejected["key"], v.rejected["reason"], strict=True))
    assert got == {
        "b": "caption_blank",
        "c": "caption_missing",
        "d": "too_small",
        "e": "duplicate_sha256",  # f was ingested earlier (seq 1 < 2), so f is kept
        "g": "caption_too_long",
        "h": "caption_not_ascii",
        "i": "extreme_aspect",
        "j": "license_not_allowed",
        "k": "low_aesthetic",
    }
    assert list(v.clean["key"]) == ["a", "f"]
    assert "same sha256 as /src/f" in v.rejected.set_index("key").loc["e", "detail"]
    assert v.docs_index and (tmp_path / "docs" / "index.html").is_file()
    assert list((tmp_path / "docs" / "validations").rglob("*.html")), "validation page built"


def test_optional_checks_are_off_by_default_and_configurable():
    df = _catalog(key=["a", "b"], caption=["日本語の説明文", "ok"])
    assert run_suite(df, QualityConfig(min_ascii_ratio=None)).rejected.empty
    with pytest.raises(ValueError, match="no 'license' column"):
        run_suite(df, QualityConfig(allowed_licenses=["cc0"]))
    # min_aesthetic without the column is skipped, not an error
    assert len(run_suite(df, QualityConfig(min_aesthetic=4.5, min_ascii_ratio=None)).clean) == 2


def test_near_duplicates_are_flagged_or_dropped():
    h = "f0f0f0f0f0f0f0f0"
    near = "f0f0f0f0f0f0f0f3"  # 2 bits away
    far = "0f0f0f0f0f0f0f0f"
    df = _catalog(key=["a", "b", "c", "d"], phash=[h, near, far, h], sha256=["1", "2", "3", "1"])
    flagged = run_suite(df, QualityConfig(near_duplicate_distance=4))
    assert flagged.near_duplicates == 1
    assert flagged.clean.set_index("key").loc["b", "near_duplicate_of"] == "/src/a"
    assert set(flagged.rejected["reason"]) == {"duplicate_sha256"}  # d is an exact copy
    dropped = run_suite(df, QualityConfig(near_duplicate_distance=4, drop_near_duplicates=True))
    assert dict(zip(dropped.rejected["key"], dropped.rejected["reason"], strict=True)) == {
        "b": "near_duplicate",
        "d": "duplicate_sha256",
    }
    strict = run_suite(df, QualityConfig(near_duplicate_distance=1, drop_near_duplicates=True))
    assert "b" in set(strict.clean["key"])


def test_suite_on_empty_and_malformed_catalogs():
    ok = _catalog(key=["a"])
    assert run_suite(ok.iloc[:0], QualityConfig()).clean.empty
    with pytest.raises(ValueError, match="missing columns"):
        run_suite(ok.drop(columns=["sha256"]), QualityConfig())
