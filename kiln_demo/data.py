"""A procedurally generated, captioned image set in the Hugging Face *imagefolder* layout.

Each image shows two coloured shapes in a spatial relation, captioned to match, for example
"a red circle above a small blue square on a white background". Sizes vary, some below the
later stages' resolutions and a few below the quality gate's minimum. A handful of bad items
are planted so that the quality gate has something to catch.

Every image carries licensing metadata, as a licensed library's would: its `contributor`, its
`license` and the date its license ends (`license_end`, ISO; none for an open license), all
in the future, so that nothing expires until a test or a user says so.
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

__all__ = ["CONTRIBUTORS", "PLANTED", "licensing", "write_demo_dataset"]

COLORS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 30),
    "purple": (140, 60, 170),
    "orange": (240, 130, 30),
    "black": (20, 20, 20),
}
BACKGROUNDS = {"white": (250, 250, 250), "grey": (150, 150, 150), "black": (10, 10, 10)}
SHAPES = ("circle", "square", "triangle")
RELATIONS = ("above", "below", "left of", "right of")
# (width, height) choices: some too small for the 48/64 px stages, a few below min_side 32.
SIZES = [(40, 40), (48, 64), (64, 48), (72, 72), (96, 80), (128, 96), (80, 128), (112, 112)]
TOO_SMALL = [(24, 24), (28, 40)]
# (contributor, license, license end): image i gets CONTRIBUTORS[i % 4].
CONTRIBUTORS = [
    ("ada-studio", "licensed", "2031-06-30"),
    ("bo-archive", "licensed", "2032-12-31"),
    ("cy-shoots", "cc-by", None),
    ("dee-partner", "licensed", "2030-03-31"),
]

# Planted bad items: file name -> what is wrong with it (and what should catch it).
PLANTED = {
    "bad-truncated.jpg": "truncated JPEG (ingest: decode_error)",
    "bad-empty.jpg": "zero-byte file (ingest: empty_file)",
    "bad-text.jpg": "text bytes named .jpg (ingest: not_an_image)",
    "bad-no-caption.jpg": "valid image with an empty caption (validate: caption_blank)",
    "bad-duplicate.jpg": "exact copy of the first image (validate: duplicate_sha256)",
}


def licensing(i: int) -> dict:
    """The licensing metadata of the demo's `i`-th file."""
    contributor, license_, end = CONTRIBUTORS[i % len(CONTRIBUTORS)]
    return {"contributor": contributor, "license": license_, "license_end": end}


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple, color: tuple) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=color)
    elif shape == "square":
        draw.rectangle(box, fill=color)
    else:
        draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=color)


def _render(rng: random.Random, size: tuple[int, int]) -> tuple[Image.Image, str]:
    w, h = size
    bg_name = rng.choice(list(BACKGROUNDS))
    img = Image.new("RGB", (w, h), BACKGROUNDS[bg_name])
    draw = ImageDraw.Draw(img)
    c1, c2 = rng.sample([c for c in COLORS if c != bg_name], 2)
    s1, s2 = rng.choice(SHAPES), rng.choice(SHAPES)
    rel = rng.choice(RELATIONS)
    small = rng.random() < 0.5
    # Two cells: first shape in cell A, second in cell B, placed according to the relation.
    if rel in ("above", "below"):
        cells = [(0, 0, w, h // 2), (0, h // 2, w, h)]
    else:
        cells = [(0, 0, w // 2, h), (w // 2, 0, w, h)]
    if rel in ("below", "right of"):
        cells.reverse()
    for i, (shape, color) in enumerate(((s1, c1), (s2, c2))):
        cx0, cy0, cx1, cy1 = cells[i]
        side = min(cx1 - cx0, cy1 - cy0) * (0.45 if (small and i == 1) else 0.8)
        mx, my = (cx0 + cx1) / 2, (cy0 + cy1) / 2
        _draw_shape(
            draw, shape, (mx - side / 2, my - side / 2, mx + side / 2, my + side / 2), COLORS[color]
        )
    size_word = "small " if small else ""
    caption = f"a {c1} {s1} {rel} a {size_word}{c2} {s2} on a {bg_name} background"
    return img, caption


def _encode(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, quality=92) if fmt == "JPEG" else img.save(buf, format=fmt)
    return buf.getvalue()


def write_demo_dataset(out_dir: str | Path, n: int = 60, seed: int = 0) -> dict:
    """Write `n` files (of which 5 are planted bad items) plus `metadata.jsonl` (captions and
    licensing metadata, see `licensing`) to `out_dir`.

    Args:
        out_dir: Destination folder; created if missing. Existing files are overwritten.
        n: Total number of image files, planted ones included. At least 8.
        seed: Seed for every random choice; the same seed writes the same bytes.

    Returns:
        A summary: counts and the planted items.
    """
    if n < 8:
        raise ValueError(f"n must be at least 8 (5 planted bad items plus good ones), got {n}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows: list[dict] = []
    good = n - len(PLANTED)
    first_bytes = b""
    for i in range(good):
        size = TOO_SMALL[i % len(TOO_SMALL)] if i % 20 == 7 else rng.choice(SIZES)
        img, caption = _render(rng, size)
        fmt, ext = ("PNG", "png") if i % 5 == 4 else ("JPEG", "jpg")
        name = f"{i:05d}.{ext}"
        data = _encode(img, fmt)
        first_bytes = first_bytes or data
        (out / name).write_bytes(data)
        rows.append({"file_name": name, "text": caption, **licensing(i)})

    ok_img, _ = _render(rng, (64, 64))
    jpeg = _encode(ok_img, "JPEG")
    (out / "bad-truncated.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    (out / "bad-empty.jpg").write_bytes(b"")
    (out / "bad-text.jpg").write_bytes(b"this is not an image, just some text\n" * 4)
    (out / "bad-no-caption.jpg").write_bytes(jpeg)
    (out / "bad-duplicate.jpg").write_bytes(first_bytes)
    captions = {
        "bad-truncated.jpg": "a truncated file",
        "bad-empty.jpg": "an empty file",
        "bad-text.jpg": "a text file",
        "bad-no-caption.jpg": "",
        "bad-duplicate.jpg": rows[0]["text"],
    }
    rows += [
        {"file_name": k, "text": v, **licensing(good + j)}
        for j, (k, v) in enumerate(captions.items())
    ]
    with open(out / "metadata.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return {"dir": str(out), "files": len(rows), "good": good, "planted": dict(PLANTED)}
