"""The content rules through `kiln validate`'s task: the packaged unsafe detector and language
models on a small labelled set, and the CLIP rules with a random CLIP saved to a local folder
(the real loading code and accelerate launch), on pictures with planted near-copies."""

import numpy as np
import pandas as pd
import pytest
import torch
from deltalake import DeltaTable
from distributed import LocalCluster
from safetensors.torch import save_file

from data_quality.content import language, store, unsafe
from kiln_config import IngestConfig, LaunchConfig, QualityConfig
from kiln_config.errors import InputError
from tasks.catalog.admin import show
from tasks.catalog.view import read_view
from tasks.ingest.run import ingest_source
from tasks.quality.content import ContentScores, clip_scorer, content_columns
from tasks.quality.validate import validate_catalog
from tasks.storage.layout import Layout
from tests.content_fixtures import near_copies, palette_image, tiny_clip, write_source

LAUNCH = LaunchConfig(accelerate_config="configs/accelerate/single.yaml", gpu_limit=None)


def _quarantine(root, ingest_id) -> dict:
    q = pd.read_parquet(root / "quality" / ingest_id / "quarantine.parquet")
    return dict(zip(q["key"], q["reason"], strict=True))


def _rows(root, table: str) -> int:
    path = root / "catalog" / "tables" / table
    return len(store.read(path, unsafe.SCORER)) + len(store.read(path, language.scorer(["en"])))


def test_unsafe_and_language_rules_with_the_packaged_models(tmp_path):
    """Both offline rules through validate. The content store starts as an older Kiln left it,
    with the top language alone for two captions: validate adds their allowed-language rows and
    no second top-language row. A row without a caption fails as missing, not inside the
    language rule; two words of names pass."""
    captions = {
        "en-0": "a red square on a white background, studio photo",
        "en-1": "a green field under a bright sky with a few clouds",
        "en-2": "a blue wall painted with a soft gradient of light",
        "short": "a cat",  # ambiguous: undetermined, passes
        "de": "eine gelbe Wand im Licht der untergehenden Sonne",
        "es": "una pared amarilla bajo la luz del sol de la tarde",
        "fr": "un mur violet dans la lumière douce du matin",
        "en-3": "a black and white photograph of an empty room",
        "flag": "finland flag",  # read as Swedish, but two words of names: passes
        "none": None,
    }
    src = write_source(
        tmp_path / "src",
        [(name, palette_image(i), cap) for i, (name, cap) in enumerate(captions.items())],
    )
    root = tmp_path / "root"
    ing = ingest_source(IngestConfig(source=str(src), workers=1), str(root))
    rules = QualityConfig(max_unsafe=1.0, allowed_languages=["en"], max_reject_fraction=0.9)
    table = root / "catalog" / "tables" / "content_captions"
    old = [captions["en-0"], captions["de"]]
    code, conf, _ = language.detect(old, ["en"])
    store.append(table, store.caption_keys(old), language.scorer(["en"]), scores=conf, labels=code)
    res = validate_catalog.fn(str(root), ing.ingest_id, rules)
    reasons = _quarantine(root, ing.ingest_id)
    assert {k: v for k, v in reasons.items()} == {
        "de.png": "caption_language",
        "es.png": "caption_language",
        "fr.png": "caption_language",
        "none.png": "caption_missing",
    }
    per = DeltaTable(str(table)).to_pandas(columns=["key", "scorer"]).groupby("scorer")["key"]
    n = len([c for c in captions.values() if c])
    assert per.count()[language.scorer(["en"])] == n, "no top-language row twice"
    assert per.nunique()[language.allowed_scorer(["en"])] == n
    shown = show(str(root))
    assert shown["rejected_by_reason"] == {"caption_language": 3, "caption_missing": 1}
    assert shown["rejects"]["caption_language"] == [
        {"key": f"{lang}.png", "detail": f"caption_language={lang!r}"}
        for lang in ("de", "es", "fr")
    ], "each rule's rejects, with the value that failed"
    kinds = {e["reason"] for e in res.expectations}
    assert {"unsafe", "caption_language"} <= kinds
    assert "caption_not_ascii" not in kinds, "the language rule replaces the ASCII heuristic"

    # Scores are stored once per image hash and caption; every image passed at 1.0. Set the
    # threshold just under the highest score: that image alone goes, with no score recomputed.
    view = read_view(Layout(root), ing.ingest_id)[0]
    got = store.read(root / "catalog/tables/content_images", unsafe.SCORER, view["sha256"])
    assert len(got) == len(view) and got["score"].between(0, 1).all()
    worst = got.loc[got["score"].idxmax()]
    stored = _rows(root, "content_images") + _rows(root, "content_captions")
    stricter = rules.model_copy(update={"max_unsafe": float(worst["score"]) - 1e-6})
    res = validate_catalog.fn(str(root), ing.ingest_id, stricter)
    flagged = view.loc[view["sha256"] == worst["key"], "key"].item()
    assert _quarantine(root, ing.ingest_id)[flagged] == "unsafe"
    assert _rows(root, "content_images") + _rows(root, "content_captions") == stored
    assert res.reasons["unsafe"] == 1


