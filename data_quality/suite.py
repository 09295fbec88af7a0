"""The catalog's Great Expectations suite, built in code, and the row-level verdicts from it.

The suite runs through a GX Checkpoint with `result_format="COMPLETE"` and
`unexpected_index_column_names=["uid"]`, so every failing row is identified and can be
quarantined with a reason code. The same run renders a Data Docs site when asked.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from data_quality.near_dup import near_duplicates
from data_quality.rules import QualityConfig

__all__ = ["REASONS", "QualityVerdict", "build_suite", "prepare", "run_suite"]

log = logging.getLogger(__name__)

# Reason code per expectation (the code lands in the quarantine's `reason` column).
REASONS = {
    "caption_missing": "caption is null (no manifest row or sidecar, or it had no caption)",
    "caption_blank": "caption is empty or whitespace only",
    "caption_too_short": "caption shorter than quality.min_caption_chars",
    "caption_too_long": "caption longer than quality.max_caption_chars",
    "caption_not_ascii": "caption's ASCII share below quality.min_ascii_ratio",
    "too_small": "short side below quality.min_side",
    "extreme_aspect": "long/short side ratio above quality.max_aspect_ratio",
    "license_not_allowed": "license not in quality.allowed_licenses",
    "low_aesthetic": "aesthetic score below quality.min_aesthetic (or missing)",
    "duplicate_sha256": "exact byte duplicate of an earlier file (earliest ingest kept)",
    "near_duplicate": "perceptual-hash near-duplicate of an earlier image",
}
INGEST_REASONS = {
    "empty_file": "zero-byte file",
    "not_an_image": "bytes are not a known image format",
    "decode_error": "truncated or corrupt image data",
    "too_many_pixels": "pixel count over ingest.max_pixels (never decoded)",
    "read_error": "the object could not be read",
    "unsafe_key": "key is absolute or contains '..' (never read or written)",
    "unsupported_extension": "not an image extension of ingest.image_extensions",
    "caption_not_utf8": "caption sidecar is not valid UTF-8",
    "sidecar_bad_json": "metadata sidecar is not a JSON object",
    "no_image": "tar sample without an image member",
    "duplicate_key": "tar sample key repeated",
    "unsupported_member": "tar member is a link or device",
    "tar_error": "tar shard truncated or corrupt after this point",
    "empty_tar": "tar shard without samples",
    "manifest_bad_json": "manifest line is not valid JSON",
    "manifest_not_utf8": "manifest line is not valid UTF-8",
    "manifest_bad_row": "manifest CSV row has the wrong number of fields",
    "manifest_no_file_name": "manifest row without a file_name",
    "manifest_unsafe_key": "manifest file_name escapes the source",
    "manifest_duplicate_row": "second manifest row for the same file",
    "manifest_missing_file": "manifest row whose file is not in the source",
    "manifest_unreadable": "manifest file cannot be parsed",
}


@dataclass
class QualityVerdict:
    """Outcome of the suite on one catalog."""

    clean: pd.DataFrame
    rejected: pd.DataFrame  # source, key, reason, detail
    expectations: list[dict]  # one summary per expectation: type, column, success, unexpected
    near_duplicates: int  # rows flagged (quarantined too when drop_near_duplicates)
    docs_index: str | None  # Data Docs index.html, when built


def prepare(catalog: pd.DataFrame, rules: QualityConfig) -> pd.DataFrame:
    """The catalog plus the derived columns that the expectations check.

    Rows are ordered by (ingest_seq, source, key): the earliest ingested copy of a duplicate
    is the one kept.
    """
    required = {"key", "source", "caption", "width", "height", "sha256", "phash", "ingest_seq"}
    missing = required - set(catalog.columns)
    if missing:
        raise ValueError(
            f"catalog is missing columns {sorted(missing)}; got {list(catalog.columns)}"
        )
    if rules.allowed_licenses is not None and rules.license_column not in catalog.columns:
        raise ValueError(
            f"quality.allowed_licenses is set but the catalog has no {rules.license_column!r} "
            f"column; add it to ingest.metadata_columns (columns: {list(catalog.columns)})"
        )
    df = catalog.sort_values(["ingest_seq", "source", "key"], kind="stable").reset_index(drop=True)
    df["uid"] = df["source"].str.rstrip("/") + "/" + df["key"]
    short = df[["width", "height"]].min(axis=1)
    df["short_side"] = short
    df["aspect_ratio"] = (df[["width", "height"]].max(axis=1) / short.clip(lower=1)).round(3)
    caps = df["caption"].fillna("")
    df["ascii_ratio"] = [round(sum(c.isascii() for c in s) / len(s), 3) if s else 1.0 for s in caps]
    match = near_duplicates(list(df["phash"]), list(df["sha256"]), rules.near_duplicate_distance)
    df["near_duplicate_of"] = [None if m is None else df["uid"].iat[m] for m in match]
    return df


def build_suite(rules: QualityConfig, columns: set[str]):
    """The catalog suite for `rules`; optional checks only when configured (and present)."""
    import great_expectations as gx

    e = gx.expectations
    exps = [
        e.ExpectColumnValuesToNotBeNull(column="caption", meta={"reason": "caption_missing"}),
        e.ExpectColumnValuesToMatchRegex(
            column="caption", regex=r"\S", meta={"reason": "caption_blank"}
        ),
        e.ExpectColumnValueLengthsToBeBetween(
            column="caption", min_value=rules.min_caption_chars,
            meta={"reason": "caption_too_short"},
        ),
        e.ExpectColumnValueLengthsToBeBetween(
            column="caption", max_value=rules.max_caption_chars,
            meta={"reason": "caption_too_long"},
        ),
    ]  # fmt: skip
    if rules.min_ascii_ratio is not None:
        exps.append(
            e.ExpectColumnValuesToBeBetween(
                column="ascii_ratio", min_value=rules.min_ascii_ratio,
                meta={"reason": "caption_not_ascii"},
            )
        )  # fmt: skip
    exps += [
        e.ExpectColumnValuesToBeBetween(
            column="short_side", min_value=rules.min_side, meta={"reason": "too_small"}
        ),
        e.ExpectColumnValuesToBeBetween(
            column="aspect_ratio", max_value=rules.max_aspect_ratio,
            meta={"reason": "extreme_aspect"},
        ),
    ]  # fmt: skip
    if rules.allowed_licenses is not None:
        exps.append(
            e.ExpectColumnValuesToBeInSet(
                column=rules.license_column, value_set=list(rules.allowed_licenses),
                meta={"reason": "license_not_allowed"},
            )
        )  # fmt: skip
    if rules.min_aesthetic is not None and rules.aesthetic_column in columns:
        exps.append(
            e.ExpectColumnValuesToBeBetween(
                column=rules.aesthetic_column, min_value=rules.min_aesthetic,
                meta={"reason": "low_aesthetic"},
            )
        )  # fmt: skip
    exps.append(
        e.ExpectColumnValuesToBeUnique(column="sha256", meta={"reason": "duplicate_sha256"})
    )
    if rules.drop_near_duplicates:
        exps.append(
            e.ExpectColumnValuesToBeNull(
                column="near_duplicate_of", meta={"reason": "near_duplicate"}
            )
        )
    suite = gx.ExpectationSuite(name="kiln_catalog")
    for x in exps:
        suite.add_expectation(x)
    return suite


def _validate(df: pd.DataFrame, rules: QualityConfig, docs_dir: Path | None):
    import great_expectations as gx
    from great_expectations.checkpoint import UpdateDataDocsAction

    ctx = gx.get_context(mode="ephemeral")
    ctx.variables.progress_bars = {"globally": False}
    actions = []
    if docs_dir is not None:
        ctx.add_data_docs_site(
            site_name="kiln",
            site_config={
                "class_name": "SiteBuilder",
                "store_backend": {
                    "class_name": "TupleFilesystemStoreBackend",
                    "base_directory": str(docs_dir),
                },
                "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
            },
        )
        actions.append(UpdateDataDocsAction(name="data_docs", site_names=["kiln"]))
    batch_def = (
        ctx.data_sources.add_pandas("kiln")
        .add_dataframe_asset("catalog")
        .add_batch_definition_whole_dataframe("all")
    )
    suite = ctx.suites.add(build_suite(rules, set(df.columns)))
    vd = ctx.validation_definitions.add(
        gx.ValidationDefinition(name="kiln_catalog", data=batch_def, suite=suite)
    )
    checkpoint = ctx.checkpoints.add(
        gx.Checkpoint(
            name="kiln_gate",
            validation_definitions=[vd],
            actions=actions,
            result_format={"result_format": "COMPLETE", "unexpected_index_column_names": ["uid"]},
        )
    )
    result = checkpoint.run(batch_parameters={"dataframe": df})
    return next(iter(result.run_results.values()))


def run_suite(
    catalog: pd.DataFrame, rules: QualityConfig, docs_dir: Path | None = None
) -> QualityVerdict:
    """Validate `catalog` (the current view's accepted rows) and split it into clean and
    rejected rows. A row failing several expectations is quarantined once, under the first
    reason in suite order. With `docs_dir`, a Data Docs site is written there."""
    df = prepare(catalog, rules)
    # GX's column-map checks skip nulls; a missing license or score must fail, not pass.
    vdf = df.copy()
    if rules.allowed_licenses is not None:
        vdf[rules.license_column] = (
            vdf[rules.license_column]
            .astype(object)
            .where(vdf[rules.license_column].notna(), "<missing>")
        )
    if rules.min_aesthetic is not None and rules.aesthetic_column in vdf.columns:
        scores = pd.to_numeric(vdf[rules.aesthetic_column], errors="coerce")
        vdf[rules.aesthetic_column] = scores.fillna(-np.inf)
    elif rules.min_aesthetic is not None:
        log.warning(
            "quality.min_aesthetic set, but no %r column: check skipped", rules.aesthetic_column
        )

    rejected: dict[str, tuple[str, str]] = {}
    summaries: list[dict] = []
    docs_index = None
    if len(df):
        run = _validate(vdf, rules, docs_dir)
        first_of_sha = df.groupby("sha256")["uid"].first()
        for r in run.results:
            cfg = r.expectation_config
            reason, column = cfg.meta["reason"], cfg.kwargs["column"]
            bad = [row["uid"] for row in r.result.get("unexpected_index_list") or []]
            vals = dict(zip(df["uid"], df[column], strict=True))
            if reason == "duplicate_sha256":
                # GX flags every copy; keep the earliest ingested one.
                keep = set(first_of_sha.values)
                bad = [u for u in bad if u not in keep]
                details = {u: f"same sha256 as {first_of_sha[vals[u]]}" for u in bad}
            elif reason == "near_duplicate":
                details = {u: f"pHash near {vals[u]}" for u in bad}
            else:
                details = {u: f"{column}={vals[u]!r}"[:300] for u in bad}
            for u in bad:
                rejected.setdefault(u, (reason, details[u]))
            summaries.append(
                {
                    "expectation": cfg.type,
                    "column": column,
                    "reason": reason,
                    "success": not bad,
                    "unexpected": len(bad),
                }
            )
        if docs_dir is not None and (docs_dir / "index.html").is_file():
            docs_index = str(docs_dir / "index.html")
    by_uid = df.set_index("uid")
    rej = pd.DataFrame(
        [
            {"source": by_uid.at[u, "source"], "key": by_uid.at[u, "key"], "reason": v[0],
             "detail": v[1]}
            for u, v in sorted(rejected.items())
        ],
        columns=["source", "key", "reason", "detail"],
    )  # fmt: skip
    derived = ["uid", "short_side", "aspect_ratio", "ascii_ratio"]
    clean = df[~df["uid"].isin(rejected)].drop(columns=derived)
    clean = clean.sort_values(["source", "key"], kind="stable").reset_index(drop=True)
    return QualityVerdict(
        clean=clean,
        rejected=rej,
        expectations=summaries,
        near_duplicates=sum(
            1
            for u in df.loc[df["near_duplicate_of"].notna(), "uid"]
            if rejected.get(u, ("near_duplicate",))[0] == "near_duplicate"
        ),
        docs_index=docs_index,
    )
