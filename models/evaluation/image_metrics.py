"""Automated image metrics of an evaluation study: CLIP score and FID, through torchmetrics.

- CLIP score (torchmetrics `CLIPScore`): 100 * cos(image embedding, prompt embedding), averaged
  over the study's images and clamped at 0 (torchmetrics clamps the mean, not each pair). The
  CLIP model loads with transformers from a local folder or a hub id.
- FID (torchmetrics `FrechetInceptionDistance`, torch-fidelity's InceptionV3 as features): the
  validation split's images against as many generated images. The Inception weights are a local
  file only: torch-fidelity would otherwise download them, and no weights ship in any wheel.

A metric whose weights are missing or do not load is skipped with a message that names the
fix; the caller reports it instead of failing the evaluation. Each result records the sha256
of the weights it used and the resize that fed the network, since both move the numbers.
"""

from __future__ import annotations

import io
import itertools
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from kiln_config import files_sha256
from kiln_config.errors import KilnError
from models.data.mds_reader import release_shared_memory

__all__ = [
    "FID_RESIZE",
    "MetricUnavailable",
    "clip_resize",
    "clip_score",
    "decode_images",
    "fid",
    "hub_snapshot",
    "images_as_uint8",
    "load_clip",
    "load_inception",
    "read_val_split",
    "files_sha256",
]

# How FID's InceptionV3 sees an image: torchmetrics resizes each uint8 image to 299x299 with
# bilinear interpolation and antialiasing (clean-fid's argument: no aliasing from the resize),
# rather than torch-fidelity's TF1-compatible resize without it.
FID_RESIZE = "bilinear, antialias=True, to 299x299 (torchmetrics FrechetInceptionDistance)"


class MetricUnavailable(KilnError, RuntimeError):
    """A metric cannot run here (weights missing or unloadable); the message names the fix."""


def load_clip(name_or_path: str):
    """(CLIPModel, CLIPProcessor) from a local folder or a hub id, in eval mode.

    Raises:
        MetricUnavailable: the folder is missing, or the model does not load (a hub id with no
            network and no local cache ends here too).
    """
    from transformers import CLIPModel, CLIPProcessor

    local = Path(name_or_path).expanduser()
    looks_local = name_or_path.startswith((".", "/", "~")) or local.exists()
    if looks_local and not local.is_dir():
        raise MetricUnavailable(
            f"evaluate.metrics.clip_model: no folder at {local}; point it at a CLIP model saved "
            "with save_pretrained (config.json, weights, processor files) or at a hub id"
        )
    try:
        model = CLIPModel.from_pretrained(str(local) if looks_local else name_or_path)
        processor = CLIPProcessor.from_pretrained(str(local) if looks_local else name_or_path)
    except Exception as e:  # noqa: BLE001 - any load failure skips the metric, with its cause
        raise MetricUnavailable(
            f"evaluate.metrics.clip_model {name_or_path!r} did not load ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:300] if str(e) else ''}); with no network, download it "
            "once elsewhere and set a local folder"
        ) from e
    return model.eval(), processor


def hub_snapshot(repo_id: str) -> Path | None:
    """The local folder of a hub model's cached files (those `from_pretrained` read), so
    their sha256 can be recorded; None when it is not in the cache."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, or not a repo id: no digest to record
        return None


def clip_resize(processor) -> str:
    """How the CLIP processor resizes an image before the vision tower (recorded with the
    score: CLIP's own bicubic shortest-edge resize and centre crop, unless the folder says
    otherwise)."""
    ip = processor.image_processor
    size = getattr(ip, "size", None)
    crop = getattr(ip, "crop_size", None)
    resample = getattr(ip, "resample", None)
    name = Image.Resampling(resample).name.lower() if resample is not None else "default"
    return f"{name} resize to {size}, center crop {crop} (CLIPProcessor)"


@torch.no_grad()
def clip_score(
    pairs: Iterable[tuple[torch.Tensor, str]], model, processor, batch_size: int = 32
) -> float:
    """torchmetrics' CLIP score of (uint8 CHW image, prompt) pairs: max(mean(100 * cos), 0).
    The pairs are read a batch at a time, so a study's images never sit in memory at once."""
    from torchmetrics.multimodal.clip_score import CLIPScore

    device = next(model.parameters()).device
    # The metric's running sums live with the model: torchmetrics adds each batch in place.
    metric = CLIPScore(model_name_or_path=lambda: (model, processor)).to(device)
    pairs = iter(pairs)
    while batch := list(itertools.islice(pairs, batch_size)):
        metric.update([img.to(device) for img, _ in batch], [prompt for _, prompt in batch])
    if int(metric.n_samples) == 0:
        raise ValueError("CLIP score needs at least one image and prompt")
    return float(metric.compute())


