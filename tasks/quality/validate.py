"""Validate: run the Great Expectations suite on a catalog and quarantine the failing rows.

The suite runs on the current catalog view (every source ingested into the root), so exact
and near duplicates are caught across runs. The row-local rules run a partition of the view
at a time (`check_partition`, Prefect tasks on local threads or a Dask cluster), so memory is
set by the partition size; the cross-catalog rules then run over the view's hashes (about 24
bytes a row). Rows that an earlier verdict in the same chain already checked under the same
suite are not checked again (`data_quality.incremental`): a new ingest's rows are checked,
and compared with the rest for duplicates (`validate_catalog`).

Outputs are listed in `validate_catalog`; the quarantine is written before the gate is
checked, so a failing gate still leaves every reason on disk. The gate's verdict is written
with the catalog (`catalog/<ingest_id>/verdict.json`, `data_quality.verdict`), which the shard
step reads before it shards; the clean rows are the view less the verdict's rejects
(`tasks.catalog.clean`); nothing view-sized is written.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from prefect import task
from prefect.cache_policies import NO_CACHE

from data_quality import hash_cache
from data_quality.dup_partitions import write_hash_file
from data_quality.incremental import mergeable_quarantine, quarantine_record, reusable_verdict
from data_quality.suite import (
    REASONS,
    SAMPLE,
    TERMS_REASONS,
    CrossCheck,
    RowCheck,
    check_columns,
    check_rows,
    cross_catalog,
    cross_hits,
    expectation_summaries,
    hash_columns,
    suite_key,
    write_data_docs,
)
from data_quality.terms import check_terms
from data_quality.verdict import (
    FLAGS_FILE,
    OVERRIDE_FLAG,
    REJECTS_FILE,
    SAMPLE_FILE,
    VERDICT_FILE,
    QualityGateError,
    ValidateResult,
    result_from_quarantine,
    write_verdict,
)
from data_quality.verdict_rows import (
    FLAG_SCHEMA,
    REJECT_SCHEMA,
    merge_base,
    stage_rejects,
    write_rows,
)
from kiln_config import LaunchConfig, QualityConfig
from kiln_config.errors import MissingInput
from tasks.catalog.takedown import takedown_set
from tasks.catalog.view import (
    ROW_GROUP,
    ViewPart,
    accepted_columns,
    chain,
    read_part,
    table_path,
    view_parts,
    view_versions,
)
from tasks.quality.content import (
    ContentScores,
    content_columns,
    content_scorers,
    score_content,
    semantic_duplicates,
)
from tasks.quality.dup_search import dup_partitions_for, old_hash_batches, partitioned_cross
from tasks.quality.verdict_tables import (
    quarantine_schema,
    resolve_hits,
    write_quarantine,
    write_verdict_table,
)
from tasks.runtime.logs import task_logger
from tasks.runtime.progress import Progress
from tasks.runtime.runners import partition_runner, release_freed_memory
from tasks.storage.layout import Layout
from tasks.storage.lock import catalog_writer

__all__ = ["PARTITION_ROWS", "check_partition", "validate_catalog"]

PARTITION_ROWS = 2 * ROW_GROUP  # rows per validate task


def _write_parquet(df: pd.DataFrame, path: Path) -> None:
    tmp = path.with_suffix(".parquet.tmp")
    df.to_parquet(tmp, index=False)
    tmp.replace(path)


@task(name="check-partition", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def check_partition(
    part: ViewPart,
    row_groups: list[int],
    columns: list[str],
    rules: QualityConfig,
    hash_path: str | None = None,
    hash_parts: int = 0,
    stage_path: str | None = None,
    cache: str | None = None,
    content: ContentScores | None = None,
) -> RowCheck:
    """The row-local rules on some row groups of one ingest's rows (a retry rewrites what it
    wrote; on a Dask worker, the root must be mounted at the same path). With `hash_path`, the
    rows' hashes go to that file for the partitioned duplicate search instead of the result;
    with `stage_path`, the rejected rows go to that file and the result keeps their `pos`;
    with `cache`, the hashes are also kept there for later validates (hash_cache.py); with
    `content`, the content rules' scores are joined from the content store first."""
    rows = content_columns(read_part(part, columns, row_groups), rules, content)
    check = check_rows(rows, rules)
    if cache:
        meta = pq.ParquetFile(part.path).metadata
        try:
            hash_cache.save(
                Path(cache),
                part.path,
                row_groups,
                [meta.row_group(g).num_rows for g in row_groups],
                check.hashes,
            )
        except OSError as e:  # the cache only saves time: a validate without it is the same
            task_logger(__name__).warning("hash cache not written (%s): %s", cache, e)
    if hash_path:
        write_hash_file(hash_path, check.hashes, hash_parts)
        check.hashes = None
    if stage_path:
        check.rejected = stage_rejects(stage_path, check.rejected)
    return check


