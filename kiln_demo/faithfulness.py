"""Caption faithfulness of demo-style images, measured from the pixels.

The demo data (`kiln_demo/data.py`) captions each image as "a <colour> <shape> <relation> a
[small ]<colour> <shape> on a <background> background". For a generated image this module
checks, with no learned model, whether

* both named colours are present (`colour_match`): enough pixels close to each named palette
  colour, the background's own colour excluded;
* they stand in the named relation (`relation_match`): the centroids of the two colours' pixels
  are ordered as "above", "below", "left of" or "right of" says;
* the background is the named one (`background_match`): the median colour of the image's
  border is nearer to it than to the other two backgrounds (white, grey, black).

Chance rates are empirical: the same images scored against a derangement of the captions
(each image against another image's caption). A model that ignores its text scores the same
against both, whatever its colour biases, so "above chance" means the text steers the pixels.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageFilter

from kiln_demo.data import BACKGROUNDS, COLORS

__all__ = ["Caption", "ImageScore", "faithfulness", "parse_caption", "score_image"]

_CAPTION = re.compile(
    r"^a (?P<c1>\w+) (?P<s1>\w+) (?P<rel>above|below|left of|right of) a (?:small )?"
    r"(?P<c2>\w+) (?P<s2>\w+) on a (?P<bg>\w+) background$"
)
# Every colour a pixel can be assigned to: the shape palette plus the backgrounds.
_PALETTE = {**{f"bg:{k}": v for k, v in BACKGROUNDS.items()}, **COLORS}
_NAMES = list(_PALETTE)
_RGB = np.array([_PALETTE[n] for n in _NAMES], dtype=np.float32)
# A pixel farther than this (RGB Euclidean) from every palette colour is assigned to none:
# blurred edges and noise do not vote.
MAX_DISTANCE = 60.0
# A named colour is present when at least this share of the image's pixels is assigned to it.
MIN_SHARE = 0.015


@dataclass(frozen=True)
class Caption:
    colour1: str
    colour2: str
    relation: str
    background: str


@dataclass(frozen=True)
class ImageScore:
    colour_match: bool
    relation_match: bool
    background_match: bool = False


def parse_caption(text: str) -> Caption:
    """The colours, relation and background a demo caption names.

    Raises:
        ValueError: `text` is not in the demo data's caption form, or names an unknown colour.
    """
    m = _CAPTION.match(text.strip())
    if m is None:
        raise ValueError(f"not a demo-style caption: {text!r}")
    cap = Caption(m["c1"], m["c2"], m["rel"], m["bg"])
    for c in (cap.colour1, cap.colour2):
        if c not in COLORS:
            raise ValueError(f"caption {text!r} names unknown colour {c!r} (known: {list(COLORS)})")
    if cap.background not in BACKGROUNDS:
        raise ValueError(f"caption {text!r} names unknown background {cap.background!r}")
    return cap


def _labels(img: Image.Image) -> np.ndarray:
    """Per pixel, the index into `_NAMES` of the nearest palette colour, or -1 if none is near."""
    # A 3x3 median first: pixel noise is pulled to grey instead of voting for every colour.
    px = np.asarray(img.convert("RGB").filter(ImageFilter.MedianFilter(3)), dtype=np.float32)
    d = np.linalg.norm(px[:, :, None, :] - _RGB[None, None], axis=-1)
    lab = d.argmin(-1)
    lab[d.min(-1) > MAX_DISTANCE] = -1
    return lab


def _background(img: Image.Image) -> str:
    """The demo background nearest to the median colour of the image's border (1/16 of a side,
    at least one pixel, on each edge)."""
    px = np.asarray(img.convert("RGB"), dtype=np.float32)
    k = max(1, px.shape[0] // 16, px.shape[1] // 16)
    border = np.concatenate(
        [
            px[:k].reshape(-1, 3),
            px[-k:].reshape(-1, 3),
            px[:, :k].reshape(-1, 3),
            px[:, -k:].reshape(-1, 3),
        ]
    )
    names = list(BACKGROUNDS)
    rgb = np.array([BACKGROUNDS[n] for n in names], dtype=np.float32)
    return names[int(np.linalg.norm(rgb - np.median(border, axis=0), axis=1).argmin())]


def score_image(img: Image.Image, caption: str | Caption) -> ImageScore:
    """Whether `img` shows the caption's two colours, in the caption's relation, on the
    caption's background."""
    cap = parse_caption(caption) if isinstance(caption, str) else caption
    background = _background(img) == cap.background
    lab = _labels(img)
    h, w = lab.shape
    # The background's own colour (black on black) cannot count as a shape.
    excluded = COLORS.get(cap.background)
    masks = []
    for c in (cap.colour1, cap.colour2):
        mask = lab == _NAMES.index(c)
        if excluded is not None and COLORS[c] == excluded:
            mask = np.zeros_like(mask)
        masks.append(mask)
    present = [m.mean() >= MIN_SHARE for m in masks]
    if not all(present):
        return ImageScore(False, False, background)
    ys = [np.nonzero(m)[0].mean() / h for m in masks]
    xs = [np.nonzero(m)[1].mean() / w for m in masks]
    rel = {
        "above": ys[0] < ys[1],
        "below": ys[0] > ys[1],
        "left of": xs[0] < xs[1],
        "right of": xs[0] > xs[1],
    }[cap.relation]
    return ImageScore(True, bool(rel), background)


def faithfulness(images: list[Image.Image], captions: list[str]) -> dict:
    """`colour_match`, `relation_match` and `background_match` rates of `images` against their
    `captions`, and the same rates against the captions rolled by one (`*_chance`).

    Raises:
        ValueError: lengths differ, fewer than two images, or a caption is not demo-style.
    """
    if len(images) != len(captions):
        raise ValueError(f"{len(images)} images but {len(captions)} captions")
    if len(images) < 2:
        raise ValueError("need at least two images (the chance rate pairs each with another)")
    caps = [parse_caption(c) for c in captions]
    right = [score_image(i, c) for i, c in zip(images, caps, strict=True)]
    wrong = [score_image(i, c) for i, c in zip(images, caps[1:] + caps[:1], strict=True)]

    def rate(scores: list[ImageScore], field: str) -> float:
        return float(np.mean([getattr(s, field) for s in scores]))

    return {
        "n": len(images),
        "colour_match": rate(right, "colour_match"),
        "colour_match_chance": rate(wrong, "colour_match"),
        "relation_match": rate(right, "relation_match"),
        "relation_match_chance": rate(wrong, "relation_match"),
        "background_match": rate(right, "background_match"),
        "background_match_chance": rate(wrong, "background_match"),
    }
