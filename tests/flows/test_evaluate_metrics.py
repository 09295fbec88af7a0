"""Contact sheets, CLIP score and FID of `kiln evaluate`, offline: a tiny random CLIP model saved
to a folder and a tiny random FID feature extractor, checked against direct computations."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
import scipy.linalg
import torch
from PIL import Image

from kiln_config import (
    EvalMetricsConfig,
    EvaluateConfig,
    LaunchConfig,
    load_config,
)
from models.evaluation.image_metrics import (
    clip_score,
    fid,
    files_sha256,
    load_clip,
    load_inception,
)
from tasks.evaluation.contact_sheet import THUMB, write_contact_sheets
from tasks.evaluation.study_metrics import compute_study_metrics, metrics_report
from tests.content_fixtures import tiny_clip

REPO = Path(__file__).resolve().parents[2]

# -- tiny components -------------------------------------------------------------------------


class TinyFeatures(torch.nn.Module):
    """A random FID feature extractor: uint8 images of any size -> 6 features."""

    num_features = 6

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.conv = torch.nn.Conv2d(3, 6, 3)
        self.head = torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x.float() / 127.5 - 1)).mean(dim=(2, 3))
        return self.head(h)


def _direct_clip(folder: Path, images: list[Image.Image], prompts: list[str]) -> float:
    """100 * cos(image, prompt embedding), averaged, clamped at 0, straight from transformers."""
    from transformers import CLIPModel, CLIPProcessor

    model, proc = CLIPModel.from_pretrained(folder), CLIPProcessor.from_pretrained(folder)
    with torch.no_grad():
        img = model.get_image_features(proc(images=images, return_tensors="pt")["pixel_values"])
        txt = proc(text=prompts, return_tensors="pt", padding=True)
        txt = model.get_text_features(txt["input_ids"], txt["attention_mask"])
    cos = torch.nn.functional.cosine_similarity(img, txt)
    return max(100 * cos.mean().item(), 0.0)


def _direct_fid(feature: torch.nn.Module, real: list[torch.Tensor], fake: list[torch.Tensor]):
    """FID by the book: means and covariances of the features, scipy's matrix square root."""
    with torch.no_grad():
        fr = np.stack([feature(x[None]).double().numpy()[0] for x in real])
        ff = np.stack([feature(x[None]).double().numpy()[0] for x in fake])
    mu_r, mu_f = fr.mean(0), ff.mean(0)
    cov_r, cov_f = np.cov(fr, rowvar=False), np.cov(ff, rowvar=False)
    covmean = scipy.linalg.sqrtm(cov_r @ cov_f).real
    return float(((mu_r - mu_f) ** 2).sum() + np.trace(cov_r + cov_f - 2 * covmean))


def _random_images(n: int, size: tuple[int, int], seed: int) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)) for _ in range(n)]


# -- unit tests ------------------------------------------------------------------------------


def test_clip_score_matches_a_direct_computation(tmp_path):
    folder = tiny_clip(tmp_path / "clip")
    images = _random_images(5, (40, 48), seed=0)
    prompts = [f"a red circle above {i} blue squares" for i in range(5)]
    model, processor = load_clip(str(folder))
    pairs = [
        (torch.from_numpy(np.array(im)).permute(2, 0, 1), p)
        for im, p in zip(images, prompts, strict=True)
    ]
    ours = clip_score(iter(pairs), model, processor, batch_size=2)
    direct = _direct_clip(folder, images, prompts)
    assert direct > 0, "a clamped 0 would not test the computation"
    assert ours == pytest.approx(direct, abs=1e-4)
    digest = files_sha256(folder)
    weights = (folder / "model.safetensors").read_bytes()
    assert digest["files"]["model.safetensors"] == hashlib.sha256(weights).hexdigest()
    assert len(digest["sha256"]) == 64


def test_fid_matches_scipy_sqrtm(tmp_path):
    feature = TinyFeatures()
    g = torch.Generator().manual_seed(0)
    # Two sizes in each set: batched by size, fed to the same extractor.
    real = [torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8, generator=g) for _ in range(9)]
    real += [torch.randint(0, 200, (3, 24, 40), dtype=torch.uint8, generator=g) for _ in range(4)]
    fake = [torch.randint(50, 256, (3, 64, 64), dtype=torch.uint8, generator=g) for _ in range(12)]
    ours = fid(iter(real), iter(fake), feature, batch_size=4)
    direct = _direct_fid(feature, real, fake)
    assert direct > 0.01
    assert ours == pytest.approx(direct, rel=1e-4)
    assert fid(iter(real), iter(real), feature) == pytest.approx(0.0, abs=1e-6)