def _partitions(parts: list[ViewPart], rows: int) -> list[tuple[ViewPart, list[int]]]:
    per = max(1, rows // ROW_GROUP)
    return [
        (p, list(range(g, min(g + per, p.row_groups))))
        for p in parts
        for g in range(0, p.row_groups, per)
    ]


def _run_checks(
    tasks: list,
    rules,
    columns,
    workers: int,
    dask_address: str | None,
    stage: Path,
    hash_dir: Path | None = None,
    hash_parts: int = 0,
    cache: Path | None = None,
    content: ContentScores | None = None,
) -> tuple[list, pd.DataFrame]:
    """check_partition over `tasks`, in order; at most `workers` partitions in flight locally,
    so that memory stays a few partitions whatever the catalog's size. Each writes its
    rejects to `stage/rows-<n>.parquet`; with `hash_dir`, its hashes there (`<n>.parquet`) for
    `hash_parts` duplicate partitions; with `cache`, to the hash cache. Returns the results
    and their bounded sample."""
    out, window, sample = [], [], pd.DataFrame()
    progress = Progress(
        "validate", sum(p.rows for p in {p.path: p for p, _ in tasks}.values()), "rows"
    )

    def done(future) -> None:
        nonlocal sample
        out.append(future.result())
        sample, out[-1].sample = _bounded_sample([sample, out[-1].sample]), None
        progress.advance(out[-1].rows)

    with partition_runner(workers, dask_address) as runner:
        limit = len(tasks) if dask_address else workers
        for i, (part, groups) in enumerate(tasks):
            args = {
                "part": part,
                "row_groups": groups,
                "columns": columns,
                "rules": rules,
                "stage_path": str(stage / f"rows-{i:06d}.parquet"),
                "cache": str(cache) if cache else None,
                "content": content,
            }
            if hash_dir is not None:
                args.update(hash_path=str(hash_dir / f"{i:06d}.parquet"), hash_parts=hash_parts)
            window.append(runner.submit(check_partition, args))
            if len(window) >= limit:
                done(window.pop(0))
        for f in window:
            done(f)
    progress.finish()
    return out, sample


def _merge(checks: list[RowCheck], offset: int, sample: pd.DataFrame) -> RowCheck:
    """The partitions' results as one: the rejected rows' positions (`pos`, counted from
    `offset`; the rows themselves are staged), counts, `sample` and hashes."""
    pos, counts, start = [], {}, offset
    for c in checks:
        pos.append(c.rejected["pos"].to_numpy(np.int64) + start)
        for r, n in c.counts.items():
            counts[r] = counts.get(r, 0) + n
        start += c.rows
    hashes = (
        None
        if any(c.hashes is None for c in checks)
        else tuple(
            np.concatenate([c.hashes[i] for c in checks]) if checks else np.zeros(0, np.uint64)
            for i in range(3)
        )
    )
    rejected = pd.DataFrame({"pos": np.concatenate(pos) if pos else np.zeros(0, np.int64)})
    return RowCheck(
        rows=start - offset, rejected=rejected, counts=counts, sample=sample, hashes=hashes
    )


def _bounded_sample(frames: list[pd.DataFrame]) -> pd.DataFrame:
    frames = [f for f in frames if f is not None and len(f)]
    if not frames:
        return pd.DataFrame()
    cols = list(dict.fromkeys(c for f in frames for c in f.columns))
    return pd.concat([f.reindex(columns=cols) for f in frames], ignore_index=True).head(
        SAMPLE * len(REASONS)
    )


def _terms(
    root: str, parts: list[ViewPart], columns: list[str], rules: QualityConfig, out: Path
) -> pa.Array:
    """The licensing terms (data_quality/terms.py) on every row of the view, a row group at a
    time: the takedown list and the date change between runs, so no verdict is reused. The
    rows they quarantine go to `out`; returns their source and key joined by a NUL."""
    want = ["source", "key"] + [
        c for c in (rules.contributor_column, rules.license_end_column) if c in columns
    ]
    takedowns, today = takedown_set(root), datetime.now(UTC).date()
    if not takedowns and rules.license_end_column not in columns:
        parts = []  # no takedown list and no license end: no row can fail the terms
    write_rows(
        out,
        (
            check_terms(read_part(p, want, [g]), rules, takedowns, today)
            for p in parts
            for g in range(p.row_groups)
        ),
        REJECT_SCHEMA,
    )
    t = pq.read_table(out, columns=["source", "key"])
    return pc.binary_join_element_wise(t["source"], t["key"], "\0").combine_chunks()


def _dup_plan(cat: Path, dup_partitions, parts, new_parts, partition_rows: int):
    """(hash partitions, their scratch folder, created empty) for the duplicate checks; (0,
    None) when the driver runs them (see `validate_catalog`)."""
    if dup_partitions is not None and (
        isinstance(dup_partitions, bool)
        or not isinstance(dup_partitions, int)
        or dup_partitions < 0
    ):
        raise ValueError(f"dup_partitions: expected None or an int >= 0, got {dup_partitions!r}")
    if dup_partitions is None:
        new_rows = sum(p.rows for p in new_parts)
        dup_partitions = dup_partitions_for(sum(p.rows for p in parts), new_rows, partition_rows)
    if not dup_partitions:
        return 0, None
    hash_dir = cat / "dup-hashes"
    shutil.rmtree(hash_dir, ignore_errors=True)
    hash_dir.mkdir()
    return dup_partitions, hash_dir


def _find(
    parts,
    old_parts,
    new_parts,
    old_rows: int,
    rules: QualityConfig,
    columns,
    stage: Path,
    hash_dir: Path | None,
    dup_partitions: int,
    *,
    workers: int,
    dask_address: str | None,
    partition_rows: int,
    cache: Path | None = None,
    content: ContentScores | None = None,
) -> tuple[RowCheck, dict]:
    """The row-local rules on the new rows (their rejects staged; their hashes kept in the hash
    `cache`) and the duplicate checks against the whole view, reading the old rows' hashes
    from the cache where it has them: (the merged RowCheck, `cross_hits` of the new rows).

    On the driver, the duplicate search needs only the new rows' hashes, so it runs on a
    thread of its own while the row checks run: the checks' start (Great Expectations'
    import and context) is mostly one busy core, and the search uses the others."""
    with ThreadPoolExecutor(1, thread_name_prefix="kiln-search") as pool:
        search = None
        if hash_dir is None and any(p.rows for p in new_parts):
            hashes = hash_columns(
                pd.concat([read_part(p, ["sha256", "phash"]) for p in new_parts], ignore_index=True)
            )
            batches = old_hash_batches(old_parts, new_parts, str(cache) if cache else None)
            search = pool.submit(cross_catalog, hashes, rules, batches, old_rows, workers=workers)
        checks, sample = _run_checks(
            _partitions(new_parts, partition_rows),
            rules,
            columns,
            workers,
            dask_address,
            stage,
            hash_dir,
            dup_partitions,
            cache,
            content,
        )
        new = _merge(checks, old_rows, sample)
        new.hashes = None
        release_freed_memory()
        if search is not None:
            cross = search.result()
        elif hash_dir is not None:
            files = [(str(hash_dir / f"{i:06d}.parquet"), c.rows) for i, c in enumerate(checks)]
            cross = partitioned_cross(
                hash_dir,
                files,
                _partitions(old_parts, partition_rows),
                rules.near_duplicate_distance,
                dup_partitions,
                workers=workers,
                dask_address=dask_address,
                cache=str(cache) if cache else None,
            )
        else:
            cross = CrossCheck(np.zeros(0, np.int64), np.zeros(0, np.int64))
    release_freed_memory()
    return new, cross_hits(new.rejected["pos"].to_numpy(np.int64), cross, rules, old_rows)


def _write_rows(
    layout: Layout,
    ingest_id: str,
    stage: Path,
    base: dict | None,
    cross: tuple[Path, Path],
    terms: tuple[Path, pa.Array],
    sample: pd.DataFrame,
) -> tuple[int, pd.DataFrame, dict, dict]:
    """The verdict's rows streamed into place: `rejects.parquet` (the earlier verdict's, the
    staged partitions', the duplicates', less any row the licensing terms quarantine, then
    the terms' own), `near_duplicates.parquet`, `docs_sample.parquet`, the quarantine (merged
    from the earlier verdict's when `mergeable_quarantine`, else rebuilt from the whole view)
    and the Delta tables. Returns (rejects, the quarantine's counts by step and reason, the
    tables' versions, `quarantine_record` of the quarantine)."""
    cat = layout.catalog(ingest_id)
    rows_files = sorted(stage.glob("rows-*.parquet"))
    rejects, flags = stage / REJECTS_FILE, stage / FLAGS_FILE
    n = write_rows(
        rejects,
        [*([base["rejects"]] if base else []), *rows_files, cross[0]],
        REJECT_SCHEMA,
        gone=terms[1],
        drop_reasons=TERMS_REASONS,
        then=[terms[0]],
    )
    write_rows(flags, [*([base["flags"]] if base else []), cross[1]], FLAG_SCHEMA)
    qparts = view_parts(layout, ingest_id, "quarantine")
    qtable = table_path(layout, "quarantine")
    merge_from = None
    if base is not None:
        base_file = layout.quality(base["id"]) / "quarantine.parquet"
        merge_from = mergeable_quarantine(base, base_file, qtable, qparts, terms[0])
    if merge_from is not None and not merge_base(merge_from, quarantine_schema(qparts)):
        merge_from = None
    if merge_from is None:
        quarantine = write_quarantine(
            layout, ingest_id, rejects, layout.quality(ingest_id), parts=qparts
        )
    else:  # the rows this run adds: its new rows' rejects (no terms row: those are as before)
        task_logger(__name__).info("quarantine: %s's merged with the rows after it", base["id"])
        added = stage / "added-rejects.parquet"
        write_rows(added, [*rows_files, cross[0]], REJECT_SCHEMA, gone=terms[1])
        quarantine = write_quarantine(
            layout,
            ingest_id,
            added,
            layout.quality(ingest_id),
            base=merge_from,
            after_seq=base["seq"],
            parts=qparts,
        )
    release_freed_memory()
    rejects.replace(cat / REJECTS_FILE)
    flags.replace(cat / FLAGS_FILE)
    _write_parquet(
        sample.astype({c: object for c in sample.columns if sample[c].dtype == object}),
        cat / SAMPLE_FILE,
    )
    # The same rows as Delta tables (`verdict` = this ingest id), for other engines and SQL.
    tables = {
        t: write_verdict_table(layout, t, cat / f, ingest_id)
        for t, f in (("rejects", REJECTS_FILE), ("flags", FLAGS_FILE))
    }
    record = quarantine_record(qtable, qparts, int(quarantine["n"].sum()))
    return n, quarantine, tables, record


@task(name="validate-catalog", cache_policy=NO_CACHE)
def validate_catalog(
    root: str,
    ingest_id: str,
    rules: QualityConfig,
    *,
    allow_failed_gate: bool = False,
    dask_address: str | None = None,
    workers: int = 2,
    partition_rows: int = PARTITION_ROWS,
    dup_partitions: int | None = None,
    launch: LaunchConfig | None = None,
    endpoint_url: str | None = None,
) -> ValidateResult:
    """Run the suite on the view after `ingest_id`; raise QualityGateError past the threshold.

    Rows are checked a partition (`partition_rows`) at a time, `workers` partitions at once on local
    threads, or on the Dask cluster at `dask_address`. The duplicate checks run in `dup_partitions`
    hash-prefix partitions (tasks/quality/dup_search.py; None: one per about 500k rows when more
    than one partition of rows is new, else 0: on the driver, whose memory then holds the new rows'
    hashes and a row group of the old). When an earlier catalog of the chain was validated under the
    same rules and no accepted row has left the view since, only the rows ingested after it are
    checked, and compared with the others for duplicates: their hashes come from the hash cache
    (data_quality/hash_cache.py) that the row checks fill, and the quarantine is that verdict's
    merged with the new rows when nothing it was built from changed
    (`data_quality.incremental.mergeable_quarantine`). The licensing terms (data_quality/terms.py:
    the takedown list, license ends) run on every row at every run and override the suite's reason;
    they are not counted in the gate's reject fraction.

    The content rules (quality.max_unsafe, allowed_languages, min_clip_score, the aesthetic
    head, semantic_duplicate_similarity) read scores that tasks/quality/content.py computes
    for the rows to check before their checks, and keeps once per image and caption: the CLIP
    embeddings by an accelerate launch with `launch`; `endpoint_url` is the sources' S3
    endpoint, where the images are read from.

    Writes, in `catalog/<ingest_id>/`, `rejects.parquet` (the rows this step quarantined),
    `near_duplicates.parquet` (near-duplicates kept), `docs_sample.parquet` and then
    `verdict.json` (passed, reject fraction, limit, reasons, the suite's key, the catalog table
    versions it checked, the quarantine data files its quarantine was built from); the
    rejects and flags also go to the Delta tables `catalog/tables/rejects` and `.../flags`
    (column `verdict`: the ingest id); and, in `quality/<ingest_id>/`, the Data Docs site,
    `quarantine.parquet` (every quarantined row of the view, ingest and validate steps),
    `quarantine_sample.parquet` (up to 20 rows a reason: what MLflow gets) and
    `summary.json`. All of it is written before the gate is checked. With
    `allow_failed_gate` a failed gate is logged instead of raised (the verdict still says
    failed, and the shard step needs the same override).

    Holds the catalog writer's lock (`<root>/.kiln-catalog.lock`) throughout, as ingest and
    compaction do: it commits to the rejects and flags tables and rewrites the verdict's
    files, so it waits for a running ingest, compaction or other validate of the root.
    """
    with catalog_writer(Path(root), f"kiln validate of {ingest_id}"):
        return _validate(
            root,
            ingest_id,
            rules,
            allow_failed_gate=allow_failed_gate,
            dask_address=dask_address,
            workers=workers,
            partition_rows=partition_rows,
            dup_partitions=dup_partitions,
            launch=launch,
            endpoint_url=endpoint_url,
        )


@dataclass
class _Scope:
    """What one validate checks: the view's accepted rows after the ingest, split at the
    earlier verdict it keeps (`base`) into rows already checked and new ones."""

    layout: Layout
    ingest_id: str
    suite: str
    base: dict | None
    parts: list[ViewPart]
    columns: list[str]
    old_parts: list[ViewPart]
    new_parts: list[ViewPart]
    old_rows: int

    @property
    def catalog(self) -> Path:
        return self.layout.catalog(self.ingest_id)


def _kept_verdict(layout: Layout, ingest_id: str, rules: QualityConfig) -> tuple[str, dict | None]:
    """(the suite's key, the earlier verdict whose checked rows this run keeps), once the
    catalog is known to exist."""
    if not (layout.catalog(ingest_id) / "summary.json").is_file():
        raise MissingInput(
            f"no catalog view for ingest {ingest_id} under {layout.root}: run `kiln ingest` first"
        )
    suite = suite_key(rules, content_scorers(rules))
    links = [(link, layout.catalog(link["id"])) for link in chain(layout, ingest_id)]
    return suite, reusable_verdict(links, suite)


def _scope(
    layout: Layout, ingest_id: str, rules: QualityConfig, suite: str, base: dict | None
) -> _Scope:
    """The rows to validate, once their columns are known to hold what the rules read."""
    parts = view_parts(layout, ingest_id, "accepted")
    columns = accepted_columns(layout, ingest_id, parts)
    if sum(p.rows for p in parts):
        check_columns(columns, rules)
    if (
        rules.min_aesthetic is not None
        and rules.aesthetic_column not in columns
        and rules.aesthetic_head is None
    ):
        task_logger(__name__).warning(
            "quality.min_aesthetic set, but no %r column: check skipped", rules.aesthetic_column
        )
    after = base["seq"] if base else 0
    return _Scope(
        layout,
        ingest_id,
        suite,
        base,
        parts,
        columns,
        old_parts=[p for p in parts if p.seq <= after],
        new_parts=[p for p in parts if p.seq > after],
        old_rows=int(base["rows"]) if base else 0,
    )


def _verdict_rows(
    scope: _Scope,
    rules: QualityConfig,
    stage: Path,
    *,
    dup_partitions: int | None,
    workers: int,
    dask_address: str | None,
    partition_rows: int,
    launch: LaunchConfig | None = None,
    endpoint_url: str | None = None,
) -> tuple[ValidateResult, dict]:
    """The checks of the new rows and the duplicate search, then every row of the verdict and
    the Data Docs written; returns the result and what the verdict file records besides."""
    layout, base, ingest_id = scope.layout, scope.base, scope.ingest_id
    dup_partitions, hash_dir = _dup_plan(
        scope.catalog, dup_partitions, scope.parts, scope.new_parts, partition_rows
    )
    cache = hash_cache.cache_folder(layout.folder("catalog"))
    hash_cache.prune(cache, table_path(layout, "accepted"))
    content = score_content(
        str(layout.root),
        scope.new_parts,
        rules,
        launch=launch,
        endpoint_url=endpoint_url,
        threads=max(1, workers),
    )
    if content is not None and rules.semantic_duplicate_similarity is not None:
        content = semantic_duplicates(
            scope.parts,
            scope.old_rows,
            rules,
            content,
            stage / "semantic.parquet",
            columns=scope.columns,
            workers=workers,
            dask_address=dask_address,
        )
    new, hits = _find(
        scope.parts,
        scope.old_parts,
        scope.new_parts,
        scope.old_rows,
        rules,
        scope.columns,
        stage,
        hash_dir,
        dup_partitions,
        workers=workers,
        dask_address=dask_address,
        partition_rows=partition_rows,
        cache=cache,
        content=content,
    )
    counts = dict(base["counts"]) if base else {}
    for r, n in {**new.counts, **hits["counts"]}.items():
        counts[r] = counts.get(r, 0) + n
    rows = scope.old_rows + new.rows
    sample = _bounded_sample([base["sample"] if base else None, new.sample])
    if not len(sample) and rows:
        first = content_columns(
            read_part(scope.parts[0], scope.columns, [0]).head(3), rules, content
        )
        sample = check_rows(first, rules, gx_check=False, hashes=False).sample
    near = int(base.get("near_duplicates", 0) if base else 0) + hits["near_duplicates"]
    qdir = layout.quality(ingest_id)
    shutil.rmtree(qdir, ignore_errors=True)  # a re-run rebuilds the docs, never appends
    qdir.mkdir(parents=True)
    docs = write_data_docs(qdir, rules, sample, counts, rows) if rows else None
    terms = stage / "terms.parquet"
    gone = _terms(str(layout.root), scope.parts, scope.columns, rules, terms)
    cross = resolve_hits(scope.parts, hits, rules.drop_near_duplicates, stage)
    release_freed_memory()
    rejected, quarantine, tables, qrecord = _write_rows(
        layout, ingest_id, stage, base, cross, (terms, gone), sample
    )
    result = result_from_quarantine(
        ingest_id,
        rows,
        rejected,
        quarantine,
        rules,
        near_duplicates=near,
        expectations=expectation_summaries(rules, counts),
        data_docs=docs,
        checked_rows=new.rows,
        incremental_from=base["id"] if base else None,
    )
    recorded = {
        "suite": scope.suite,
        "rows": rows,
        "counts": counts,
        "near_duplicates": near,
        "table_versions": view_versions(layout, ingest_id),
        "verdict_table_versions": tables,
        "quarantine": qrecord,
    }
    return result, recorded


def _validate(
    root: str,
    ingest_id: str,
    rules: QualityConfig,
    *,
    allow_failed_gate: bool,
    dask_address: str | None,
    workers: int,
    partition_rows: int,
    dup_partitions: int | None,
    launch: LaunchConfig | None,
    endpoint_url: str | None,
) -> ValidateResult:
    """`validate_catalog`'s work, under the catalog writer's lock."""
    log = task_logger(__name__)
    layout = Layout(Path(root))
    suite, base = _kept_verdict(layout, ingest_id, rules)
    # An old verdict must never vouch for the rejects this run is about to write, nor outlive
    # a run that fails on the way (a column the rules need and the catalog lacks, say).
    (layout.catalog(ingest_id) / VERDICT_FILE).unlink(missing_ok=True)
    scope = _scope(layout, ingest_id, rules, suite, base)
    stage = scope.catalog / "validate-stage"  # the verdict's rows, as they are found
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    try:
        result, recorded = _verdict_rows(
            scope,
            rules,
            stage,
            dup_partitions=dup_partitions,
            workers=workers,
            dask_address=dask_address,
            partition_rows=partition_rows,
            launch=launch,
            endpoint_url=endpoint_url,
        )
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    qdir = layout.quality(ingest_id)
    (qdir / "summary.json").write_text(json.dumps(result.to_dict(), indent=2))
    write_verdict(scope.catalog, result, **recorded)
    if not result.passed:
        msg = result.failure(qdir / "quarantine.parquet")
        if not allow_failed_gate:
            raise QualityGateError(msg)
        log.warning("%s\ncontinuing: %s was given", msg, OVERRIDE_FLAG)
        return result
    log.info(
        "validated %s: %d clean, %d quarantined; checked %d rows%s",
        ingest_id,
        result.clean,
        result.listed - result.clean,
        result.checked_rows,
        f" (the rest were checked for {scope.base['id']})" if scope.base else "",
    )
    return result
