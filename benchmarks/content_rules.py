"""The content rules' cost and effect: rows per second per rule, the embedder's images per
second, the share of rows each rule quarantines, and validate's CPU with and without them.

In one run, on this machine's CPU:

* per rule, rows per second of its scoring step: NudeNet's unsafe probability (read, decode,
  detector), Lingua's caption language, the CLIP score and the aesthetic head from stored
  embeddings, SemDeDup (faiss k-means and the within-cluster search) on random 512-d
  embeddings;
* the embedding step's images per second (models/embed_content.py's `embed_images`, one
  process) with the tests' tiny CLIP and with a ViT-B/32-sized one (transformers' default
  CLIPConfig: 12 layers, 768 wide, 224 px, patch 32), both with random weights;
* the share of rows each rule quarantines on the demo data (`kiln demo-data`) and on a
  corpus-style fixture: demo images with planted near-copies (crop, JPEG re-encode, colour
  shift) of 10% of them and 10% of captions in other languages, with configs/tiny.yaml's
  offline thresholds and the CLIP rules on the tiny random CLIP (its scores say nothing of
  alignment or beauty: those shares show the mechanism, not a real model's effect);
* the content store's append and read rates (Delta) for 512-d embeddings, against the
  embedder's rate;
* `validate_catalog`'s CPU-seconds (this process and its launches) with no content rule (the
  baseline), the offline rules, and all five, at two catalog sizes; the difference between
  the sizes gives the cost per million rows, free of the fixed costs (Great Expectations'
  context, Lingua's models, the launch).

    python benchmarks/content_rules.py --out benchmarks/results/content_rules.json
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import platform
import random
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # content_fixtures: the tests' tiny CLIP and copies

OTHER_LANGUAGES = [
    "una foto de un perro en la playa al atardecer",
    "ein rotes Auto vor einem alten Haus im Regen",
    "une tasse de café sur une table en bois",
    "un gatto che dorme sul divano vicino alla finestra",
    "een fiets tegen een muur in de zon",
]


def _cpu() -> float:
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _corpus(src: Path, n: int, seed: int) -> dict:
    """Demo images with planted near-copies and other-language captions (in place)."""
    from content_fixtures import near_copies
    from PIL import Image

    rng = random.Random(seed)
    lines = (src / "metadata.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in lines]
    good = [r for r in rows if r.get("text") and (src / r["file_name"]).is_file()]
    planted, foreign = 0, 0
    for r in rng.sample(good, n // 10):
        try:
            img = Image.open(src / r["file_name"]).convert("RGB")
        except OSError:
            continue
        kind, copy = rng.choice(sorted(near_copies(img).items()))
        name = f"zz-{kind}-{r['file_name']}".replace(".jpg", ".png")
        copy.save(src / name)
        rows.append({**r, "file_name": name})
        planted += 1
    for r in rng.sample(good, n // 10):
        r["text"] = rng.choice(OTHER_LANGUAGES)
        foreign += 1
    (src / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"planted_near_copies": planted, "other_language_captions": foreign}


def _validate(root: Path, src: Path, rules, launch) -> dict:
    from kiln_config import IngestConfig
    from tasks.ingest.run import ingest_source
    from tasks.quality.validate import validate_catalog

    shutil.rmtree(root, ignore_errors=True)
    ing = ingest_source(IngestConfig(source=str(src), workers=2), str(root))
    cpu, t0 = _cpu(), time.perf_counter()
    res = validate_catalog.fn(str(root), ing.ingest_id, rules, launch=launch, workers=2)
    return {
        "rows": res.listed,
        "cpu_s": round(_cpu() - cpu, 2),
        "wall_s": round(time.perf_counter() - t0, 2),
        # every row each expectation fails (a row is quarantined under its first reason)
        "unexpected": {e["reason"]: e["unexpected"] for e in res.expectations},
        "quarantined": dict(sorted(res.reasons.items())),
    }


def _rule_rates(src: Path, clip_folder: Path) -> dict:
    from PIL import Image

    from data_quality.content import language, semdedup, unsafe
    from data_quality.content.clip import AestheticHead, clip_scores

    files = sorted(src.glob("*.jpg"))[:200]
    captions = [
        json.loads(x).get("text") or "" for x in (src / "metadata.jsonl").read_text().splitlines()
    ]
    det = unsafe.detector()
    t0 = time.perf_counter()
    images = [Image.open(io.BytesIO(f.read_bytes())).convert("RGB") for f in files]
    det.scores(images)
    out = {"unsafe_rows_per_s": round(len(files) / (time.perf_counter() - t0), 1)}
    language.detect(captions[:10])  # the models' load, once per process
    caps = (captions * (20_000 // max(1, len(captions)) + 1))[:20_000]
    t0 = time.perf_counter()
    language.detect(caps)
    out["language_rows_per_s"] = round(len(caps) / (time.perf_counter() - t0), 1)
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(200_000, 512)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    t0 = time.perf_counter()
    clip_scores(emb, emb[::-1].copy())
    out["clip_score_rows_per_s"] = round(len(emb) / (time.perf_counter() - t0), 1)
    head = AestheticHead(rng.normal(size=512).astype(np.float32), 5.0)
    t0 = time.perf_counter()
    head.scores(emb)
    out["aesthetic_rows_per_s"] = round(len(emb) / (time.perf_counter() - t0), 1)
    n = 100_000
    t0 = time.perf_counter()
    k = semdedup.default_clusters(n)
    cent = semdedup.fit_centroids(emb[:n], k)
    cl = semdedup.assign(emb[:n], cent)
    order = np.argsort(cl, kind="stable")
    for c in np.unique(cl):
        at = order[cl[order] == c]
        semdedup.cluster_duplicates(emb[at], at, 0, 0.95)
    out["semdedup_rows_per_s"] = round(n / (time.perf_counter() - t0), 1)
    out["semdedup_clusters"] = int(k)
    return out


def _store_rates(work: Path, rows: int = 200_000, dim: int = 512) -> dict:
    """The content store's cost: append `rows` 512-d embeddings (in commits of 50,000, as
    validate does), then read a partition's worth (65,536 keys) by the filtered scan that
    each check partition runs, and every row."""
    from data_quality.content import store

    rng = np.random.default_rng(0)
    path = work / "store-bench"
    keys = np.array([f"{i:064x}" for i in range(rows)], dtype=object)
    emb = rng.normal(size=(rows, dim)).astype(np.float32)
    t0 = time.perf_counter()
    for s in range(0, rows, 50_000):
        store.append(path, keys[s : s + 50_000], "bench", embeddings=emb[s : s + 50_000])
    out = {"append_rows_per_s": round(rows / (time.perf_counter() - t0))}
    want = rng.choice(keys, min(rows, 65_536), replace=False)
    t0 = time.perf_counter()
    got = store.read(path, "bench", want)
    assert len(got) == len(want)
    out["filtered_read_rows_per_s"] = round(len(want) / (time.perf_counter() - t0))
    t0 = time.perf_counter()
    got = store.read(path, "bench")
    out["full_read_rows_per_s"] = round(rows / (time.perf_counter() - t0))
    out["rows"], out["dim"] = rows, dim
    shutil.rmtree(path, ignore_errors=True)
    return out


def _embed_rates(clip_folder: Path) -> dict:
    import torch
    from PIL import Image
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from models.embed_content import embed_images
    from models.evaluation.image_metrics import load_clip

    images = [Image.new("RGB", (256, 256), (i, 255 - i, 128)) for i in range(64)]
    out = {}
    tiny, tiny_proc = load_clip(str(clip_folder))
    torch.manual_seed(0)
    b32 = CLIPModel(CLIPConfig()).eval()
    _, proc = load_clip(str(clip_folder))
    b32_proc = CLIPProcessor(image_processor=CLIPImageProcessor(), tokenizer=proc.tokenizer)
    for name, model, processor in (("tiny", tiny, tiny_proc), ("vit_b32", b32, b32_proc)):
        embed_images(model, processor, images[:4])  # warm-up
        t0 = time.perf_counter()
        for s in range(0, len(images), 32):
            embed_images(model, processor, images[s : s + 32])
        out[f"{name}_img_per_s"] = round(len(images) / (time.perf_counter() - t0), 1)
    out["threads"] = torch.get_num_threads()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/content_rules.json")
    p.add_argument("--small", type=int, default=400, help="Rows of the smaller catalog.")
    p.add_argument("--large", type=int, default=1600, help="Rows of the larger catalog.")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from content_fixtures import tiny_clip
    from prefect.testing.utilities import prefect_test_harness
    from safetensors.torch import save_file

    from kiln_config import LaunchConfig, load_config
    from kiln_demo.data import write_demo_dataset

    work = Path(tempfile.mkdtemp(prefix="kiln-content-bench-"))
    clip = tiny_clip(work / "clip")
    import torch

    torch.manual_seed(0)
    save_file(
        {"weight": torch.randn(1, 16) * 0.1, "bias": torch.tensor([5.0])}, work / "head.safetensors"
    )
    tiny = load_config(REPO / "configs" / "tiny.yaml").quality
    none = tiny.model_copy(
        update={"max_unsafe": None, "allowed_languages": None, "max_reject_fraction": 1.0}
    )
    offline = tiny.model_copy(update={"max_reject_fraction": 1.0})
    every = offline.model_copy(
        update={
            "clip_model": str(clip),
            "min_clip_score": 0.0,
            "aesthetic_head": str(work / "head.safetensors"),
            "min_aesthetic": 5.0,
            "semantic_duplicate_similarity": 0.95,
        }
    )
    launch = LaunchConfig(
        accelerate_config=str(REPO / "configs/accelerate/single.yaml"), gpu_limit=None
    )
    result = {
        "machine": {"python": platform.python_version(), "cpus": __import__("os").cpu_count()},
        "settings": {"small": args.small, "large": args.large},
    }
    with prefect_test_harness():
        # One validate of each kind first: the process's one-time costs (Great Expectations'
        # import and context, Lingua's and NudeNet's models) stay out of the measured runs.
        warm = work / "demo-warm"
        write_demo_dataset(warm, n=40, seed=2)
        for rules in (none, offline, every):
            _validate(work / "root-warm", warm, rules, launch)
        sizes = {}
        for n in (args.small, args.large):
            src = work / f"demo-{n}"
            write_demo_dataset(src, n=n, seed=0)
            sizes[n] = {
                name: _validate(work / f"root-{n}-{name}", src, rules, launch)
                for name, rules in (("none", none), ("offline", offline), ("all", every))
            }
        result["validate"] = sizes
        small, large = sizes[args.small], sizes[args.large]
        rows = large["none"]["rows"] - small["none"]["rows"]
        result["cpu_s_per_million_rows"] = {
            name: round((large[name]["cpu_s"] - small[name]["cpu_s"]) / rows * 1e6)
            for name in ("none", "offline", "all")
        }
        corpus = work / "corpus"
        write_demo_dataset(corpus, n=args.small, seed=1)
        result["corpus_fixture"] = _corpus(corpus, args.small, seed=1)
        result["corpus"] = _validate(work / "root-corpus", corpus, every, launch)
        result["rules"] = _rule_rates(work / f"demo-{args.small}", clip)
        result["embedding"] = _embed_rates(clip)
        result["store"] = _store_rates(work)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