def test_missing_weights_skip_each_metric_with_the_fix_named(tmp_path):
    from models.evaluation.image_metrics import MetricUnavailable

    with pytest.raises(MetricUnavailable, match="evaluate.metrics.clip_model: no folder"):
        load_clip(str(tmp_path / "no-clip"))
    with pytest.raises(MetricUnavailable, match="evaluate.metrics.inception_weights: no file"):
        load_inception(str(tmp_path / "no-inception.pth"))

    study = tmp_path / "study"
    (study / "images").mkdir(parents=True)
    _random_images(1, (16, 16), seed=0)[0].save(study / "images" / "0000-s0.png")
    items = [
        {
            "index": 0,
            "prompt": "a red circle",
            "category": "Colors",
            "seed": 0,
            "path": "images/0000-s0.png",
        }
    ]
    cfg = EvalMetricsConfig(
        clip_model=str(tmp_path / "no-clip"), inception_weights=str(tmp_path / "no.pth")
    )
    result = compute_study_metrics.fn(str(study), items, cfg, str(tmp_path / "val"), {})
    assert "no folder at" in result["clip_score"]["skipped"]
    assert "no file at" in result["fid"]["skipped"]
    assert json.loads((study / "metrics.json").read_text()) == result
    unset = compute_study_metrics.fn(str(study), items, EvalMetricsConfig(), "", {})
    assert "clip_model is not set" in unset["clip_score"]["skipped"]
    assert "inception_weights is not set" in unset["fid"]["skipped"]
    report = metrics_report(result, {}, None)
    assert f"| CLIP score | skipped: {result['clip_score']['skipped']}" in report
    assert f"| FID | skipped: {result['fid']['skipped']}" in report


def test_contact_sheet_per_category_with_every_seed(tmp_path):
    study = tmp_path / "study"
    (study / "images").mkdir(parents=True)
    rows = [("a red circle", "Colors"), ("two cats", "Counting"), ("a blue square", "Colors")]
    items = []
    for i, (prompt, cat) in enumerate(rows):
        for seed in (0, 1):
            path = f"images/{i:04d}-s{seed}.png"
            Image.new("RGB", (64, 64), (250, 10 + 100 * seed, 10)).save(study / path)
            items.append(
                {"index": i, "prompt": prompt, "category": cat, "seed": seed, "path": path}
            )
    sheets = write_contact_sheets(study, items)
    assert {c: p.name for c, p in sheets.items()} == {
        "Colors": "colors.png",
        "Counting": "counting.png",
    }
    with Image.open(sheets["Colors"]) as img:
        assert img.width >= 2 * 2 * THUMB, "two prompts side by side, two seeds each"
        px = np.asarray(img.convert("RGB"))
    # Both seeds' thumbnails are on the sheet (their colours), and text is drawn (black).
    assert (np.abs(px - [250, 10, 10]).sum(-1) < 30).sum() >= 2 * THUMB * THUMB
    assert (np.abs(px - [250, 110, 10]).sum(-1) < 30).sum() >= 2 * THUMB * THUMB
    assert (px.sum(-1) < 100).any()


# -- the real flow ---------------------------------------------------------------------------

ONE_STAGE = {
    "train.stages": [{"resolution": 32, "batch_size": 4, "learning_rate": 1e-3, "max_steps": 2}],
    "launch.health_check": False,
    "launch.max_restarts": 0,
    "evaluate.limit": 4,
    "evaluate.num_inference_steps": 1,
    "evaluate.batch_size": 4,
}


def _root_with_val_split(tmp_path: Path, tiny_shards, n_val: int = 8) -> tuple[Path, str]:
    """A fresh root seeing the session's catalog and shards, plus a 32 px validation split
    (the shard step's own when it wrote one; else written here with the shards' columns)."""
    from streaming import MDSWriter, StreamingDataset

    from tasks.shards.write import MDS_COLUMNS

    _, shared, version = tiny_shards
    root = tmp_path / "root"
    (root / "shards" / version).mkdir(parents=True)
    (root / "catalog").symlink_to(shared / "catalog")
    (shared / "vae").mkdir(exist_ok=True)
    (root / "vae").symlink_to(shared / "vae")  # the tiny preset's VAE, fitted once per session
    for p in (shared / "shards").iterdir():
        if p.name != version:
            (root / "shards" / p.name).symlink_to(p)
    for p in (shared / "shards" / version).iterdir():
        (root / "shards" / version / p.name).symlink_to(p)
    val = root / "shards" / version / "32-val"
    if not val.exists():  # held-out stand-ins: training images the model saw for 2 steps only
        train = StreamingDataset(local=str(shared / "shards" / version / "32"), batch_size=1)
        with MDSWriter(out=str(val), columns=MDS_COLUMNS) as w:
            for i in range(n_val):
                s = train[i]
                w.write({k: s[k] for k in MDS_COLUMNS})
    return root, version


