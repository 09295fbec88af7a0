"""The catalog's Great Expectations suite, built in code, and the row-level verdicts from it.

The suite runs with `result_format="COMPLETE"` and `unexpected_index_column_names=["key"]`,
so every failing row is identified by its key and can be quarantined with a reason code.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pandas as pd

__all__ = ["REASONS", "QualityVerdict", "build_suite", "run_suite"]

log = logging.getLogger(__name__)

# Reason code per expectation (the code lands in quarantine.parquet's `reason` column).
REASONS = {
    "caption_missing": "caption is null (no manifest row, or the row had no caption)",
    "caption_blank": "caption is empty or whitespace only",
    "too_small": "short side below quality.min_side",
    "duplicate_sha256": "exact byte duplicate of an earlier file (first key kept)",
}


@dataclass
class QualityVerdict:
    """Outcome of the suite on one catalog."""

    clean: pd.DataFrame
    rejected: pd.DataFrame  # key, reason, detail
    expectations: list[dict]  # one summary per expectation: type, column, success, unexpected


def build_suite(min_side: int):
    """The catalog suite: caption present and non-blank, short side >= min_side, sha256 unique."""
    import great_expectations as gx

    e = gx.expectations
    suite = gx.ExpectationSuite(name="kiln_catalog")
    suite.add_expectation(
        e.ExpectColumnValuesToNotBeNull(column="caption", meta={"reason": "caption_missing"})
    )
    suite.add_expectation(
        e.ExpectColumnValuesToMatchRegex(
            column="caption", regex=r"\S", meta={"reason": "caption_blank"}
        )
    )
    suite.add_expectation(
        e.ExpectColumnValuesToBeBetween(
            column="short_side", min_value=min_side, meta={"reason": "too_small"}
        )
    )
    suite.add_expectation(
        e.ExpectColumnValuesToBeUnique(column="sha256", meta={"reason": "duplicate_sha256"})
    )
    return suite


def run_suite(catalog: pd.DataFrame, min_side: int) -> QualityVerdict:
    """Validate `catalog` (accepted rows from ingest) and split it into clean and rejected rows.

    A row failing several expectations is quarantined once, under the first reason in
    suite order. For duplicates the lexicographically first key of each sha256 is kept.
    """
    import great_expectations as gx

    required = {"key", "caption", "width", "height", "sha256"}
    missing = required - set(catalog.columns)
    if missing:
        raise ValueError(
            f"catalog is missing columns {sorted(missing)}; got {list(catalog.columns)}"
        )
    df = catalog.copy()
    df["short_side"] = df[["width", "height"]].min(axis=1)
    df = df.sort_values("key").reset_index(drop=True)

    rejected: dict[str, tuple[str, str]] = {}
    summaries: list[dict] = []
    if len(df):
        ctx = gx.get_context(mode="ephemeral")
        ctx.variables.progress_bars = {"globally": False}
        asset = ctx.data_sources.add_pandas("kiln").add_dataframe_asset("catalog")
        batch = asset.add_batch_definition_whole_dataframe("all").get_batch(
            batch_parameters={"dataframe": df}
        )
        suite = ctx.suites.add(build_suite(min_side))
        result = batch.validate(
            suite,
            result_format={"result_format": "COMPLETE", "unexpected_index_column_names": ["key"]},
        )
        for r in result.results:
            cfg = r.expectation_config
            reason = cfg.meta["reason"]
            column = cfg.kwargs["column"]
            bad = [row["key"] for row in r.result.get("unexpected_index_list") or []]
            if reason == "duplicate_sha256":
                # GX flags every copy; keep the first key of each hash.
                first = df.groupby("sha256")["key"].min()
                keep = set(first.values)
                sha_of = dict(zip(df["key"], df["sha256"], strict=True))
                bad = [k for k in bad if k not in keep]
                details = {k: f"same sha256 as {first[sha_of[k]]}" for k in bad}
            else:
                vals = dict(zip(df["key"], df[column], strict=True))
                details = {k: f"{column}={vals[k]!r}" for k in bad}
            for k in bad:
                rejected.setdefault(k, (reason, details[k]))
            summaries.append(
                {
                    "expectation": cfg.type,
                    "column": column,
                    "reason": reason,
                    "success": bool(r.success) if reason != "duplicate_sha256" else not bad,
                    "unexpected": len(bad),
                }
            )
    rej = pd.DataFrame(
        [{"key": k, "reason": v[0], "detail": v[1]} for k, v in sorted(rejected.items())],
        columns=["key", "reason", "detail"],
    )
    clean = df[~df["key"].isin(rejected)].drop(columns=["short_side"]).reset_index(drop=True)
    return QualityVerdict(clean=clean, rejected=rej, expectations=summaries)