def test_clip_rules_group_planted_near_copies_and_score_alignment(tmp_path):
    clip = tiny_clip(tmp_path / "clip")
    head = tmp_path / "aesthetic.safetensors"
    torch.manual_seed(1)
    save_file({"weight": torch.randn(1, 16), "bias": torch.tensor([5.0])}, head)
    originals = [
        (f"orig-{i}", palette_image(i), f"a shaded colour field number {i}") for i in range(6)
    ]
    copies = [
        (f"z-copy-{i}-{kind}", img, f"a shaded colour field number {i}, {kind}")
        for i in (0, 1)
        for kind, img in near_copies(palette_image(i)).items()
    ]
    # One row brings its own aesthetic score: it wins over the head's; the others get the head's.
    src = write_source(tmp_path / "src", originals + copies, {"orig-5": {"aesthetic": 9.5}})
    root = tmp_path / "root"
    ingest = IngestConfig(source=str(src), workers=1, metadata_columns=["aesthetic"])
    ing = ingest_source(ingest, str(root))
    rules = QualityConfig(
        clip_model=str(clip),
        min_clip_score=-1.0,
        semantic_duplicate_similarity=0.99,
        semantic_clusters=2,
        aesthetic_head=str(head),
        min_aesthetic=-100.0,
        max_reject_fraction=0.9,
    )
    validate_catalog.fn(str(root), ing.ingest_id, rules, launch=LAUNCH)
    q = pd.read_parquet(root / "quality" / ing.ingest_id / "quarantine.parquet")
    semantic = q[q["reason"] == "semantic_duplicate"]
    # Of each group the earliest in the catalog's order (ingest, then key) stays: the originals.
    assert set(semantic["key"]) == {f"{name}.png" for name, _, _ in copies}
    for key, detail in zip(semantic["key"], semantic["detail"], strict=True):
        original = f"orig-{key.split('-')[2]}.png"
        assert detail.endswith(f"/{original}'"), (key, detail)

    # The scores are stored: the CLIP score and the aesthetic head re-decide from them.
    scorer = clip_scorer(str(clip))
    view = read_view(Layout(root), ing.ingest_id)[0]
    joined = content_columns(view, rules, ContentScores(str(root / "catalog"), scorer, None))
    aesthetic = dict(zip(joined["key"], joined["aesthetic"], strict=True))
    assert aesthetic["orig-5.png"] == 9.5
    assert all(np.isfinite(v) and v != 9.5 for k, v in aesthetic.items() if k != "orig-5.png")
    images = store.read(root / "catalog/tables/content_images", scorer)
    captions = store.read(root / "catalog/tables/content_captions", scorer)
    assert len(images) == 12 and images.attrs["embedding"].shape == (12, 16)
    assert len(captions) == 12
    norms = np.linalg.norm(images.attrs["embedding"], axis=1)
    assert np.allclose(norms, 1, atol=1e-4)
    sample = pd.read_parquet(root / "catalog" / ing.ingest_id / "docs_sample.parquet")
    scores = sample["clip_score"].dropna()
    assert len(scores) and scores.between(-1, 1).all()
    median = float(np.median(scores))
    strict = rules.model_copy(
        update={"min_clip_score": median, "semantic_duplicate_similarity": None}
    )
    res = validate_catalog.fn(str(root), ing.ingest_id, strict, launch=LAUNCH)
    assert res.reasons.get("low_clip_score", 0) >= 1
    assert len(store.read(root / "catalog/tables/content_images", scorer)) == 12

    # An incremental ingest: a new near-copy joins its original's group against the kept
    # centroids, a new distinct picture does not.
    write_source(
        src,
        [
            ("late-copy", near_copies(palette_image(3))["jpeg"], "a shaded colour field, again"),
            ("late-new", palette_image(7), "a shaded cyan colour field"),
        ],
    )
    ing2 = ingest_source(ingest, str(root))
    # SemDeDup's cluster tasks on a Dask cluster, as with execution.dask_address.
    with LocalCluster(
        n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None
    ) as cluster:
        validate_catalog.fn(
            str(root), ing2.ingest_id, rules, launch=LAUNCH, dask_address=cluster.scheduler_address
        )
        assert "cluster_task" in cluster.scheduler.task_prefixes, "SemDeDup ran on Dask"
    reasons = _quarantine(root, ing2.ingest_id)
    assert reasons["late-copy.png"] == "semantic_duplicate"
    assert "late-new.png" not in reasons


