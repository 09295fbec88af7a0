"""The content rules' scores for `kiln validate`: computed once, stored, then joined to rows.

`score_content` runs before the row checks, on the rows a validate checks: what the content
store (data_quality/content/store.py) lacks is computed and appended, the unsafe probability
and the caption language here (CPU: NudeNet's ONNX session on a few threads, Lingua), the
CLIP embeddings by an accelerate launch (models/embed_content.py, `launch.*`: GPU work where
there are GPUs). `semantic_duplicates` then runs SemDeDup over the view's image embeddings, a
cluster per task (local threads or the Dask cluster). `content_columns` joins the stored
scores onto a partition's rows for the expectations: `unsafe`, `caption_language`,
`clip_score`, the predicted aesthetic score (where the source has no column of its own) and
`semantic_duplicate_of`.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
from PIL import Image
from prefect import task
from prefect.cache_policies import NO_CACHE

from data_quality.content import language, semdedup, store, unsafe
from data_quality.content.clip import AestheticHead, clip_scores
from data_quality.suite import check_rows
from kiln_config import EmbedRun, LaunchConfig, QualityConfig, files_sha256, write_run_file
from kiln_config.errors import InputError
from tasks.catalog.view import ViewPart, read_part
from tasks.launch.accelerate import launch_module
from tasks.runtime.logs import task_logger
from tasks.runtime.runners import partition_runner
from tasks.storage.images import read_image
from tasks.storage.layout import Layout

__all__ = [
    "CONTENT_COLUMNS",
    "ContentScores",
    "clip_scorer",
    "content_columns",
    "content_scorers",
    "has_content_rules",
    "score_content",
    "semantic_duplicates",
]

CONTENT_COLUMNS = (
    "unsafe",
    "caption_language",
    "clip_score",
    "semantic_duplicate_of",
)
_WHERE = ["source", "object", "offset", "length"]
_COMMIT_ROWS = 50_000


def has_content_rules(rules: QualityConfig) -> bool:
    return rules.max_unsafe is not None or rules.allowed_languages is not None or rules.needs_clip


def clip_scorer(clip_model: str) -> str:
    """The content store's name for a CLIP folder's embeddings: its files' digest.

    Raises:
        InputError: no folder there.
    """
    path = Path(clip_model).expanduser()
    if not (path / "config.json").is_file():
        raise InputError(
            f"quality.clip_model: no CLIP folder at {path} (config.json, weights and processor "
            "files, as save_pretrained writes them); stage it there (docs/operations.md)"
        )
    return "clip-" + files_sha256(path)["sha256"][:16]


def content_scorers(rules: QualityConfig) -> tuple[str, ...]:
    """The names of the models whose scores `rules` read: part of the verdict's suite key.

    Raises:
        InputError: the CLIP folder is missing.
    """
    out = []
    if rules.max_unsafe is not None:
        out.append(unsafe.SCORER)
    if rules.allowed_languages is not None:
        out.append(language.scorer(rules.allowed_languages))
        out.append(language.allowed_scorer(rules.allowed_languages))
    if rules.needs_clip:
        out.append(clip_scorer(rules.clip_model))
    if rules.aesthetic_head is not None and rules.min_aesthetic is not None:
        out.append(
            "aesthetic-" + files_sha256(Path(rules.aesthetic_head).expanduser())["sha256"][:16]
        )
    return tuple(out)


@dataclass
class ContentScores:
    """Where a validate's partitions find the content scores (picklable, for Dask)."""

    catalog: str  # <root>/catalog
    clip: str | None  # clip_scorer of quality.clip_model, when a rule reads CLIP
    semantic: str | None  # Parquet of the semantic duplicates found, when that rule is on


def _rows(parts: list[ViewPart], columns: list[str]) -> pd.DataFrame:
    frames = [read_part(p, columns) for p in parts]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns)


