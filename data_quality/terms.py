"""Licensing terms: the rows that a takedown or an ended license removes from training.

Unlike the suite's rules, these depend on things outside the row (the takedown list, the date
of validation), so the validate step applies them to every row of the view at every run,
after the suite, and they win over whatever reason the suite gave a row: a taken-down image
is quarantined as `takedown` whatever else it passes or fails. The order of precedence is
`takedown`, `license_end_invalid`, `license_expired`.

A license end is an ISO date (`2031-12-31`) or timestamp; it ends at the start of that day
(UTC): a row whose license ends on the validation date is quarantined that day. A null end
means the license does not end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import date
from functools import cached_property

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from kiln_config import QualityConfig

__all__ = ["TERMS_COLUMNS", "Takedowns", "check_terms", "license_ends"]

TERMS_COLUMNS = ["source", "key"]  # plus the config's contributor and license end columns


@dataclass(frozen=True)
class Takedowns:
    """What the takedown list removes: (source, key) pairs and whole contributors."""

    images: frozenset[tuple[str, str]] = field(default_factory=frozenset)
    contributors: frozenset[str] = field(default_factory=frozenset)

    def __bool__(self) -> bool:
        return bool(self.images or self.contributors)

    @cached_property
    def _keys(self) -> pa.Array:
        return pa.array(sorted({k for _, k in self.images}), pa.string())

    @cached_property
    def _contributors(self) -> pa.Array:
        return pa.array(sorted(self.contributors), pa.string())

    def mask(self, df: pd.DataFrame, contributor_column: str) -> np.ndarray:
        """Which rows of `df` (with source, key and, if present, the contributor) are taken
        down."""
        hit = np.zeros(len(df), bool)
        if self.images and len(df):
            # By key first (Arrow's hash lookup), then the few candidates' sources.
            keys = _strings(df["key"])
            cand = np.flatnonzero(pc.is_in(keys, value_set=self._keys).to_numpy(False))
            src = _strings(df["source"]).take(pa.array(cand)).to_pylist()
            hit[cand] = [
                (a, b) in self.images
                for a, b in zip(src, keys.take(pa.array(cand)).to_pylist(), strict=True)
            ]
        if self.contributors and contributor_column in df.columns and len(df):
            who = pc.is_in(_strings(df[contributor_column]), value_set=self._contributors)
            hit |= pc.fill_null(who, False).to_numpy(False)
        return hit


def _strings(col: pd.Series) -> pa.Array:
    return pa.array(col, pa.string(), from_pandas=True)


def license_ends(col: pd.Series) -> tuple[pd.Series, np.ndarray]:
    """(the ends as UTC timestamps, NaT where null or unparsable; which values are present but
    not a date)."""
    text = _strings(col)
    # Arrow parses the plain date format in C; only what it misses goes to pandas' ISO 8601.
    days = pc.strptime(text, format="%Y-%m-%d", unit="s", error_is_null=True)
    parsed = pd.Series(days.to_pandas(), index=col.index).dt.tz_localize("UTC")
    rest = pc.is_valid(text).to_numpy(False) & parsed.isna().to_numpy()
    if rest.any():
        parsed[rest] = pd.to_datetime(
            col[rest].astype(object), errors="coerce", utc=True, format="ISO8601"
        )
    invalid = pc.is_valid(text).to_numpy(False) & parsed.isna().to_numpy()
    return parsed, invalid


def check_terms(
    df: pd.DataFrame, rules: QualityConfig, takedowns: Takedowns, today: date
) -> pd.DataFrame:
    """The rows of `df` that the terms quarantine: source, key, reason, detail.

    Args:
        df: Rows with `source`, `key` and, when the catalog has them, the contributor and
            license end columns of `rules`.
        rules: Which columns hold the contributor and the license end.
        takedowns: The takedown list, read once per validate.
        today: The validation date: licenses ending on or before it have ended.
    """
    cols = ["source", "key", "reason", "detail"]
    if not len(df):
        return pd.DataFrame(columns=cols)
    reason = np.full(len(df), None, dtype=object)
    detail = np.full(len(df), None, dtype=object)
    end_col = rules.license_end_column
    if end_col in df.columns:
        ends, invalid = license_ends(df[end_col])
        cutoff = pd.Timestamp(today, tz="UTC")
        expired = (ends <= cutoff).fillna(False).to_numpy(bool)
        raw = df[end_col].astype(str).to_numpy(object)
        reason[expired] = "license_expired"
        detail[expired] = [f"{end_col}={v!r} <= {today.isoformat()}" for v in raw[expired]]
        reason[invalid] = "license_end_invalid"
        detail[invalid] = [f"{end_col}={v!r} is not an ISO date" for v in raw[invalid]]
    down = takedowns.mask(df, rules.contributor_column)
    reason[down] = "takedown"
    detail[down] = "on the takedown list"
    hit = np.flatnonzero(reason != None)  # noqa: E711 (element-wise on an object array)
    return pd.DataFrame(
        {
            "source": df["source"].to_numpy(object)[hit],
            "key": df["key"].to_numpy(object)[hit],
            "reason": reason[hit],
            "detail": detail[hit],
        },
        columns=cols,
    )