def test_clip_rules_name_what_is_missing(tmp_path):
    with pytest.raises(ValueError, match="set quality.clip_model"):
        QualityConfig(min_clip_score=0.28)
    with pytest.raises(ValueError, match="ISO 639-1"):
        QualityConfig(allowed_languages=["english"])
    with pytest.raises(InputError, match="no CLIP folder"):
        clip_scorer(str(tmp_path / "nowhere"))


def test_the_embedding_launch_resumes_by_batch(tmp_path):
    """A relaunch (models.embed_content, in-process here) writes only the batches missing."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from kiln_config import EmbedRun, write_run_file
    from models.embed_content import main

    def jpeg(i):
        buf = io.BytesIO()
        palette_image(i).save(buf, format="JPEG")
        return buf.getvalue()

    with pq.ParquetWriter(
        tmp_path / "images.parquet", pa.schema([("key", pa.string()), ("image", pa.binary())])
    ) as w:
        for i in range(3):  # one row group per batch, as validate's driver writes them
            w.write_table(pa.table({"key": [f"k{i}"], "image": [jpeg(i)]}))
    pd.DataFrame({"key": ["c0"], "caption": ["colour 0"]}).to_parquet(tmp_path / "caps.parquet")
    run = EmbedRun(
        clip_model=str(tiny_clip(tmp_path / "clip")),
        images=str(tmp_path / "images.parquet"),
        captions=str(tmp_path / "caps.parquet"),
        out_dir=str(tmp_path / "parts"),
        batch_size=1,
    )
    config = write_run_file(run, tmp_path / "embed.yaml")
    main(["--config", str(config)])
    parts = sorted((tmp_path / "parts").glob("*.parquet"))
    assert [p.name for p in parts] == [
        "captions-000000.parquet",
        *(f"images-{b:06d}.parquet" for b in range(3)),
    ]
    before = {p.name: p.stat().st_mtime_ns for p in parts}
    (tmp_path / "parts" / "images-000001.parquet").unlink()
    main(["--config", str(config)])
    after = {p.name: p.stat().st_mtime_ns for p in sorted((tmp_path / "parts").glob("*.parquet"))}
    assert after.keys() == before.keys()
    assert {n for n in after if after[n] != before[n]} == {"images-000001.parquet"}
    got = pq.read_table(tmp_path / "parts" / "images-000001.parquet")
    assert got["key"].to_pylist() == ["k1"] and len(got["embedding"][0]) == 16


def test_kiln_validate_names_missing_weights_before_it_starts(tmp_path, make_config):
    from kiln_config import ConfigError, load_config
    from tasks.inputs import check_inputs

    path = make_config(
        tmp_path / "c.yaml",
        tmp_path / "root",
        tmp_path,
        **{
            "quality.clip_model": str(tmp_path / "no-clip"),
            "quality.min_clip_score": 0.28,
            "quality.aesthetic_head": str(tmp_path / "no-head.pth"),
            "quality.allowed_languages": ["en", "xx"],
        },
    )
    with pytest.raises(ConfigError) as e:
        check_inputs(load_config(path), ("content",))
    msg = str(e.value)
    assert "quality.clip_model: no CLIP folder" in msg
    assert "quality.aesthetic_head: no file" in msg
    assert "Lingua has no language ['xx']" in msg