def _clip_side(clip_model: str) -> int:
    """The side the CLIP's processor resizes to (its preprocessor_config.json; 224 if unsaid)."""
    path = Path(clip_model).expanduser() / "preprocessor_config.json"
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    size = cfg.get("size") or {}
    size = size if isinstance(size, dict) else {"shortest_edge": size}
    return int(size.get("shortest_edge") or size.get("height") or 224)


def _thumbnail(img: Image.Image, side: int) -> bytes:
    """`img` with its short side at most `side` (Lanczos), as a JPEG at quality 95: what the
    embedding launch reads, so that it never reads a source itself."""
    w, h = img.size
    scale = side / min(w, h)
    if scale < 1:
        img = img.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.LANCZOS)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def _read_images(
    catalog: Path,
    rows: pd.DataFrame,
    rules: QualityConfig,
    clip: str | None,
    endpoint_url: str | None,
    threads: int,
) -> tuple[int, Path | None]:
    """One read of each new image for what the store lacks: its unsafe probability (stored,
    committed every `_COMMIT_ROWS`) and, for the CLIP rules, a thumbnail at the CLIP's input
    side in the embedding launch's work list (`images.parquet`, a row group per batch).
    Returns (images scored for unsafe, the work folder or None when nothing is to embed)."""
    images_t = store.table_dir(catalog, store.IMAGES)
    todo = rows.drop_duplicates("sha256")
    need_unsafe, need_clip = set(), set()
    if rules.max_unsafe is not None:
        need_unsafe = set(todo["sha256"]) - set(
            store.read(images_t, unsafe.SCORER, todo["sha256"])["key"]
        )
    work = None
    if clip is not None:
        need_clip = set(todo["sha256"]) - set(store.read(images_t, clip, todo["sha256"])["key"])
    if need_clip:
        side = _clip_side(rules.clip_model)
        keys = sorted(need_clip)
        # One folder per work list: a relaunch of the same list resumes its parts (kept across
        # a failed launch); another list (a new ingest since) starts afresh.
        digest = hashlib.sha256(
            "\n".join([str(rules.embed_batch_size), str(side), *keys]).encode()
        ).hexdigest()[:16]
        base = _embed_folder(catalog, clip)
        for old in base.glob("*") if base.is_dir() else []:
            if old.name != digest:
                shutil.rmtree(old, ignore_errors=True)
        work = base / digest
        work.mkdir(parents=True, exist_ok=True)
        if (work / "images.parquet").is_file():
            need_clip = set()  # the work list is written: only the launch is left
    read = todo[todo["sha256"].isin(need_unsafe | need_clip)].sort_values("sha256")
    if not len(read):
        return 0, work
    det = unsafe.detector() if need_unsafe else None
    side = _clip_side(rules.clip_model) if need_clip else 0
    draft = max(unsafe.SIZE, side)

    def task(chunk: pd.DataFrame) -> tuple[np.ndarray, list]:
        # 16 images decoded at a time, each at the smallest JPEG draft that covers what reads
        # it, so a thread holds 16 small images, not its whole chunk at full size.
        scores, thumbs = [], []
        for s in range(0, len(chunk), 16):
            part = chunk.iloc[s : s + 16]
            images = [read_image(r, endpoint_url, draft) for r in part.itertuples()]
            mine = part["sha256"].isin(need_unsafe).to_numpy()
            if mine.any():
                scores.append(det.scores([im for im, m in zip(images, mine, strict=True) if m]))
            for im, key in zip(images, part["sha256"], strict=True):
                if key in need_clip:
                    thumbs.append((key, _thumbnail(im, side)))
        return (np.concatenate(scores) if scores else np.zeros(0, np.float32)), thumbs

    chunks = [read.iloc[s : s + 256] for s in range(0, len(read), 256)]
    keys, scores, pending, writer = [], [], [], None
    tmp = work / "images.parquet.tmp" if need_clip else None
    with ThreadPoolExecutor(max(1, threads)) as pool:
        for chunk, (got, thumbs) in zip(chunks, pool.map(task, chunks), strict=True):
            keys.append(chunk["sha256"][chunk["sha256"].isin(need_unsafe)].to_numpy(object))
            scores.append(got)
            if sum(map(len, keys)) >= _COMMIT_ROWS:
                _store_unsafe(images_t, keys, scores)
                keys, scores = [], []
            if tmp is not None:
                writer = writer or pq.ParquetWriter(tmp, _THUMBS)
                pending += thumbs
                size = rules.embed_batch_size
                while len(pending) >= size:  # one row group per batch of the launch
                    writer.write_table(_thumbs_table(pending[:size]))
                    pending = pending[size:]
    if sum(map(len, keys)):
        _store_unsafe(images_t, keys, scores)
    if tmp is not None:
        writer = writer or pq.ParquetWriter(tmp, _THUMBS)
        if pending:
            writer.write_table(_thumbs_table(pending))
        writer.close()
        tmp.replace(work / "images.parquet")
    return len(need_unsafe), work


