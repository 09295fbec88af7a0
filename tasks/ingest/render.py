"""Render a source image for the shard step: resize and centre crop, and
SDXL-style aspect buckets. Runs in the shard step's worker processes, so it imports little.
"""

from __future__ import annotations

import io
import math

import numpy as np
from PIL import Image, ImageOps

from tasks.storage.images import to_rgb
from tasks.storage.objects import worker_storage

__all__ = [
    "aspect_buckets",
    "nearest_bucket",
    "nearest_buckets",
    "render_for_stages",
    "resize_center_crop",
    "resize_crop",
]


def resize_crop(img: Image.Image, width: int, height: int) -> tuple[Image.Image, tuple[int, int]]:
    """Resize (Lanczos) to cover `width` x `height`, centre-crop to it; return (top, left)."""
    w, h = img.size
    scale = max(width / w, height / h)
    nw, nh = max(width, round(w * scale)), max(height, round(h * scale))
    img = img.resize((nw, nh), Image.LANCZOS, reducing_gap=3.0)
    top, left = (nh - height) // 2, (nw - width) // 2
    return img.crop((left, top, left + width, top + height)), (top, left)


def resize_center_crop(img: Image.Image, size: int) -> tuple[Image.Image, tuple[int, int]]:
    """Resize the short side to `size` (Lanczos), centre-crop a square; return (top, left)."""
    return resize_crop(img, size, size)


def aspect_buckets(resolution: int, step: int = 64, max_aspect: float = 2.0) -> list[tuple]:
    """SDXL-style aspect-ratio buckets for a stage: (width, height) pairs, both multiples of
    `step`, of at most `resolution`**2 pixels each (as close to it as the step allows), with
    aspect ratios up to `max_aspect` either way. Sorted from tallest to widest; the square
    `resolution` x `resolution` is always one of them.
    """
    if resolution % step:
        raise ValueError(f"resolution {resolution} is not a multiple of the bucket step {step}")
    area, out = resolution * resolution, set()
    for w in range(resolution, int(resolution * max_aspect) + 1, step):
        h = area // w // step * step
        if h >= step and w / h <= max_aspect + 1e-9:
            out |= {(w, h), (h, w)}  # landscape and its portrait mirror
    return sorted(out, key=lambda b: b[0] / b[1])


def nearest_bucket(width: int, height: int, buckets: list[tuple]) -> tuple[int, int]:
    """The bucket whose aspect ratio is closest to the image's (in log space, so 2:1 and 1:2
    are equally far from 1:1); on a tie, the larger bucket."""
    a = math.log(width / height)
    return min(buckets, key=lambda b: (abs(math.log(b[0] / b[1]) - a), -b[0] * b[1]))


def nearest_buckets(widths, heights, buckets: list[tuple]) -> list[tuple[int, int]]:
    """`nearest_bucket` for whole columns at once (a catalog of millions of rows)."""
    logs = np.log(np.asarray(widths, float) / np.asarray(heights, float))[:, None]
    ratios = np.log([b[0] / b[1] for b in buckets])[None, :]
    areas = np.array([b[0] * b[1] for b in buckets], float)[None, :]
    # The area term is far below any gap between two buckets' log ratios: it only breaks ties.
    best = np.argmin(np.abs(logs - ratios) - areas * 1e-15, axis=1)
    return [tuple(buckets[i]) for i in best]


def render_for_stages(job: tuple) -> dict:
    """Decode one image once and encode it for every stage resolution it qualifies for.

    `job` is (source_uri, endpoint_url, key, object, offset, length, targets, quality[,
    format]); offset -1 means the whole object, else a tar member's byte range; a target is a
    stage resolution (a square) or (resolution, width, height) for an aspect bucket; format is
    jpeg (default), webp or png. Returns
    {"key", "images": {resolution: (bytes, crop_top, crop_left)}} or {"key", "error"}.
    """
    uri, endpoint_url, key, obj, offset, length, targets, quality, *fmt = job
    targets = [(t, t, t) if isinstance(t, int) else tuple(t) for t in targets]
    fmt = (fmt or ["jpeg"])[0]
    try:
        store = worker_storage(uri, endpoint_url)
        data = store.read_bytes(obj) if offset < 0 else store.read_range(obj, offset, length)
        Image.MAX_IMAGE_PIXELS = None  # ingest already enforced the pixel limit
        with Image.open(io.BytesIO(data)) as src:
            if src.format == "JPEG":
                # DCT-domain downscale: decode at 1/2, 1/4 or 1/8 size when that still covers
                # the largest target (both sides, whatever the EXIF rotation); far cheaper
                # than a full decode followed by a resize.
                w, h = src.size
                need = max(max(tw / w, th / h, tw / h, th / w) for _, tw, th in targets)
                src.draft("RGB", (round(w * need), round(h * need)))
            img = to_rgb(ImageOps.exif_transpose(src))
        out = {}
        for res, tw, th in targets:
            crop, (top, left) = resize_crop(img, tw, th)
            buf = io.BytesIO()
            if fmt == "png":
                crop.save(buf, format="PNG", optimize=False)
            elif fmt == "webp":
                crop.save(buf, format="WEBP", quality=quality, method=4)
            else:
                crop.save(buf, format="JPEG", quality=quality)
            out[res] = (buf.getvalue(), top, left)
        return {"key": key, "images": out}
    except Exception as e:  # noqa: BLE001 - reported per key, never crashes the pool
        return {"key": key, "error": f"{type(e).__name__}: {e}"}