@pytest.mark.integration
def test_evaluate_writes_contact_sheets_and_logs_clip_score(
    tmp_path, tiny_shards, demo_src, make_config
):
    from mlflow.tracking import MlflowClient
    from prefect.artifacts import Artifact

    from flows.evaluate import evaluate_flow
    from flows.register import register_flow
    from flows.train import train_flow

    root, version = _root_with_val_split(tmp_path, tiny_shards)
    clip = tiny_clip(tmp_path / "clip")
    missing = tmp_path / "no-inception.pth"
    cfg = make_config(
        tmp_path / "c.yaml",
        root,
        demo_src,
        **ONE_STAGE,
        **{"evaluate.metrics": {"clip_model": str(clip), "inception_weights": str(missing)}},
    )
    record = train_flow(load_config(cfg, root=str(root)), dataset_version=version)
    out = evaluate_flow(load_config(cfg, root=str(root)), run_id=record["run_id"])

    study = Path(out["path"])
    items = json.loads((study / "study.json").read_text())["items"]
    cats = {it["category"] for it in items}
    assert set(out["contact_sheets"]) == cats and len(cats) >= 2
    assert all(
        Path(p).is_file() and Path(p).parent == study / "contact"
        for p in out["contact_sheets"].values()
    )

    images = [Image.open(study / it["path"]).convert("RGB") for it in items]
    direct = _direct_clip(clip, images, [it["prompt"] for it in items])
    cs = out["metrics"]["clip_score"]
    assert cs["value"] == pytest.approx(direct, abs=1e-3)
    assert cs["sha256"] == files_sha256(clip)["sha256"] and "bicubic" in cs["resize"]
    assert f"no file at {missing}" in out["metrics"]["fid"]["skipped"]

    md = Artifact.get("evaluation-study").data
    assert "contact/" in md and "| FID | skipped: " in md and "| CLIP score | " in md
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    run = client.get_run(record["mlflow_run_id"])
    assert run.data.metrics["eval/clip_score"] == pytest.approx(cs["value"])
    assert run.data.tags["kiln.eval.clip_score_sha256"] == cs["sha256"]
    assert "no file at" in run.data.tags["kiln.eval.fid_skipped"]
    logged = {a.path for a in client.list_artifacts(run.info.run_id, f"eval/{study.name}/contact")}
    assert logged == {
        f"eval/{study.name}/contact/{Path(p).name}" for p in out["contact_sheets"].values()
    }

    # FID through the same task, with a tiny feature extractor in place of InceptionV3: the
    # validation split against images generated from its captions by the run's export.
    settings = {
        "evaluate": EvaluateConfig(seeds=[0], num_inference_steps=1, batch_size=8),
        "launch": LaunchConfig(
            accelerate_config=str(REPO / "configs" / "accelerate" / "single.yaml"), gpu_limit=None
        ),
    }
    val_dir = root / "shards" / version / "32-val"
    feature = TinyFeatures()
    metrics = compute_study_metrics.fn(
        str(study),
        items,
        EvalMetricsConfig(clip_model=str(clip), fid_max_images=6),
        str(val_dir),
        {"pipeline": record["export"], "settings": settings},
        fid_feature=feature,
    )
    from streaming import StreamingDataset

    ds = StreamingDataset(local=str(val_dir), batch_size=1, shuffle=False)
    real = [
        torch.from_numpy(
            np.asarray(Image.open(io.BytesIO(ds[i]["image"])).convert("RGB")).copy()
        ).permute(2, 0, 1)
        for i in range(6)
    ]
    gen = json.loads((study / "fid" / "study.json").read_text())["items"]
    assert [it["prompt"] for it in gen] == [ds[i]["caption"] for i in range(6)]
    fake = [
        torch.from_numpy(
            np.asarray(Image.open(study / "fid" / it["path"]).convert("RGB")).copy()
        ).permute(2, 0, 1)
        for it in gen
    ]
    assert metrics["fid"]["images"] == 6
    assert metrics["fid"]["value"] == pytest.approx(_direct_fid(feature, real, fake), rel=1e-4)

    info = register_flow(
        load_config(cfg, root=str(root)), run_id=record["run_id"], study_id=study.name
    )
    version_tags = client.get_model_version(info["name"], info["version"]).tags
    assert version_tags["study_id"] == study.name
    for name in ("clip_score", "fid"):  # 6 significant digits in a tag
        assert float(version_tags[f"eval.{name}"]) == pytest.approx(metrics[name]["value"], 1e-5)
    assert (
        f"fid {version_tags['eval.fid']}"
        in client.get_model_version(info["name"], info["version"]).description
    )