def _embed_folder(catalog: Path, clip: str) -> Path:
    return catalog / "content-embed" / clip


_THUMBS = pa.schema([("key", pa.string()), ("image", pa.binary())])


def _thumbs_table(items: list[tuple[str, bytes]]) -> pa.Table:
    return pa.table(
        {
            "key": pa.array([k for k, _ in items], pa.string()),
            "image": pa.array([b for _, b in items], pa.binary()),
        },
        schema=_THUMBS,
    )


def _store_unsafe(table: Path, keys: list, scores: list) -> None:
    store.append(table, np.concatenate(keys), unsafe.SCORER, scores=np.concatenate(scores))


def _languages(table: Path, rows: pd.DataFrame, rules: QualityConfig) -> int:
    caps = rows[["caption"]].assign(ckey=store.caption_keys(rows["caption"])).dropna()
    caps = caps.drop_duplicates("ckey")
    scorer = language.scorer(rules.allowed_languages)
    best = language.allowed_scorer(rules.allowed_languages)
    has_top = caps["ckey"].isin(set(store.read(table, scorer, caps["ckey"])["key"]))
    has_best = caps["ckey"].isin(set(store.read(table, best, caps["ckey"])["key"]))
    caps = caps.assign(has_top=has_top)[~(has_top & has_best)]
    for s in range(0, len(caps), _COMMIT_ROWS):
        chunk = caps.iloc[s : s + _COMMIT_ROWS]
        codes, conf, allowed = language.detect(chunk["caption"].tolist(), rules.allowed_languages)
        # The allowed languages' row after the top language's: a caption with both is done.
        # A caption stored by a version without the second row gets that row alone.
        new = ~chunk["has_top"].to_numpy()
        store.append(table, chunk["ckey"][new], scorer, scores=conf[new], labels=codes[new])
        store.append(table, chunk["ckey"], best, scores=allowed)
    return len(caps)


