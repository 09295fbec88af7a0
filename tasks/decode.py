"""Inspect one source image: runs in ingest's worker processes, so it imports little.

Every outcome is a record, never an exception: either image metadata, or a reason code for
quarantine. A decompression bomb is caught from the header alone, before any pixel is decoded.
"""

from __future__ import annotations

import hashlib
import io
import math
import warnings

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from tasks.storage import Storage

__all__ = [
    "aspect_buckets",
    "conversion_steps",
    "inspect_bytes",
    "nearest_bucket",
    "nearest_buckets",
    "phash",
    "render_for_stages",
    "resize_center_crop",
    "resize_crop",
    "to_rgb",
]

_STORES: dict[tuple[str, str | None], Storage] = {}


def _store(uri: str, endpoint_url: str | None) -> Storage:
    # One client per worker process and source, reused across images.
    key = (uri, endpoint_url)
    if key not in _STORES:
        _STORES[key] = Storage(uri, endpoint_url)
    return _STORES[key]


def _orientation(img: Image.Image) -> int:
    try:
        return int(img.getexif().get(0x0112, 1) or 1)
    except Exception:  # noqa: BLE001 - a broken EXIF block is ignored, as exif_transpose does
        return 1


# DCT basis for the perceptual hash: the 8 lowest frequencies of a 32-point DCT-II.
_N = 32
_DCT = np.sqrt(2 / _N) * np.cos(
    np.pi * (2 * np.arange(_N)[None, :] + 1) * np.arange(8)[:, None] / (2 * _N)
)


def phash(img: Image.Image) -> str:
    """64-bit perceptual hash (pHash): the sign of the 8x8 lowest DCT frequencies of a 32x32
    greyscale thumbnail against their median, as 16 hex digits. Hamming distance between two
    hashes measures visual difference, robust to resizing and recompression."""
    small = img.convert("L").resize((_N, _N), Image.LANCZOS)
    low = _DCT @ np.asarray(small, dtype=np.float64) @ _DCT.T
    bits = (low > np.median(low)).flatten()
    return f"{int(''.join('1' if b else '0' for b in bits), 2):016x}"


def inspect_bytes(data: bytes, max_pixels: int) -> dict:
    """Metadata of one image from its bytes, or {reason, detail} for quarantine.

    Every byte of the compressed stream is decoded, so truncation and corruption are caught.
    For JPEG the decode runs in DCT-scaling draft mode: libjpeg still entropy-decodes every
    block (where truncation and bad Huffman data show up) but skips most of the full-size
    inverse DCT, which is the bulk of a full decode. The header is checked against
    `max_pixels` before any pixel is decoded, so a decompression bomb costs nothing.
    """
    rec: dict = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if not data:
        return {**rec, "reason": "empty_file", "detail": "0 bytes"}
    # We enforce our own pixel limit, so PIL's bomb check must not pre-empt it with an error.
    Image.MAX_IMAGE_PIXELS = None
    try:
        with Image.open(io.BytesIO(data)) as img:
            w, h = img.size
            if w * h > max_pixels:
                return {**rec, "reason": "too_many_pixels", "detail": f"{w}x{h} > {max_pixels}"}
            fmt, mode = img.format, img.mode
            orientation = _orientation(img)
            if fmt == "JPEG" and min(w, h) >= 256:
                img.draft(mode, (w // 8, h // 8))
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a truncated-file warning is a failure too
                img.load()
            if orientation in (5, 6, 7, 8):  # EXIF rotations by 90 degrees swap the sides
                w, h = h, w
            conversion = conversion_steps(img, orientation)
            rgb = to_rgb(ImageOps.exif_transpose(img))
            ph = phash(rgb)
    except UnidentifiedImageError:
        return {**rec, "reason": "not_an_image", "detail": "bytes are not a known image format"}
    except (OSError, SyntaxError, ValueError, Warning) as e:
        return {**rec, "reason": "decode_error", "detail": f"{type(e).__name__}: {e}"}
    except Exception as e:  # noqa: BLE001 - hostile input must never crash the worker
        return {**rec, "reason": "decode_error", "detail": f"{type(e).__name__}: {e}"}
    return {
        **rec,
        "width": w,
        "height": h,
        "format": fmt,
        "mode": mode,
        "phash": ph,
        "conversion": conversion,
    }


def conversion_steps(img: Image.Image, orientation: int = 1) -> str:
    """What normalisation to RGB will do to this image, e.g. `exif:6,CMYK->RGB`."""
    steps = [f"exif:{orientation}"] if orientation not in (1, 0) else []
    mode = img.mode
    if mode in ("RGBA", "LA", "PA") or (mode == "P" and "transparency" in img.info):
        steps.append(f"{mode}->RGB(alpha on white)")
    elif mode in ("I;16", "I;16B", "I;16L", "I"):
        steps.append(f"{mode}->RGB(16-bit scaled)")
    elif mode != "RGB":
        steps.append(f"{mode}->RGB")
    return ",".join(steps)


def to_rgb(img: Image.Image) -> Image.Image:
    """Convert any mode to RGB; transparency is composited on white, not dropped to black."""
    if img.mode == "RGB":
        return img
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        canvas = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(canvas, rgba).convert("RGB")
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16-bit greyscale: scale to 8 bits instead of clipping at 255.
        return img.point(lambda v: v / 256).convert("L").convert("RGB")
    return img.convert("RGB")


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
        store = _store(uri, endpoint_url)
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
