"""Image bytes -> pixel tensors: one image for the shard and precompute steps, a whole batch
straight into its buffer for the loader (`decode_into`).

Pixels are uint8 from the decoder to the device (a quarter of the bytes of float32 through
worker shared memory); `normalize_pixels` makes the model's [-1, 1] floats, on the device in
training. A wrong-size image is a clear error naming both sizes (`wrong_size`): shards
written for another stage or bucket must not train silently.
"""

from __future__ import annotations

import io

import numpy as np
import simplejpeg
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_image, decode_jpeg

__all__ = [
    "Size",
    "decode_into",
    "decode_pixels",
    "decode_uint8",
    "image_size",
    "normalize_pixels",
    "width_height",
    "wrong_size",
]

Size = int | tuple[int, int]  # a square side, or (width, height) for an aspect bucket


def width_height(size: Size) -> tuple[int, int]:
    """(width, height) of a `Size`."""
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


def _decode_jpeg(buf: torch.Tensor) -> torch.Tensor:
    # torchvision's operator itself: its Python wrapper adds a deprecation warning, usage
    # logging and tracing checks to every call (10 us an image, 6% of decoding 256 px).
    op = getattr(torch.ops.image, "decode_jpeg", None)
    if op is None:  # pragma: no cover - another torchvision build
        return decode_jpeg(buf, mode=ImageReadMode.RGB)
    return op(buf, ImageReadMode.RGB.value, False)  # (bytes, mode, apply_exif_orientation)


def decode_uint8(data: bytes | memoryview, size: Size | None) -> torch.Tensor:
    """Image bytes (JPEG, PNG or WebP) -> uint8 tensor (3, H, W), checked against `size`
    (unless None)."""
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # decoders only read it
    if data[:2] == b"\xff\xd8":
        img = _decode_jpeg(buf)
    else:
        try:
            img = decode_image(buf, mode=ImageReadMode.RGB)
        except RuntimeError:  # a format torchvision lacks: PIL decodes everything we write
            rgb = Image.open(io.BytesIO(bytes(data))).convert("RGB")
            img = torch.from_numpy(np.asarray(rgb, dtype=np.uint8).copy()).permute(2, 0, 1)
    if size is None:
        return img
    w, h = width_height(size)
    if tuple(img.shape[1:]) != (h, w):
        raise ValueError(
            f"shard image is {img.shape[2]}x{img.shape[1]}, expected {w}x{h}: "
            "were these shards written for another stage or bucket?"
        )
    return img


def normalize_pixels(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 (..., 3, H, W) -> float32 in [-1, 1]."""
    return pixels.float().div_(127.5).sub_(1.0)


def decode_pixels(data: bytes, size: Size) -> torch.Tensor:
    """Image bytes -> float tensor (3, H, W) in [-1, 1]."""
    return normalize_pixels(decode_uint8(data, size))


def image_size(data: memoryview | bytes) -> tuple[int, int]:
    """(width, height) from an image's header, without decoding it."""
    if data[:2] == b"\xff\xd8":
        h, w, _, _ = simplejpeg.decode_jpeg_header(data)
        return w, h
    with Image.open(io.BytesIO(bytes(data))) as img:  # reads the header only
        return img.size


def wrong_size(got: tuple[int, int], sizes: set[tuple[int, int]]):
    """Raise the error for a batch image of size `got` (width, height), not one of `sizes`."""
    raise ValueError(
        f"a batch holds images of {[got]} (width x height), expected one of {sorted(sizes)}: "
        "were these shards written for another stage, or are buckets batched per stream?"
    )


def decode_into(images: list, out: torch.Tensor) -> torch.Tensor:
    """Decode each image into its row of `out` (B, H, W, 3), uint8.

    JPEG goes straight into the row through libjpeg-turbo (simplejpeg): no image-sized
    allocation per sample, whose page faults and extra copy cost a third as much as decoding
    a 256-px image. Other formats decode through torchvision (or PIL) and are copied in.
    """
    rows = out.numpy()
    _, h, w, _ = rows.shape
    sizes = {(w, h)}
    for row, data in zip(rows, images, strict=True):
        if data[:2] == b"\xff\xd8":
            try:
                got = simplejpeg.decode_jpeg(data, colorspace="RGB", buffer=row).shape
            except ValueError as e:
                hdr = _jpeg_header(data)
                if hdr is None or hdr == (w, h):
                    raise ValueError(f"cannot decode a shard image: {e}") from e
                wrong_size(hdr, sizes)
            if got != (h, w, 3):
                wrong_size((got[1], got[0]), sizes)
        else:
            img = decode_uint8(data, None)
            if tuple(img.shape[1:]) != (h, w):
                wrong_size((int(img.shape[2]), int(img.shape[1])), sizes)
            row[...] = img.permute(1, 2, 0).numpy()
    return out


def _jpeg_header(data) -> tuple[int, int] | None:
    try:
        h, w, _, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    return w, h
