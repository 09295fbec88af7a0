"""Contact sheets of an evaluation study: one PNG per prompt category.

Each prompt gets a cell: its images side by side (one per seed, in the study's seed order) and
the prompt's text wrapped under them, so a person reads a whole category at a glance instead
of opening hundreds of files. Thumbnails keep the images' aspect ratio.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

__all__ = ["category_slug", "write_contact_sheets"]

THUMB = 128  # px, the longer side of each thumbnail
COLUMNS = 4  # prompt cells per row
PAD = 8
LINE_H = 12  # px per text line of PIL's default bitmap font
TEXT_LINES = 4  # the prompt's first lines; longer prompts end with "..."


def category_slug(category: str) -> str:
    """A file name for a category: lower case, [a-z0-9-] only ("uncategorised" when empty)."""
    return re.sub(r"[^a-z0-9]+", "-", category.lower()).strip("-") or "uncategorised"


def _prompt_lines(prompt: str, width_px: int) -> list[str]:
    lines = textwrap.wrap(prompt, width=max(8, width_px // 6)) or [""]
    if len(lines) > TEXT_LINES:
        lines = lines[: TEXT_LINES - 1] + [lines[TEXT_LINES - 1][:-3] + "..."]
    return lines


def _thumb(path: Path) -> Image.Image:
    """The image scaled so its longer side is THUMB: small images (the tiny preset's 64 px)
    are enlarged with nearest-neighbour, so pixels stay pixels instead of blurring."""
    with Image.open(path) as img:
        img = img.convert("RGB")
        scale = THUMB / max(img.size)
        size = (max(1, round(img.width * scale)), max(1, round(img.height * scale)))
        resample = Image.Resampling.LANCZOS if scale < 1 else Image.Resampling.NEAREST
        return img.resize(size, resample)


def _sheet(cells: list[tuple[str, list[Path]]], title: str) -> Image.Image:
    """One category's sheet: a title line, then the cells in rows of COLUMNS."""
    seeds = max(len(paths) for _, paths in cells)
    cell_w = seeds * THUMB + (seeds - 1) * 2
    cell_h = THUMB + PAD // 2 + TEXT_LINES * LINE_H
    cols = min(COLUMNS, len(cells))
    rows = -(-len(cells) // cols)
    font = ImageFont.load_default()
    width = max(PAD + cols * (cell_w + PAD), 2 * PAD + int(font.getlength(title)))
    height = 2 * PAD + LINE_H + rows * (cell_h + PAD)
    sheet = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(sheet)
    draw.text((PAD, PAD), title, fill="black", font=font)
    for n, (prompt, paths) in enumerate(cells):
        x = PAD + (n % cols) * (cell_w + PAD)
        y = 2 * PAD + LINE_H + (n // cols) * (cell_h + PAD)
        for k, p in enumerate(paths):
            sheet.paste(_thumb(p), (x + k * (THUMB + 2), y))
        for j, line in enumerate(_prompt_lines(prompt, cell_w)):
            draw.text((x, y + THUMB + PAD // 2 + j * LINE_H), line, fill="black", font=font)
    return sheet


def write_contact_sheets(study_dir: str | Path, items: list[dict]) -> dict[str, Path]:
    """Write `<study>/contact/<category>.png` for every category of a study's items.

    Args:
        study_dir: The study folder (its images are `study_dir / item["path"]`).
        items: study.json's items: prompt, category, seed, path (one per prompt and seed).

    Returns:
        {category: sheet path}, in the categories' first-appearance order.
    """
    study_dir = Path(study_dir)
    by_cat: dict[str, dict[int, tuple[str, list[Path]]]] = {}
    for it in items:
        cell = by_cat.setdefault(it["category"], {}).setdefault(it["index"], (it["prompt"], []))
        cell[1].append(study_dir / it["path"])
    out = study_dir / "contact"
    out.mkdir(parents=True, exist_ok=True)
    sheets: dict[str, Path] = {}
    for cat, cells in by_cat.items():
        slug = category_slug(cat)
        while out / f"{slug}.png" in sheets.values():  # two names with one slug
            slug += "-"
        path = out / f"{slug}.png"
        seeds = ", ".join(str(s) for s in dict.fromkeys(it["seed"] for it in items))
        title = f"{cat or 'uncategorised'}: {len(cells)} prompt(s), seeds {seeds}, {study_dir.name}"
        tmp = path.with_suffix(".png.tmp")
        _sheet(list(cells.values()), title).save(tmp, format="PNG")
        tmp.replace(path)
        sheets[cat] = path
    return sheets
