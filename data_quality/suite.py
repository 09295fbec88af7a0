"""The catalog's Great Expectations suite, built in code, and the row-level verdicts from it.

The suite is the source of truth for the rules: each expectation carries its reason code, and
Kiln evaluates each one as a vectorised column operation with GX's semantics (a column-map
check skips nulls), a partition of rows at a time (`check_rows`). GX validates every partition
too, for counts only (`result_format="SUMMARY"`: no per-row records), and a partition on which
GX and Kiln disagree fails loudly. The cross-catalog rules, exact and near duplicates, are
row-local checks on derived columns (`duplicate_of`, `near_duplicate_of`) that
`cross_catalog` fills in from the whole catalog's hashes. The Data Docs page shows the whole
catalog's counts and a bounded sample of the failing rows (`write_data_docs`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from itertools import islice
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from data_quality.near_dup import (
    near_duplicates,
    near_duplicates_against,
    near_filter,
    phash_to_uint64,
)
from kiln_config import QualityConfig
from kiln_config.errors import InputError

__all__ = [
    "CROSS_REASONS",
    "INGEST_REASONS",
    "REASONS",
    "TERMS_REASONS",
    "QualityVerdict",
    "RowCheck",
    "apply_cross",
    "build_suite",
    "check_rows",
    "content_columns_needed",
    "cross_catalog",
    "cross_hits",
    "derive",
    "expectation_summaries",
    "hash_columns",
    "run_suite",
    "suite_key",
    "write_data_docs",
]

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
    "unsafe": "unsafe probability (NudeNet) above quality.max_unsafe",
    "caption_language": "caption's language not in quality.allowed_languages",
    "low_clip_score": "image-caption CLIP cosine below quality.min_clip_score",
    "semantic_duplicate": "CLIP embedding within quality.semantic_duplicate_similarity of an "
    "earlier image of its cluster (SemDeDup; earliest ingest kept)",
    "duplicate_sha256": "exact byte duplicate of an earlier file (earliest ingest kept)",
    "near_duplicate": "perceptual-hash near-duplicate of an earlier image",
}
# Licensing terms (data_quality/terms.py): checked on every row at every validate, whatever
# else the row passes, since they change with the takedown list and the date, not the row.
TERMS_REASONS = {
    "takedown": "on the takedown list (`kiln takedown list`)",
    "license_expired": "license ended (quality.license_end_column) before validation",
    "license_end_invalid": "license end is not an ISO date (YYYY-MM-DD)",
}
INGEST_REASONS = {
    "empty_file": "zero-byte file",
    "not_an_image": "bytes are not a known image format",
    "decode_error": "truncated or corrupt image data",
    "too_many_pixels": "pixel count over ingest.max_pixels (never decoded)",
    "too_large": "file, sidecar or tar member over ingest.max_bytes (never read)",
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
            column="caption",
            min_value=rules.min_caption_chars,
            meta={"reason": "caption_too_short"},
        ),
        e.ExpectColumnValueLengthsToBeBetween(
            column="caption",
            max_value=rules.max_caption_chars,
            meta={"reason": "caption_too_long"},
        ),
    ]
    if rules.min_ascii_ratio is not None and rules.allowed_languages is None:
        exps.append(
            e.ExpectColumnValuesToBeBetween(
                column="ascii_ratio",
                min_value=rules.min_ascii_ratio,
                meta={"reason": "caption_not_ascii"},
            )
        )
    exps += [
        e.ExpectColumnValuesToBeBetween(
            column="short_side", min_value=rules.min_side, meta={"reason": "too_small"}
        ),
        e.ExpectColumnValuesToBeBetween(
            column="aspect_ratio",
            max_value=rules.max_aspect_ratio,
            meta={"reason": "extreme_aspect"},
        ),
    ]
    if rules.allowed_licenses is not None:
        exps.append(
            e.ExpectColumnValuesToBeInSet(
                column=rules.license_column,
                value_set=list(rules.allowed_licenses),
                meta={"reason": "license_not_allowed"},
            )
        )
    if rules.min_aesthetic is not None and (
        rules.aesthetic_column in columns or rules.aesthetic_head is not None
    ):
        exps.append(
            e.ExpectColumnValuesToBeBetween(
                column=rules.aesthetic_column,
                min_value=rules.min_aesthetic,
                meta={"reason": "low_aesthetic"},
            )
        )
    # The content rules (data_quality/content/): their columns are joined from the content
    # store before the checks (tasks/quality/content.py).
    if rules.max_unsafe is not None:
        exps.append(
            e.ExpectColumnValuesToBeBetween(
                column="unsafe", max_value=rules.max_unsafe, meta={"reason": "unsafe"}
            )
        )
    if rules.allowed_languages is not None:
        exps.append(
            e.ExpectColumnValuesToBeInSet(
                column="caption_language",
                value_set=[*rules.allowed_languages, "und"],
                meta={"reason": "caption_language"},
            )
        )
    if rules.min_clip_score is not None:
        exps.append(
            e.ExpectColumnValuesToBeBetween(
                column="clip_score",
                min_value=rules.min_clip_score,
                meta={"reason": "low_clip_score"},
            )
        )
    if rules.semantic_duplicate_similarity is not None:
        exps.append(
            e.ExpectColumnValuesToBeNull(
                column="semantic_duplicate_of", meta={"reason": "semantic_duplicate"}
            )
        )
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


CROSS_REASONS = ("duplicate_sha256", "near_duplicate")  # need the whole catalog
REQUIRED = ("key", "source", "caption", "width", "height", "sha256", "phash", "ingest_seq")
SAMPLE = 20  # failing rows per expectation kept for the Data Docs
_SUITE_FORMAT = 2  # part of `suite_key`: bump when a rule's meaning changes


def suite_key(rules: QualityConfig, scorers: tuple[str, ...] = ()) -> str:
    """Identifies the rules a verdict was reached under, with the models that scored the
    content rules (`scorers`: a new model's scores are other scores): rows checked under the
    same key are not checked again."""
    blob = json.dumps([_SUITE_FORMAT, rules.model_dump(mode="json"), *scorers], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def check_columns(columns, rules: QualityConfig) -> None:
    """Raise a clear error when the catalog lacks what the rules need."""
    missing = set(REQUIRED) - set(columns)
    if missing:
        raise ValueError(f"catalog is missing columns {sorted(missing)}; got {list(columns)}")
    if rules.allowed_licenses is not None and rules.license_column not in columns:
        raise InputError(
            f"quality.allowed_licenses is set but the catalog has no {rules.license_column!r} "
            f"column; add it to ingest.metadata_columns (columns: {list(columns)})"
        )


def content_columns_needed(rules: QualityConfig) -> list[str]:
    """The columns the content rules of `rules` read (joined from the content store)."""
    need = []
    if rules.max_unsafe is not None:
        need.append("unsafe")
    if rules.allowed_languages is not None:
        need.append("caption_language")
    if rules.min_clip_score is not None:
        need.append("clip_score")
    if rules.semantic_duplicate_similarity is not None:
        need.append("semantic_duplicate_of")
    if rules.min_aesthetic is not None and rules.aesthetic_head is not None:
        need.append(rules.aesthetic_column)
    return need


def _strings(col: pd.Series) -> pa.Array:
    return pa.array(col.astype(object).where(col.notna(), None), pa.string())


def derive(df: pd.DataFrame) -> pd.DataFrame:
    """The rows plus the derived columns that the expectations check, by columns."""
    w, h = df["width"].to_numpy(float), df["height"].to_numpy(float)
    short = np.minimum(w, h)
    caps = _strings(df["caption"])
    n = pc.fill_null(pc.utf8_length(caps), 0).to_numpy(zero_copy_only=False)
    plain = pc.replace_substring_regex(caps, pattern=r"[^\x00-\x7f]", replacement="")
    ascii_n = pc.fill_null(pc.utf8_length(plain), 0).to_numpy(zero_copy_only=False)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(n > 0, np.round(ascii_n / np.maximum(n, 1), 3), 1.0)
    return df.assign(
        uid=df["source"].astype(str).str.rstrip("/") + "/" + df["key"].astype(str),
        short_side=np.minimum(df["width"].to_numpy(), df["height"].to_numpy()),
        aspect_ratio=np.round(np.maximum(w, h) / np.clip(short, 1, None), 3),
        ascii_ratio=ratio,
    )


def _gx_frame(df: pd.DataFrame, rules: QualityConfig) -> pd.DataFrame:
    """The frame as GX sees it: a missing license or score must fail, and GX's column-map
    checks skip nulls, so they are filled with values that fail."""
    out = {}
    if rules.allowed_licenses is not None:
        col = df[rules.license_column]
        out[rules.license_column] = col.astype(object).where(col.notna(), "<missing>")
    if rules.min_aesthetic is not None and rules.aesthetic_column in df.columns:
        scores = pd.to_numeric(df[rules.aesthetic_column], errors="coerce")
        out[rules.aesthetic_column] = scores.fillna(-np.inf)
    return df.assign(**out) if out else df


def _unexpected(kind: str, kw: dict, col: pd.Series) -> np.ndarray:
    """Rows that fail one expectation, with GX's semantics (column-map checks skip nulls)."""
    null = col.isna().to_numpy()
    if kind == "expect_column_values_to_not_be_null":
        return null
    if kind == "expect_column_values_to_be_null":
        return ~null
    if kind == "expect_column_values_to_match_regex":
        hit = pc.fill_null(pc.match_substring_regex(_strings(col), kw["regex"]), False)
        return ~null & ~hit.to_numpy(zero_copy_only=False)
    if kind == "expect_column_values_to_be_in_set":
        return ~null & ~col.isin(kw["value_set"]).to_numpy()
    if kind == "expect_column_value_lengths_to_be_between":
        vals = pc.utf8_length(_strings(col)).to_numpy(zero_copy_only=False).astype(float)
    elif kind == "expect_column_values_to_be_between":
        vals = pd.to_numeric(col, errors="coerce").to_numpy(float)
    else:
        raise NotImplementedError(f"Kiln cannot evaluate expectation {kind!r} by columns")
    ok = np.ones(len(col), bool)
    with np.errstate(invalid="ignore"):
        if kw.get("min_value") is not None:
            ok &= (vals > kw["min_value"]) if kw.get("strict_min") else (vals >= kw["min_value"])
        if kw.get("max_value") is not None:
            ok &= (vals < kw["max_value"]) if kw.get("strict_max") else (vals <= kw["max_value"])
    return ~null & ~ok


def _expectations(rules: QualityConfig, columns) -> list[tuple[str, str, str, dict]]:
    """(reason, expectation type, column, kwargs) of the suite, in suite order."""
    out = []
    _, vd = _gx.get(rules, tuple(sorted(columns)))  # a suite needs a GX context
    for x in vd.suite.expectations:
        cfg = x.configuration
        out.append((cfg.meta["reason"], cfg.type, cfg.kwargs["column"], dict(cfg.kwargs)))
    return out


# GX keeps one "current project" per process and checks a suite against it when a validation
# definition is added or run; with one context per thread, another thread's context may be
# current and the check fails as if the suite had changed. So each thread's context is made
# current for its own build and run, under one lock.
_GX_LOCK = threading.Lock()


class _GX(threading.local):
    """One GX context and validation definition per thread and suite: building them costs
    more than validating a partition."""

    def get(self, rules: QualityConfig, columns: tuple[str, ...]):
        key = (suite_key(rules), rules.aesthetic_column in columns)  # all build_suite reads
        cache = self.__dict__.setdefault("cache", {})
        if key not in cache:
            with _GX_LOCK:
                cache[key] = self._build(rules, columns)
        return cache[key]

    @staticmethod
    def _build(rules: QualityConfig, columns: tuple[str, ...]):
        import great_expectations as gx

        ctx = gx.get_context(mode="ephemeral")
        ctx.variables.progress_bars = {"globally": False}
        batch_def = (
            ctx.data_sources.add_pandas("kiln")
            .add_dataframe_asset("catalog")
            .add_batch_definition_whole_dataframe("all")
        )
        suite = ctx.suites.add(build_suite(rules, set(columns)))
        vd = ctx.validation_definitions.add(
            gx.ValidationDefinition(name="kiln_catalog", data=batch_def, suite=suite)
        )
        return ctx, vd


_gx = _GX()


def _gx_run(frame: pd.DataFrame, rules: QualityConfig):
    from great_expectations.data_context.data_context.context_factory import project_manager

    ctx, vd = _gx.get(rules, tuple(frame.columns))
    with _GX_LOCK:
        project_manager.set_project(ctx)
        return vd.run(
            batch_parameters={"dataframe": frame}, result_format={"result_format": "SUMMARY"}
        )


@dataclass
class RowCheck:
    """The row-local rules on one partition of the catalog (picklable: a Dask task's result)."""

    rows: int
    rejected: pd.DataFrame  # source, key, reason, detail: the first failing rule of each row
    counts: dict[str, int]  # unexpected rows per reason (a row may fail several)
    sample: pd.DataFrame  # up to SAMPLE failing rows per reason, as GX sees them
    hashes: tuple[np.ndarray, np.ndarray, np.ndarray] | None = field(default=None, repr=False)


def check_rows(
    df: pd.DataFrame, rules: QualityConfig, *, gx_check: bool = True, hashes: bool = True
) -> RowCheck:
    """The row-local expectations on `df`, by columns; GX validates the same rows for counts,
    and a disagreement raises. With `hashes`, also the rows' `hash_columns`."""
    check_columns(df.columns, rules)
    lacking = [c for c in content_columns_needed(rules) if c not in df.columns]
    if lacking:
        raise ValueError(
            f"the content rules read {lacking}, which the rows lack: join them first "
            "(tasks/quality/content.py content_columns, as `kiln validate` does)"
        )
    df = derive(df.reset_index(drop=True))
    vdf = _gx_frame(df.assign(duplicate_of=None, near_duplicate_of=None), rules)
    exps = _expectations(rules, vdf.columns)
    first = np.full(len(df), -1)
    counts, samples = {}, []
    for i, (reason, kind, column, kw) in enumerate(exps):
        if reason in CROSS_REASONS:
            continue
        bad = _unexpected(kind, kw, vdf[column])
        counts[reason] = int(bad.sum())
        first[(first < 0) & bad] = i
        if counts[reason]:
            samples.append(vdf.take(np.flatnonzero(bad)[:SAMPLE]))
    if gx_check and len(df):
        theirs = {
            r.expectation_config.meta["reason"]: int(r.result.get("unexpected_count") or 0)
            for r in _gx_run(vdf, rules).results
        }
        wrong = {r: (theirs.get(r), n) for r, n in counts.items() if theirs.get(r) != n}
        if wrong:
            raise RuntimeError(
                f"Great Expectations and Kiln's column checks disagree on {len(df)} rows "
                f"(reason: (GX, Kiln) unexpected counts): {wrong}"
            )
    hit = first >= 0
    reasons = np.array([e[0] for e in exps], dtype=object)
    columns = np.array([e[2] for e in exps], dtype=object)
    cols = columns[first[hit]]
    bad = vdf[hit]
    details = [f"{c}={v!r}"[:300] for c, v in zip(cols, _values(bad, cols), strict=True)]
    rejected = pd.DataFrame(
        {
            "source": bad["source"].to_numpy(object),
            "key": bad["key"].to_numpy(object),
            "reason": reasons[first[hit]],
            "detail": details,
            "pos": np.flatnonzero(hit),
        },
        columns=["source", "key", "reason", "detail", "pos"],
    )
    # GX renders the Data Docs from a sample: the failing rows, and a few rows at least. A
    # take copies them (a slice would keep the whole partition's Arrow buffers alive).
    sample = pd.concat([*samples, vdf.take(np.arange(min(3, len(vdf))))], ignore_index=True)
    return RowCheck(
        rows=len(df),
        rejected=rejected,
        counts=counts,
        sample=sample,
        hashes=hash_columns(df) if hashes else None,
    )


def _values(frame: pd.DataFrame, columns: np.ndarray) -> list:
    """frame[columns[i]] of row i, a column at a time."""
    out = np.empty(len(frame), dtype=object)
    for c in set(columns):
        at = columns == c
        out[at] = frame[c].to_numpy(object)[at]
    return [v.item() if hasattr(v, "item") else v for v in out]


def hash128(values: np.ndarray, hi_key: str, lo_key: str) -> tuple[np.ndarray, np.ndarray]:
    """Two independent 64-bit hashes of each string (16-character keys): equal strings, equal
    pair; unequal ones collide with odds near 1e-20 at a billion rows."""
    return (
        pd.util.hash_array(values, hash_key=hi_key, categorize=False),
        pd.util.hash_array(values, hash_key=lo_key, categorize=False),
    )


def hash_columns(df: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sha_hi, sha_lo, phash) as uint64: the sha256 as 128 bits (`hash128`) and the
    16-hex-digit pHash."""
    sha = df["sha256"].astype(str).to_numpy(object)
    return (
        *hash128(sha, "kiln-sha256-hi-0", "kiln-sha256-lo-1"),
        phash_to_uint64(df["phash"].to_numpy(object)),
    )


@dataclass
class CrossCheck:
    """The cross-catalog rules over the new rows: for each, the position (in the whole
    catalog's priority order) of the row it duplicates, or -1. With `positions`, only the
    rows at those positions (the others have no duplicate): the partitioned search's form."""

    duplicate_of: np.ndarray
    near_duplicate_of: np.ndarray
    positions: np.ndarray | None = None


@dataclass(frozen=True)
class _NewHi:
    """The new rows' sorted distinct `hi` (`uniq`), and a bitmap of their top `bits` bits
    (`seen`): one look-up there rules out most old rows before a binary search (`hi` is a
    hash, so its top bits spread evenly)."""

    uniq: np.ndarray
    seen: np.ndarray
    bits: int

    @classmethod
    def of(cls, hi: np.ndarray) -> _NewHi:
        uniq = np.unique(hi)
        bits = min(22, max(16, (16 * len(uniq)).bit_length()))  # about 1/16 full, <= 4 MB
        seen = np.zeros(1 << bits, dtype=bool)
        seen[(uniq >> np.uint64(64 - bits)).astype(np.intp)] = True
        return cls(uniq, seen, bits)


def _first_equal(hi, lo, new_hi: _NewHi, ohi, olo) -> np.ndarray:
    """For each new row (hi, lo), the first old row of the batch with the same pair, else -1.
    Only old rows whose `hi` some new row has are looked at (`new_hi`: the new rows')."""
    uniq_hi = new_hi.uniq
    cand = np.flatnonzero(new_hi.seen[(ohi >> np.uint64(64 - new_hi.bits)).astype(np.intp)])
    at = np.minimum(np.searchsorted(uniq_hi, ohi[cand]), len(uniq_hi) - 1)
    cand = cand[uniq_hi[at] == ohi[cand]]
    if not len(cand):
        return np.full(len(hi), -1, np.int64)
    old = pd.MultiIndex.from_arrays([ohi[cand], olo[cand]])
    first_old = pd.Series(cand, index=old)[~old.duplicated()]
    pos = first_old.reindex(pd.MultiIndex.from_arrays([hi, lo])).to_numpy()
    return np.where(np.isnan(pos), -1, pos).astype(np.int64)


def _against_batch(new, new_hi: _NewHi, d: int, near_filter, batch) -> tuple:
    """One old batch's answers for the new rows, in the batch's own positions: (exact, near,
    rows). `batch` is (hi, lo, phash) or a function returning it (read in this thread); with
    `near_filter`, only the old rows it lets through are searched for near duplicates."""
    hi, lo, ph = new
    ohi, olo, oph = batch() if callable(batch) else batch
    exact = _first_equal(hi, lo, new_hi, ohi, olo)
    if near_filter is None:
        return exact, near_duplicates_against(ph, hi, oph, ohi, d, prefilter=False), len(ohi)
    at = np.flatnonzero(near_filter(oph))
    if not len(at):
        return exact, np.full(len(hi), -1, np.int64), len(ohi)
    found = near_duplicates_against(ph, hi, oph[at], ohi[at], d, prefilter=False)
    return exact, np.where(found >= 0, at[np.maximum(found, 0)], -1), len(ohi)


def _in_order(fn, items, workers: int):
    """`fn` over `items` on up to `workers` threads, results in order, at most 2 x `workers`
    in flight (each holds one batch of old hashes)."""
    if workers <= 1:
        yield from map(fn, items)
        return
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers, thread_name_prefix="kiln-cross") as pool:
        window = deque()
        for item in items:
            window.append(pool.submit(fn, item))
            if len(window) >= 2 * workers:
                yield window.popleft().result()
        while window:
            yield window.popleft().result()


_GATHER = 4  # old batches searched as one (row groups of 65,536 rows: 6 MB of hashes)


def _gathered(batches, k: int = _GATHER):
    """The old batches `k` at a time, each group as one batch (a function that reads and
    joins them, in order): the search's work per batch that does not depend on the old rows
    (the new rows' keys, sorted with each table's) is then paid once per group."""
    it = iter(batches)
    while chunk := list(islice(it, k)):
        yield chunk[0] if len(chunk) == 1 else partial(_joined, chunk)


def _joined(chunk: list) -> tuple:
    got = [b() if callable(b) else b for b in chunk]
    return tuple(np.concatenate([g[i] for g in got]) for i in range(3))


def cross_catalog(
    new, rules: QualityConfig, old_batches=(), old_rows: int = 0, *, workers: int = 1
) -> CrossCheck:
    """Exact and near duplicates of the `new` rows' hashes (hi, lo, phash), among themselves
    and against the old rows, which all come earlier: `old_batches` yields their hashes a
    batch at a time, in order (`old_rows` rows in all), each as (hi, lo, phash) or as a
    function that reads them. Positions count the old rows first. `workers` threads read and
    search the old batches, `_GATHER` batches at a time (numpy and Arrow let go of the GIL for
    much of it); with few new rows, only the old rows that `near_filter` lets through are
    searched for near duplicates."""
    hi, lo, ph = new
    n = len(hi)
    dup = np.full(n, -1, np.int64)
    near = np.full(n, -1, np.int64)
    d = rules.near_duplicate_distance
    if not n:
        return CrossCheck(duplicate_of=dup, near_duplicate_of=near)
    start = 0
    read = partial(_against_batch, new, _NewHi.of(hi), d, near_filter(ph, d, old_rows))
    for exact, m, rows in _in_order(read, _gathered(old_batches), workers):
        # the first old row of each new sha256 and pHash (earlier batches first)
        take = (dup < 0) & (exact >= 0)
        dup[take] = exact[take] + start
        take = (near < 0) & (m >= 0)
        near[take] = m[take] + start
        start += rows
    assert start == old_rows, (start, old_rows)
    # among the new rows: the first copy of each sha256 is kept (unless an old row has it)
    order = np.lexsort((np.arange(n), lo, hi))
    same = np.r_[False, (hi[order][1:] == hi[order][:-1]) & (lo[order][1:] == lo[order][:-1])]
    head = order[np.maximum.accumulate(np.where(~same, np.arange(n), 0))]
    mine = np.full(n, -1, np.int64)
    mine[order] = np.where(head != order, head, -1)
    take = (dup < 0) & (mine >= 0)
    dup[take] = mine[take] + old_rows
    m = near_duplicates(ph, hi, d)
    take = (near < 0) & (m >= 0)
    near[take] = m[take] + old_rows
    return CrossCheck(duplicate_of=dup, near_duplicate_of=near)


def apply_cross(
    rows: RowCheck, cross: CrossCheck, rules: QualityConfig, keys_at, offset: int = 0
) -> dict:
    """Merge the cross-catalog results of the rows at positions `offset`... into the row-local
    ones (`rows`, whose `rejected` has their positions in `pos`): `rejected` (each row under
    its first reason in suite order), `flags` (near-duplicates kept: source, key,
    near_duplicate_of) and `counts`. `keys_at(positions)` gives the (sources, keys) of
    catalog positions, for the rows hit and the rows they duplicate."""
    hits = cross_hits(rows.rejected["pos"].to_numpy(np.int64), cross, rules, offset)
    counts = {**rows.counts, **hits["counts"]}
    (dup_pos, dup_of), (near_pos, near_of) = hits["dup"], hits["near"]
    need = np.unique(np.concatenate([dup_pos, dup_of, near_pos, near_of]))
    src, key = keys_at(need) if len(need) else (np.array([], object), np.array([], object))
    at = {int(p): i for i, p in enumerate(need)}

    def frame(hit_pos, hit_of, reason, what):
        me = [at[int(p)] for p in hit_pos]
        of = [at[int(p)] for p in hit_of]
        uid = [f"{str(src[i]).rstrip('/')}/{key[i]}" for i in of]
        out = pd.DataFrame(
            {
                "source": src[me],
                "key": key[me],
                "reason": reason,
                "detail": [f"{what} {u}" for u in uid],
            },
            columns=["source", "key", "reason", "detail"],
        )
        return out, uid

    dups, _ = frame(dup_pos, dup_of, "duplicate_sha256", "same sha256 as")
    nears, near_uid = frame(near_pos, near_of, "near_duplicate", "pHash near")
    parts = [rows.rejected.drop(columns="pos"), dups]
    flags = pd.DataFrame(columns=["source", "key", "near_duplicate_of"])
    if rules.drop_near_duplicates:
        parts.append(nears)
    else:
        flags = nears[["source", "key"]].assign(near_duplicate_of=near_uid)
    rejected = pd.concat([x for x in parts if len(x)] or [dups], ignore_index=True)
    return {
        "rejected": rejected,
        "flags": flags,
        "counts": counts,
        "near_duplicates": hits["near_duplicates"],
    }


def cross_hits(
    rejected: np.ndarray, cross: CrossCheck, rules: QualityConfig, offset: int = 0
) -> dict:
    """The cross-catalog results of the rows at positions `offset`... as positions: `dup`
    and `near` ((positions, the positions they duplicate), each by position) for the rows
    that no row-local rule rejected (`rejected`: their positions), an exact copy taking
    precedence; their `counts` per reason and the `near_duplicates` kept or dropped."""
    dup, near = cross.duplicate_of, cross.near_duplicate_of
    pos = np.arange(len(dup)) + offset if cross.positions is None else cross.positions
    counts = {"duplicate_sha256": int((dup >= 0).sum())}
    if rules.drop_near_duplicates:
        counts["near_duplicate"] = int((near >= 0).sum())
    free = ~np.isin(pos, rejected)
    is_dup = free & (dup >= 0)
    is_near = free & ~is_dup & (near >= 0)
    return {
        "dup": (pos[is_dup], dup[is_dup]),
        "near": (pos[is_near], near[is_near]),
        "counts": counts,
        "near_duplicates": int(is_near.sum()),
    }


def expectation_summaries(rules: QualityConfig, counts: dict[str, int]) -> list[dict]:
    """One summary per expectation of the suite (type, column, reason, success, unexpected)."""
    cols = {*REQUIRED, rules.license_column, rules.aesthetic_column}
    return [
        {
            "expectation": kind,
            "column": column,
            "reason": reason,
            "success": not counts.get(reason, 0),
            "unexpected": int(counts.get(reason, 0)),
        }
        for reason, kind, column, _ in _expectations(rules, cols)
    ]


def write_data_docs(
    docs_dir: Path, rules: QualityConfig, sample: pd.DataFrame, counts: dict[str, int], rows: int
) -> str:
    """A Data Docs site for the whole catalog in `docs_dir`: GX renders its validation of
    `sample` (failing rows, bounded) with each expectation's counts set to the catalog's
    (`counts` of `rows` rows). Returns the index page."""
    import copy

    from great_expectations.core.run_identifier import RunIdentifier
    from great_expectations.data_context.types.resource_identifiers import (
        ExpectationSuiteIdentifier,
        ValidationResultIdentifier,
    )

    ctx, vd = _gx.get(rules, tuple(sample.columns))
    site = f"kiln-{threading.get_ident()}"
    ctx.add_data_docs_site(
        site_name=site,
        site_config={
            "class_name": "SiteBuilder",
            "store_backend": {
                "class_name": "TupleFilesystemStoreBackend",
                "base_directory": str(docs_dir),
            },
            "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
        },
    )
    try:
        run = copy.deepcopy(_gx_run(sample, rules))
        for r in run.results:
            n = int(counts.get(r.expectation_config.meta["reason"], 0))
            r.result.update(
                element_count=rows,
                unexpected_count=n,
                missing_count=0,
                unexpected_percent=100 * n / rows if rows else 0.0,
            )
            r.success = n == 0
        ok = sum(r.success for r in run.results)
        run.success = ok == len(run.results)
        run.statistics.update(
            evaluated_expectations=len(run.results),
            successful_expectations=ok,
            unsuccessful_expectations=len(run.results) - ok,
            success_percent=100 * ok / max(1, len(run.results)),
        )
        suite_id = ExpectationSuiteIdentifier(name=vd.suite.name)
        key = ValidationResultIdentifier(
            expectation_suite_identifier=suite_id,
            run_id=RunIdentifier(run_name="kiln", run_time=datetime.now(UTC)),
            batch_identifier="catalog",
        )
        ctx.validation_results_store.set(key, run)
        ctx.build_data_docs(site_names=[site], resource_identifiers=[key, suite_id])
    finally:
        ctx.delete_data_docs_site(site)
    return str(docs_dir / "index.html")


@dataclass
class QualityVerdict:
    """Outcome of the suite on one catalog held in memory (`run_suite`)."""

    clean: pd.DataFrame
    rejected: pd.DataFrame  # source, key, reason, detail
    expectations: list[dict]  # one summary per expectation: type, column, success, unexpected
    near_duplicates: int  # rows flagged (quarantined too when drop_near_duplicates)
    docs_index: str | None  # Data Docs index.html, when built


def run_suite(
    catalog: pd.DataFrame, rules: QualityConfig, docs_dir: Path | None = None
) -> QualityVerdict:
    """Validate `catalog`, held in memory, and split it into clean and rejected rows: the
    checks `kiln validate` runs a partition at a time. A row failing several expectations is
    quarantined once, under the first reason in suite order; of duplicates, the earliest
    ingested copy (by ingest_seq, source, key) is kept. With `docs_dir`, a Data Docs site is
    written there."""
    check_columns(catalog.columns, rules)
    if rules.min_aesthetic is not None and rules.aesthetic_column not in catalog.columns:
        log.warning(
            "quality.min_aesthetic set, but no %r column: check skipped", rules.aesthetic_column
        )
    df = catalog.sort_values(["ingest_seq", "source", "key"], kind="stable").reset_index(drop=True)
    rows = check_rows(df, rules)
    src, key = df["source"].to_numpy(object), df["key"].to_numpy(object)
    verdict = apply_cross(
        rows, cross_catalog(rows.hashes, rules), rules, lambda pos: (src[pos], key[pos])
    )
    docs_index = None
    if docs_dir is not None and len(df):
        docs_index = write_data_docs(docs_dir, rules, rows.sample, verdict["counts"], len(df))
    rejected = verdict["rejected"].sort_values(["source", "key"]).reset_index(drop=True)
    gone = pd.MultiIndex.from_frame(rejected[["source", "key"]])
    keep = ~pd.MultiIndex.from_arrays([df["source"], df["key"]]).isin(gone)
    flags = verdict["flags"].set_index(["source", "key"])["near_duplicate_of"]
    clean = df[keep]
    clean = clean.assign(
        near_duplicate_of=flags.reindex(
            pd.MultiIndex.from_frame(clean[["source", "key"]])
        ).to_numpy()
    )
    clean = clean.sort_values(["source", "key"], kind="stable").reset_index(drop=True)
    return QualityVerdict(
        clean=clean,
        rejected=rejected,
        expectations=expectation_summaries(rules, verdict["counts"]),
        near_duplicates=verdict["near_duplicates"],
        docs_index=docs_index,
    )