def _embed(
    catalog: Path,
    rows: pd.DataFrame,
    rules: QualityConfig,
    scorer: str,
    launch: LaunchConfig,
    work: Path | None,
) -> dict:
    """The CLIP embeddings the store lacks, by an accelerate launch over the work list that
    `_read_images` wrote (images) and the captions; returns counts."""
    images_t = store.table_dir(catalog, store.IMAGES)
    captions_t = store.table_dir(catalog, store.CAPTIONS)
    caps = pd.DataFrame({"key": [], "caption": []})
    if rules.min_clip_score is not None:
        caps = rows[["caption"]].assign(key=store.caption_keys(rows["caption"])).dropna()
        caps = caps.drop_duplicates("key")
        caps = caps[~caps["key"].isin(set(store.read(captions_t, scorer, caps["key"])["key"]))]
    if work is None and not len(caps):
        return {"images": 0, "captions": 0}
    if work is None:
        work = _embed_folder(catalog, scorer) / "captions-only"
        work.mkdir(parents=True, exist_ok=True)
    images = work / "images.parquet"
    if not images.is_file():
        pq.write_table(_thumbs_table([]), images)
    caps[["key", "caption"]].to_parquet(work / "captions.parquet")
    run = EmbedRun(
        clip_model=str(Path(rules.clip_model).expanduser()),
        images=str(images),
        captions=str(work / "captions.parquet"),
        out_dir=str(work / "parts"),
        batch_size=rules.embed_batch_size,
    )
    launch_module(
        launch,
        "models.embed_content",
        ["--config", str(write_run_file(run, work / "embed.yaml"))],
        workdir=work,
        name="embed-content",
    )
    want_images = pq.read_table(images, columns=["key"])["key"].to_pylist()
    for kind, table, want in (
        ("images", images_t, want_images),
        ("captions", captions_t, caps["key"]),
    ):
        files = sorted((work / "parts").glob(f"{kind}-*.parquet"))
        got = set()
        for f in files:
            got.update(pq.read_table(f, columns=["key"])["key"].to_pylist())
        lacking = set(want) - got
        if lacking:
            raise RuntimeError(
                f"the embedding launch wrote no {kind} embedding for {len(lacking)} of "
                f"{len(want)} keys (e.g. {sorted(lacking)[0]}); its parts are in {work}"
            )
        # appended a few parts at a time: the driver never holds every new embedding
        step = max(1, _COMMIT_ROWS // rules.embed_batch_size)
        for s in range(0, len(files), step):
            t = pa.concat_tables([pq.read_table(f) for f in files[s : s + step]])
            emb = np.stack(t["embedding"].to_numpy(zero_copy_only=False)).astype(np.float32)
            store.append(table, t["key"].to_pylist(), scorer, embeddings=emb)
    shutil.rmtree(_embed_folder(catalog, scorer), ignore_errors=True)
    return {"images": len(want_images), "captions": len(caps)}


def score_content(
    root: str,
    parts: list[ViewPart],
    rules: QualityConfig,
    *,
    launch: LaunchConfig | None,
    endpoint_url: str | None = None,
    threads: int = 2,
) -> ContentScores | None:
    """Compute and store the content scores that the rows of `parts` lack; None when no
    content rule is on.

    Raises:
        InputError: a CLIP rule is on and no launch settings were given, or the CLIP folder
            or aesthetic head is missing.
    """
    if not has_content_rules(rules):
        return None
    log = task_logger(__name__)
    catalog = Layout(Path(root)).folder("catalog")
    rows = _rows(parts, ["sha256", "caption", *_WHERE])
    scorer = None
    if rules.needs_clip:
        scorer = clip_scorer(rules.clip_model)
        if rules.aesthetic_head is not None:
            AestheticHead.load(rules.aesthetic_head)  # a missing head fails before the work
        if launch is None:
            raise InputError("the CLIP content rules need launch settings (launch.*)")
    n, work = _read_images(catalog, rows, rules, scorer, endpoint_url, threads)
    if rules.max_unsafe is not None:
        log.info("content: unsafe probability of %d new images (%s)", n, unsafe.SCORER)
    if rules.allowed_languages is not None:
        n = _languages(store.table_dir(catalog, store.CAPTIONS), rows, rules)
        log.info(
            "content: language of %d new captions (%s)", n, language.scorer(rules.allowed_languages)
        )
    if scorer is not None:
        got = _embed(catalog, rows, rules, scorer, launch, work)
        log.info("content: embedded %d images and %d captions (%s)", *got.values(), scorer)
    return ContentScores(str(catalog), scorer, None)


def content_columns(df: pd.DataFrame, rules: QualityConfig, scores: ContentScores | None):
    """`df` with the content columns its rules read, joined from the store.

    Raises:
        RuntimeError: a row has no stored score (the scores were not computed first).
    """
    if scores is None:
        return df
    catalog = Path(scores.catalog)
    images_t = store.table_dir(catalog, store.IMAGES)
    captions_t = store.table_dir(catalog, store.CAPTIONS)
    out = {}

    def joined(table, scorer, keys, what):
        got = store.read(table, scorer, keys)
        at = pd.Index(got["key"]).get_indexer(pd.Series(keys, dtype=object))
        missing = (at < 0) & pd.notna(pd.Series(keys, dtype=object)).to_numpy()
        if missing.any():
            raise RuntimeError(
                f"content store has no {what} ({scorer}) for {int(missing.sum())} rows: "
                "score_content must run before the row checks"
            )
        return got, at

    def taken(values: np.ndarray, at: np.ndarray, fill) -> np.ndarray:
        """`values[at]`, `fill` where a row has no stored value (no caption, or none at all)."""
        out = np.full(len(at), fill, dtype=object if values.dtype == object else float)
        out[at >= 0] = values[at[at >= 0]]
        return out

    sha = df["sha256"].to_numpy(object)
    ckeys = store.caption_keys(df["caption"])
    if rules.max_unsafe is not None:
        got, at = joined(images_t, unsafe.SCORER, sha, "unsafe probability")
        out["unsafe"] = taken(got["score"].to_numpy(float), at, np.nan)
    if rules.allowed_languages is not None:
        got, at = joined(
            captions_t, language.scorer(rules.allowed_languages), ckeys, "caption language"
        )
        code = taken(got["label"].to_numpy(object), at, language.UNDETERMINED)
        conf = taken(got["score"].to_numpy(float), at, 0.0)
        bgot, bat = joined(
            captions_t,
            language.allowed_scorer(rules.allowed_languages),
            ckeys,
            "allowed languages' confidence",
        )
        best = taken(bgot["score"].to_numpy(float), bat, 0.0)
        lang = language.verdict(df["caption"].tolist(), code, conf, best, rules)
        out["caption_language"] = np.where(at >= 0, lang, None)
    if scores.clip is not None:
        got, at = joined(images_t, scores.clip, sha, "CLIP image embedding")
        img = got.attrs["embedding"][at]
        if rules.min_clip_score is not None:
            cgot, cat = joined(captions_t, scores.clip, ckeys, "CLIP caption embedding")
            txt = cgot.attrs["embedding"][np.maximum(cat, 0)]
            out["clip_score"] = np.where(cat >= 0, np.round(clip_scores(img, txt), 4), np.nan)
        if rules.aesthetic_head is not None and rules.min_aesthetic is not None:
            # The source's own score wins row by row; the head fills the rows without one
            # (a declared column that no row has yet reads as null).
            head = np.round(AestheticHead.load(rules.aesthetic_head).scores(img), 4)
            col = rules.aesthetic_column
            own = (
                pd.to_numeric(df[col], errors="coerce").to_numpy(float)
                if col in df.columns
                else np.full(len(df), np.nan)
            )
            out[col] = np.where(np.isnan(own), head, own)
    if rules.semantic_duplicate_similarity is not None:
        sem = pd.read_parquet(scores.semantic) if scores.semantic else None
        of = pd.Series(None, index=df.index, dtype=object)
        if sem is not None and len(sem):
            uid = df["source"].astype(str).str.rstrip("/") + "/" + df["key"].astype(str)
            at = pd.Index(sem["uid"]).get_indexer(uid)
            vals = sem["semantic_duplicate_of"].to_numpy(object)
            of = pd.Series(np.where(at >= 0, vals[np.maximum(at, 0)], None), index=df.index)
        out["semantic_duplicate_of"] = of.to_numpy(object)
    return df.assign(**out)


@task(name="semantic-cluster", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def cluster_task(folder: str, first_new: int, similarity: float) -> pd.DataFrame:
    """SemDeDup within one cluster's members (`folder`: its part of the assignment)."""
    t = pads.dataset(folder, format="parquet").to_table()
    t = t.sort_by("pos")
    emb = np.stack(t["embedding"].to_numpy(zero_copy_only=False)).astype(np.float32)
    pos = t["pos"].to_numpy()
    sha = t["sha256"].to_numpy(zero_copy_only=False)
    ok = t["eligible"].to_numpy(zero_copy_only=False)
    hit, of, cos = semdedup.cluster_duplicates(
        emb, pos, first_new, similarity, keys=sha, eligible=ok
    )
    uid = t["uid"].to_numpy(zero_copy_only=False)
    at = pd.Index(pos)
    return pd.DataFrame(
        {
            "uid": uid[at.get_indexer(hit)],
            "semantic_duplicate_of": uid[at.get_indexer(of)],
            "semantic_similarity": cos,
        }
    )


def semantic_duplicates(
    parts: list[ViewPart],
    first_new: int,
    rules: QualityConfig,
    scores: ContentScores,
    out: Path,
    *,
    columns: list[str],
    workers: int,
    dask_address: str | None,
) -> ContentScores:
    """SemDeDup over the view (`parts`, in priority order; `columns`: its columns) for the
    rows at positions from `first_new`: each row's cluster (the centroids fitted once and kept
    in `<catalog>/content-centroids/`) and whether another row-local rule rejects it (such a
    row is no row's original), then one task per cluster that has new rows. Writes the
    duplicates found to `out` (uid, semantic_duplicate_of, semantic_similarity).

    Raises:
        RuntimeError: a row of the view has no stored embedding.
    """
    total = sum(p.rows for p in parts)
    if rules.semantic_duplicate_similarity is None or total <= first_new:
        return scores  # no rule, or no row to check: nothing found
    catalog = Path(scores.catalog)
    images_t = store.table_dir(catalog, store.IMAGES)
    centroids = _centroids(catalog, parts, rules, scores.clip, images_t, total, first_new)
    work = out.with_suffix(".clusters")
    shutil.rmtree(work, ignore_errors=True)
    todo: set[int] = set()  # the clusters that hold a new row, filled as the rows are written
    pads.write_dataset(
        _cluster_batches(parts, columns, first_new, rules, scores, centroids, todo),
        work,
        schema=_CLUSTER_SCHEMA,
        format="parquet",
        partitioning=pads.partitioning(pa.schema([("cluster", pa.int32())]), flavor="hive"),
        existing_data_behavior="overwrite_or_ignore",
        max_partitions=len(centroids) + 1,  # pyarrow's default stops at 1,024 clusters
    )
    hits = _search_clusters(work, sorted(todo), first_new, rules, workers, dask_address)
    shutil.rmtree(work, ignore_errors=True)
    hits.to_parquet(out, index=False)
    task_logger(__name__).info(
        "content: %d semantic duplicates among %d rows checked (%d clusters searched of %d)",
        len(hits),
        total - first_new,
        len(todo),
        len(centroids),
    )
    return ContentScores(scores.catalog, scores.clip, str(out))


# One row of the view per record, written partitioned by its cluster.
_CLUSTER_SCHEMA = pa.schema(
    [
        ("cluster", pa.int32()),
        ("pos", pa.int64()),
        ("uid", pa.string()),
        ("sha256", pa.string()),
        ("eligible", pa.bool_()),
        ("embedding", pa.list_(pa.float32())),
    ]
)


def _cluster_batches(
    parts: list[ViewPart],
    columns: list[str],
    first_new: int,
    rules: QualityConfig,
    scores: ContentScores,
    centroids: np.ndarray,
    todo: set[int],
):
    """The view's rows, one row group at a time, as `_CLUSTER_SCHEMA` batches: each row's
    cluster, its position, its embedding and whether the other row-local rules keep it (a
    rejected row is no row's original). Adds to `todo` the clusters of the rows from
    `first_new` on."""
    images_t = store.table_dir(Path(scores.catalog), store.IMAGES)
    others = rules.model_copy(update={"semantic_duplicate_similarity": None})
    plain = ContentScores(scores.catalog, scores.clip, None)
    pos = 0
    for p in parts:
        for g in range(p.row_groups):
            df = content_columns(read_part(p, columns, [g]), others, plain)
            got = store.read(images_t, scores.clip, df["sha256"])
            at = pd.Index(got["key"]).get_indexer(df["sha256"])
            if (at < 0).any():
                raise RuntimeError(
                    f"content store has no CLIP image embedding ({scores.clip}) for "
                    f"{int((at < 0).sum())} rows of {p.path}: score_content must embed "
                    "every row of the view first"
                )
            emb = got.attrs["embedding"][at]
            eligible = np.ones(len(df), bool)
            rejected = check_rows(df, others, gx_check=False, hashes=False).rejected
            eligible[rejected["pos"].to_numpy(np.int64)] = False
            cl = semdedup.assign(emb, centroids)
            positions = np.arange(pos, pos + len(df))
            todo.update(cl[positions >= first_new].tolist())
            pos += len(df)
            uid = df["source"].astype(str).str.rstrip("/") + "/" + df["key"].astype(str)
            yield pa.record_batch(
                {
                    "cluster": pa.array(cl, pa.int32()),
                    "pos": pa.array(positions, pa.int64()),
                    "uid": pa.array(uid.tolist(), pa.string()),
                    "sha256": pa.array(df["sha256"].tolist(), pa.string()),
                    "eligible": pa.array(eligible, pa.bool_()),
                    "embedding": pa.array(list(emb), pa.list_(pa.float32())),
                }
            )


def _search_clusters(
    work: Path,
    clusters: list[int],
    first_new: int,
    rules: QualityConfig,
    workers: int,
    dask_address: str | None,
) -> pd.DataFrame:
    """One `cluster_task` per cluster in `clusters` (its rows under `work`), on the
    partition runner; their duplicates in one frame."""
    with partition_runner(workers, dask_address) as runner:
        futures = [
            runner.submit(
                cluster_task,
                {
                    "folder": str(work / f"cluster={c}"),
                    "first_new": first_new,
                    "similarity": rules.semantic_duplicate_similarity,
                },
            )
            for c in clusters
        ]
        found = [f.result() for f in futures]
    if not found:
        return pd.DataFrame({"uid": [], "semantic_duplicate_of": [], "semantic_similarity": []})
    return pd.concat(found, ignore_index=True)


def _centroids(catalog, parts, rules, scorer, images_t, total, first_new) -> np.ndarray:
    """The kept centroids for `scorer`, or new ones fitted on a sample of the view's images
    when there are none, when k changed, or when the view has grown past 4x the rows they
    were fitted on and no earlier verdict is kept (`first_new` 0)."""
    folder = catalog / "content-centroids"
    path, meta_path = folder / f"{scorer}.npy", folder / f"{scorer}.json"
    k = rules.semantic_clusters or semdedup.default_clusters(total)
    if path.is_file() and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        same_k = meta["k"] == min(k, meta["rows"]) or rules.semantic_clusters is None
        if same_k and (first_new > 0 or total <= 4 * meta["rows"]):
            return np.load(path)
    rng = np.random.default_rng(0)
    want = semdedup.SAMPLE_PER_CLUSTER * k
    keys = []
    for p in parts:
        df = read_part(p, ["sha256"])
        take = min(len(df), max(1, int(want * len(df) / max(total, 1))))
        keys.append(df["sha256"].to_numpy(object)[rng.choice(len(df), take, replace=False)])
    sample = store.read(images_t, scorer, np.concatenate(keys) if keys else [])
    emb = sample.attrs["embedding"]
    if emb is None or not len(emb):
        raise RuntimeError(f"no CLIP embeddings ({scorer}) stored for the view's images")
    centroids = semdedup.fit_centroids(emb, k)
    folder.mkdir(parents=True, exist_ok=True)
    np.save(path, centroids)
    meta_path.write_text(json.dumps({"k": len(centroids), "rows": total}))
    return centroids
