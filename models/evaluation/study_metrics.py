"""CLIP score and FID of an evaluation study (`tasks.evaluation.study_metrics` runs them as a
task): each metric from its weights (`models.evaluation.image_metrics`), each skipped with the
reason when its weights are not configured, missing or unloadable.

FID compares the validation split of the model's final stage with images generated from the
same validation captions (the COCO-FID protocol); the caller generates them, in a process of
their own (`generate`), into `<study>/fid/`.
"""

from __future__ import annotations

import csv
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kiln_config import EvalMetricsConfig
from models.evaluation.image_metrics import (
    FID_RESIZE,
    MetricUnavailable,
    clip_resize,
    clip_score,
    decode_images,
    fid,
    files_sha256,
    hub_snapshot,
    images_as_uint8,
    load_clip,
    load_inception,
    read_val_split,
)

__all__ = ["study_metrics"]


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _clip(study_dir: Path, items: list[dict], name: str | None) -> dict:
    if not name:
        return {"skipped": "evaluate.metrics.clip_model is not set (a local CLIP folder or hub id)"}

    model, processor = load_clip(name)
    model.to(_device())
    images = images_as_uint8(study_dir / it["path"] for it in items)
    prompts = (it["prompt"] for it in items)
    value = clip_score(zip(images, prompts, strict=True), model, processor)
    local = Path(name).expanduser()
    files = local if local.is_dir() else hub_snapshot(name)
    digest = files_sha256(files) if files else {"sha256": None}
    return {
        "value": value,
        "images": len(items),
        "model": name,
        **digest,
        "resize": clip_resize(processor),
    }


def _write_captions(path: Path, captions: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["Prompts", "Category"])
        w.writerows([c, "validation"] for c in captions)


def _fid(
    study_dir: Path,
    cfg: EvalMetricsConfig,
    val_dir: Path,
    val_published: bool,
    generate: Callable[[Path, Path], dict],
    feature: torch.nn.Module | None,
) -> dict:
    if feature is not None:
        weights = {"weights": f"given module {type(feature).__name__}", "sha256": None}
        resize = "the given feature module's own"
    elif not cfg.inception_weights:
        return {"skipped": "evaluate.metrics.inception_weights is not set (a local .pth path)"}
    else:
        feature = load_inception(cfg.inception_weights)
        weights = {"weights": cfg.inception_weights, **files_sha256(cfg.inception_weights)}
        resize = FID_RESIZE
    if not val_published:
        raise MetricUnavailable(
            f"no validation split at {val_dir}; re-run `kiln shard` with shards.val_fraction > 0"
        )
    val = read_val_split(val_dir, cfg.fid_max_images)
    if len(val) < 2:
        raise MetricUnavailable(f"FID needs 2 or more validation images; {val_dir} has {len(val)}")
    out = study_dir / "fid"
    _write_captions(out / "prompts.csv", [s["caption"] for s in val])
    gen = generate(out / "prompts.csv", out)
    fake = images_as_uint8(out / it["path"] for it in gen["items"])
    # On the device only now: the generation subprocess had the GPU to itself.
    real = decode_images(s["image"] for s in val)
    value = fid(real, fake, feature.to(_device()))
    return {
        "value": value,
        "images": len(val),
        "real": str(val_dir),
        "generated": str(out),
        **weights,
        "resize": resize,
        "generated_resolution": gen["settings"]["resolution"],
    }


def study_metrics(
    study_dir: Path,
    items: list[dict],
    cfg: EvalMetricsConfig,
    val_dir: Path,
    val_published: bool,
    generate: Callable[[Path, Path], dict],
    fid_feature: torch.nn.Module | None = None,
    log: logging.Logger | logging.LoggerAdapter | None = None,
) -> dict:
    """CLIP score and FID of a study; writes and returns `<study>/metrics.json`'s content.

    Args:
        study_dir: The study folder (images/, study.json).
        items: study.json's items.
        cfg: `evaluate.metrics`.
        val_dir: The validation split at the model's final resolution.
        val_published: Whether that split is a complete dataset (else FID is skipped, saying
            so).
        generate: Generates FID's images from the validation captions: given a prompts CSV
            and a folder, it returns the generation's record (`items`, `settings`).
        fid_feature: FID's feature extractor instead of the Inception weights (an nn.Module
            with `num_features`, taking uint8 images): a seam for tests and other networks.
        log: Where each metric's value or reason goes.
    """
    log = log or logging.getLogger("kiln.evaluate")
    study = Path(study_dir)
    result: dict = {"study_id": study.name}
    steps = (
        ("clip_score", lambda: _clip(study, items, cfg.clip_model)),
        ("fid", lambda: _fid(study, cfg, val_dir, val_published, generate, fid_feature)),
    )
    for name, run in steps:
        t0 = time.perf_counter()
        try:
            result[name] = run()
        except MetricUnavailable as e:
            result[name] = {"skipped": str(e)}
        finally:  # give the cached GPU memory back before the next metric's launch
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if "skipped" in result[name]:
            log.warning("%s skipped: %s", name, result[name]["skipped"])
        else:
            result[name]["seconds"] = round(time.perf_counter() - t0, 2)
            log.info("%s = %.4f on %d images", name, result[name]["value"], result[name]["images"])
    tmp = study / "metrics.json.tmp"
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(study / "metrics.json")
    return result
