"""The licensing terms on rows: takedowns (by image, by contributor) and license ends."""

from datetime import date

import pandas as pd

from data_quality.terms import Takedowns, check_terms
from kiln_config import QualityConfig


def test_takedown_wins_then_an_unreadable_end_then_an_ended_license():
    df = pd.DataFrame(
        {
            "source": ["s", "s", "s", "s", "s", "s", "t", "s"],
            "key": ["a", "b", "c", "d", "e", "f", "b", "g"],
            "contributor": ["x", "y", "z", None, "y", "q", "y", "q"],
            "license_end": [
                "2020-01-01",
                "2030-01-01",
                "2010-01-01",
                "junk",
                "2026-11-26",
                "2026-11-25T23:00:00",
                None,
                "2026-13-45",
            ],
        }
    )
    down = Takedowns(images=frozenset({("s", "b")}), contributors=frozenset({"z"}))
    got = check_terms(df, QualityConfig(), down, date(2026, 11, 26)).set_index("key")
    assert got["reason"].to_dict() == {
        "a": "license_expired",  # ended years ago
        "b": "takedown",  # this image (of source s only: t's b stays)
        "c": "takedown",  # its contributor; ended too, the takedown wins
        "d": "license_end_invalid",
        "e": "license_expired",  # ends on the validation date
        "f": "license_expired",  # a timestamp the day before
        "g": "license_end_invalid",  # not a calendar date
    }
    assert got.loc["d", "detail"] == "license_end='junk' is not an ISO date"


def test_without_the_columns_or_a_list_nothing_is_quarantined():
    df = pd.DataFrame({"source": ["s"], "key": ["a"]})
    assert not len(check_terms(df, QualityConfig(), Takedowns(), date(2026, 11, 26)))
    rules = QualityConfig(license_end_column="ends", contributor_column="who")
    df = df.assign(ends=["2040-01-01"], who=["x"])
    down = Takedowns(contributors=frozenset({"x"}))
    assert check_terms(df, rules, down, date(2026, 11, 26))["reason"].tolist() == ["takedown"]