def load_inception(weights_path: str) -> torch.nn.Module:
    """torch-fidelity's InceptionV3 (2048-d pool features) from a local weights file.

    Raises:
        MetricUnavailable: the file is missing or is not InceptionV3 weights.
    """
    from torchmetrics.image.fid import NoTrainInceptionV3

    path = Path(weights_path).expanduser()
    if not path.is_file():
        raise MetricUnavailable(
            f"evaluate.metrics.inception_weights: no file at {path}; download torch-fidelity's "
            "weights-inception-2015-12-05-6726825d.pth once elsewhere and set its local path"
        )
    try:
        return NoTrainInceptionV3(
            name="inception-v3-compat",
            features_list=["2048"],
            feature_extractor_weights_path=str(path),
        )
    except Exception as e:  # noqa: BLE001 - a wrong file skips the metric, with its cause
        raise MetricUnavailable(
            f"evaluate.metrics.inception_weights {path} did not load as InceptionV3 weights "
            f"({type(e).__name__}: {str(e)[:300]})"
        ) from e


@torch.no_grad()
def fid(
    real: Iterable[torch.Tensor],
    fake: Iterable[torch.Tensor],
    feature: torch.nn.Module,
    batch_size: int = 32,
) -> float:
    """torchmetrics' FID between two sets of uint8 CHW images, features from `feature` (an
    nn.Module with `num_features`, e.g. `load_inception`'s). Images of one size are batched;
    sizes may differ (the Inception module resizes each to 299x299)."""
    from torchmetrics.image.fid import FrechetInceptionDistance

    device = next(feature.parameters()).device
    metric = FrechetInceptionDistance(feature=feature, normalize=False).to(device)
    for images, is_real in ((real, True), (fake, False)):
        for batch in _same_size_batches(images, batch_size):
            metric.update(batch.to(device), real=is_real)
    return float(metric.compute())


def _same_size_batches(images: Iterable[torch.Tensor], batch_size: int):
    pending: list[torch.Tensor] = []
    for img in images:
        if pending and (img.shape != pending[0].shape or len(pending) == batch_size):
            yield torch.stack(pending)
            pending = []
        pending.append(img)
    if pending:
        yield torch.stack(pending)


def _chw(img: Image.Image) -> torch.Tensor:
    """A PIL image as a uint8 CHW tensor (what CLIPScore and FID take)."""
    return torch.from_numpy(np.asarray(img.convert("RGB")).copy()).permute(2, 0, 1)


def images_as_uint8(paths: Iterable[str | Path]) -> Iterator[torch.Tensor]:
    """Image files as uint8 CHW tensors, read one at a time."""
    for p in paths:
        with Image.open(p) as img:
            yield _chw(img)


def decode_images(encoded: Iterable[bytes]) -> Iterator[torch.Tensor]:
    """Encoded images (the shards' JPEG bytes) as uint8 CHW tensors, decoded one at a time."""
    for data in encoded:
        with Image.open(io.BytesIO(data)) as img:
            yield _chw(img)


def read_val_split(folder: str | Path, limit: int) -> list[dict]:
    """The first `limit` samples of a validation split (MDS, the training shards' columns;
    one dataset, or one per aspect-ratio bucket listed in buckets.json) as
    {"image": encoded bytes, "caption": str}, in a fixed order. Kept encoded: 2,000 decoded
    1024 px images would take 6 GB."""
    import json

    from streaming import StreamingDataset

    folder = Path(folder)
    if (folder / "buckets.json").is_file():
        buckets = json.loads((folder / "buckets.json").read_text())["buckets"]
        datasets = [folder / b["name"] for b in buckets]
    else:
        datasets = [folder]
    out: list[dict] = []
    for d in datasets:
        ds = StreamingDataset(local=str(d), batch_size=1, shuffle=False)
        for i in range(min(ds.num_samples, limit - len(out))):
            s = ds[i]
            out.append({"image": bytes(s["image"]), "caption": s["caption"]})
        release_shared_memory(ds)  # the flow process lives on
        if len(out) >= limit:
            break
    return out
