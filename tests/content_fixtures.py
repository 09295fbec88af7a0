"""Small content-model fixtures: a random CLIP saved like a hub folder, and images that its
random embeddings tell apart (with planted near-copies of them)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from kiln_config import TokenizerConfig

# Well-spread colours: a random one-layer CLIP embeds two of these images with a cosine of at
# most 0.86, and each image and its planted copies (crop, re-encode, colour shift) at 0.998 or
# more (measured on the seed-0 CLIP of `tiny_clip`).
PALETTE = [
    (230, 25, 25),
    (25, 200, 40),
    (30, 40, 220),
    (240, 220, 30),
    (20, 20, 20),
    (235, 235, 235),
    (200, 40, 200),
    (30, 210, 210),
    (240, 140, 20),
    (120, 70, 20),
]


def tiny_clip(folder: Path) -> Path:
    """A random CLIP model (1 layer per tower, 32-px images) and an offline processor: the
    project's byte-level tokenizer and a CLIP image processor, saved like a hub folder."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from models.components.factory import build_tokenizer

    text = dict(
        vocab_size=514,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=77,
        bos_token_id=512,
        eos_token_id=513,
        pad_token_id=513,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
    )
    torch.manual_seed(0)
    CLIPModel(
        CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    ).save_pretrained(folder)
    tok = build_tokenizer(TokenizerConfig(builtin="bytes", model_max_length=77))
    ip = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=ip, tokenizer=tok).save_pretrained(folder)
    return folder


def palette_image(i: int, size: int = 96) -> Image.Image:
    """A distinct picture: PALETTE[i] with a left-to-right shading."""
    a = np.zeros((size, size, 3), float)
    a[:] = PALETTE[i]
    return Image.fromarray(
        np.clip(a * np.linspace(0.7, 1.0, size)[None, :, None], 0, 255).astype(np.uint8)
    )


def near_copies(img: Image.Image) -> dict[str, Image.Image]:
    """The same picture cropped by 6% a side, re-encoded as JPEG at quality 35, and with its
    red channel shifted by 12."""
    w, h = img.size
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=35)
    shifted = np.asarray(img).astype(int)
    shifted[..., 0] = np.clip(shifted[..., 0] + 12, 0, 255)
    return {
        "crop": img.crop((int(w * 0.06), int(h * 0.06), int(w * 0.94), int(h * 0.94))),
        "jpeg": Image.open(io.BytesIO(buf.getvalue())).convert("RGB"),
        "shift": Image.fromarray(shifted.astype(np.uint8)),
    }


def write_source(folder: Path, items: list[tuple], extra: dict | None = None) -> Path:
    """An imagefolder source: each (name, image, caption) as name.png and a metadata.jsonl row
    (with `extra[name]`'s columns, when given)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "metadata.jsonl", "a") as f:
        for name, img, caption in items:
            img.save(folder / f"{name}.png")
            row = {"file_name": f"{name}.png", "text": caption, **(extra or {}).get(name, {})}
            f.write(json.dumps(row) + "\n")
    return folder
