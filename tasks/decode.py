"""Inspect one source image: runs in ingest's worker processes, so it imports little.

Every outcome is a record, never an exception: either image metadata, or a reason code for
quarantine. A decompression bomb is caught from the header alone, before any pixel is decoded.
"""

from __future__ import annotations

import hashlib
import io
import warnings

from PIL import Image, ImageOps, UnidentifiedImageError

from tasks.storage import Storage

__all__ = ["inspect_image"]

_STORES: dict[tuple[str, str | None], Storage] = {}


def _store(uri: str, endpoint_url: str | None) -> Storage:
    # One client per worker process and source, reused across images.
    key = (uri, endpoint_url)
    if key not in _STORES:
        _STORES[key] = Storage(uri, endpoint_url)
    return _STORES[key]


def inspect_image(job: tuple[str, str | None, str, int]) -> dict:
    """Read and fully decode one image. `job` is (source_uri, endpoint_url, key, max_pixels)."""
    uri, endpoint_url, key, max_pixels = job
    try:
        data = _store(uri, endpoint_url).read_bytes(key)
    except Exception as e:  # noqa: BLE001 - any read failure is a quarantine reason
        return {"key": key, "reason": "read_error", "detail": f"{type(e).__name__}: {e}"}
    rec = {"key": key, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
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
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a truncated-file warning is a failure too
                img.load()
            # Width and height as they will be used: after EXIF orientation.
            w, h = ImageOps.exif_transpose(img).size
    except UnidentifiedImageError:
        return {**rec, "reason": "not_an_image", "detail": "bytes are not a known image format"}
    except (OSError, SyntaxError, ValueError, Warning) as e:
        return {**rec, "reason": "decode_error", "detail": f"{type(e).__name__}: {e}"}
    return {**rec, "width": w, "height": h, "format": fmt, "mode": mode}


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


def resize_center_crop(img: Image.Image, size: int) -> tuple[Image.Image, tuple[int, int]]:
    """Resize the short side to `size` (Lanczos), centre-crop a square; return (top, left)."""
    w, h = img.size
    scale = size / min(w, h)
    nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
    img = img.resize((nw, nh), Image.LANCZOS, reducing_gap=3.0)
    top, left = (nh - size) // 2, (nw - size) // 2
    return img.crop((left, top, left + size, top + size)), (top, left)


def render_for_stages(job: tuple[str, str | None, str, list[int], int]) -> dict:
    """Decode one image once and encode it for every stage resolution it qualifies for.

    `job` is (source_uri, endpoint_url, key, resolutions, jpeg_quality). Returns
    {"key", "images": {resolution: (jpeg_bytes, crop_top, crop_left)}} or {"key", "error"}.
    """
    uri, endpoint_url, key, resolutions, quality = job
    try:
        data = _store(uri, endpoint_url).read_bytes(key)
        Image.MAX_IMAGE_PIXELS = None  # ingest already enforced the pixel limit
        with Image.open(io.BytesIO(data)) as src:
            if src.format == "JPEG":
                # DCT-domain downscale: decode at 1/2, 1/4 or 1/8 size when that still covers
                # the largest target; far cheaper than a full decode followed by a resize.
                src.draft("RGB", (max(resolutions), max(resolutions)))
            img = to_rgb(ImageOps.exif_transpose(src))
        out = {}
        for res in resolutions:
            crop, (top, left) = resize_center_crop(img, res)
            buf = io.BytesIO()
            crop.save(buf, format="JPEG", quality=quality)
            out[res] = (buf.getvalue(), top, left)
        return {"key": key, "images": out}
    except Exception as e:  # noqa: BLE001 - reported per key, never crashes the pool
        return {"key": key, "error": f"{type(e).__name__}: {e}"}
