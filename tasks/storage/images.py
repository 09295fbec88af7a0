"""A catalog row's image, read from its source and decoded as RGB: what ingest's inspection,
the shard step's rendering and validate's content rules decode (one conversion for all).
"""

from __future__ import annotations

import io

from PIL import Image, ImageOps

from tasks.storage.objects import worker_storage

__all__ = ["read_image", "to_rgb"]


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


def read_image(row, endpoint_url: str | None, draft: int | None = None) -> Image.Image:
    """One catalog row's image (`row.source`, `.object`, `.offset`, `.length`; offset -1: the
    whole object), decoded as RGB with its EXIF rotation applied; with `draft`, a JPEG decodes
    at the smallest DCT scale whose sides still cover `draft` pixels (far cheaper)."""
    store = worker_storage(row.source, endpoint_url)
    offset = int(row.offset)
    data = (
        store.read_bytes(row.object)
        if offset < 0
        else store.read_range(row.object, offset, int(row.length))
    )
    Image.MAX_IMAGE_PIXELS = None  # ingest already enforced the pixel limit
    with Image.open(io.BytesIO(data)) as img:
        if draft and img.format == "JPEG":
            img.draft("RGB", (draft, draft))
        return to_rgb(ImageOps.exif_transpose(img))
