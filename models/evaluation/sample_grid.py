"""Sample grids while a stage trains: fixed prompts (rows) by fixed seeds (columns).

Every `train.sample_every` optimizer steps and at the end of each stage, the main process writes the
pipeline exactly as the stage's export does (`models.components.export`, EMA weights when EMA is on)
into a temporary folder, loads it as `kiln evaluate` does (`models.evaluation.generate`), and
generates each (prompt, seed) image with its own seeded generator. A broken export, a wrong latent
scale or an EMA swap that never happened shows in the grid long before the stage ends.

The grid is saved as `<stage dir>/samples/step-{step:06d}.png` and logged to the training
run's MLflow run as a stepped image (key `samples/stage-{res}`), so the MLflow UI's image
slider shows the stage's progress. A tracking store that fails is a warning; a grid that
cannot be generated is an error, since it means the export is broken.

Generation draws from explicit generators only, under `fork_rng`, so the training RNG (noise,
timesteps, caption dropout) is exactly where it was, and a run with grids trains the same
weights as one without. The training UNet is never touched: the EMA weights go into a copy.
`SampleGrids` is the training loop's callback that draws the intermediate steps' grids.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from PIL import Image, ImageDraw, ImageFont

from kiln_config import EvaluateConfig, StageRun
from models.components.export import export_unet, write_pipeline
from models.components.sharding import is_sharded, whole_unet
from models.evaluation.generate import generate_images, load_pipeline

__all__ = [
    "grid_image",
    "sample_grid",
    "sample_grids",
    "tile_box",
    "tile_size",
]

log = logging.getLogger("kiln.samples")

LABEL_WIDTH = 320  # the prompt column, in pixels
HEADER_HEIGHT = 20  # the seed row
PAD = 2
MIN_TILE = 128  # smaller images are enlarged (nearest neighbour) to at least this side
FONT_SIZE = 12
# Images per pipeline call: `kiln evaluate`'s default batch, so that a grid's images are the
# ones a study of the same prompts and seeds draws.
BATCH = EvaluateConfig.model_fields["batch_size"].default


def sample_grids(out_dir: str | Path) -> list[Path]:
    """The stage's grids on disk, oldest step first (from every launch of the stage)."""
    return sorted((Path(out_dir) / "samples").glob("step-*.png"))


def sample_grid(
    run: StageRun, accelerator: Accelerator, comps, ema, step: int, sink
) -> Path | None:
    """Write (and log) the grid of `step`. Every rank calls it at the same step.

    Returns the PNG's path on the main process, None on the others.
    """
    # Under FSDP the full state dict is a collective: every rank joins before the main process
    # goes off alone. No other collective runs until the barrier below.
    fsdp = accelerator.distributed_type == DistributedType.FSDP
    full_state = accelerator.get_state_dict(comps.unet) if fsdp else None
    # Kiln's FSDP (models/components/sharding.py): a whole copy on the main process.
    whole = whole_unet(comps.unet, everywhere=False) if is_sharded(comps.unet) else None
    path = None
    if accelerator.is_main_process:
        unet = whole if whole is not None else accelerator.unwrap_model(comps.unet)
        path = _write_grid(run, accelerator.device, comps, unet, ema, step, full_state, sink)
    accelerator.wait_for_everyone()
    return path


def _rng_devices(device: torch.device) -> list[int]:
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


def _write_grid(run, device, comps, unet, ema, step, full_state, sink) -> Path:
    cfg, res = run.train, run.stage.resolution
    out = Path(run.output_dir)
    tmp = out / ".samples.tmp"
    dtypes = (comps.vae.dtype, comps.text_encoder.dtype)
    t0 = time.perf_counter()
    try:
        with torch.random.fork_rng(devices=_rng_devices(device)):
            if full_state is not None:  # FSDP: a plain UNet from the gathered weights
                plain = type(unet).from_config(unet.config)
                plain.load_state_dict(full_state)
                unet = plain
            write_pipeline(comps, export_unet(unet, ema), tmp)
            pipe = load_pipeline(tmp, device)
            images = _generate(pipe, cfg)
            del pipe
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        # write_pipeline cast them to fp32: back to the training dtype (an exact round trip).
        comps.vae.to(dtypes[0])
        comps.text_encoder.to(dtypes[1])
        if device.type == "cuda":
            torch.cuda.empty_cache()
    cols = len(cfg.sample_seeds)
    rows = [images[r * cols : (r + 1) * cols] for r in range(len(cfg.sample_prompts))]
    seeds = [f"seed {s}" for s in cfg.sample_seeds]
    grid = grid_image(rows, cfg.sample_prompts, seeds, title=f"{res}px step {step}")
    path = out / "samples" / f"step-{step:06d}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f".{path.name}.tmp")
    grid.save(part, format="PNG")
    part.replace(path)
    seconds = time.perf_counter() - t0
    logged = _log_image(run, grid, step)
    sink.event("sample_grid", step=step, path=str(path), seconds=seconds, mlflow=logged)
    log.info("sample grid %s (%.2f s)", path, seconds)
    return path


def _generate(pipe, cfg) -> list[Image.Image]:
    """Every (prompt, seed) image, row by row, in batches of BATCH like `kiln evaluate`'s."""
    pairs = [(p, s) for p in cfg.sample_prompts for s in cfg.sample_seeds]
    images: list[Image.Image] = []
    for start in range(0, len(pairs), BATCH):
        prompts, seeds = zip(*pairs[start : start + BATCH], strict=True)
        images += generate_images(
            pipe, list(prompts), list(seeds), cfg.sample_steps, cfg.sample_guidance_scale
        )
    return images


def _log_image(run: StageRun, grid: Image.Image, step: int) -> bool:
    """Log the grid as a stepped MLflow image of the training run; False when not logged."""
    if not (run.tracking_uri and run.mlflow_run_id):
        return False
    try:
        from mlflow.tracking import MlflowClient

        MlflowClient(run.tracking_uri).log_image(
            run.mlflow_run_id,
            grid,
            key=f"samples/stage-{run.stage.resolution}",
            step=step,
            synchronous=True,
        )
        return True
    except Exception as e:  # noqa: BLE001 - the grid is on disk; training goes on
        log.warning(
            "sample grid of step %d not logged to MLflow (%s: %s)", step, type(e).__name__, e
        )
        return False


# -- tiling ----------------------------------------------------------------------------------


def tile_size(image_size: tuple[int, int]) -> tuple[int, int]:
    """A tile's (width, height): the image enlarged by the smallest whole factor that makes
    its shorter side at least MIN_TILE, so a 32px tiny-preset sample stays readable."""
    w, h = image_size
    scale = max(1, -(-MIN_TILE // min(w, h)))
    return w * scale, h * scale


def tile_box(row: int, col: int, tile: tuple[int, int]) -> tuple[int, int, int, int]:
    """The (left, top, right, bottom) pixel box of tile (row, col) in the grid."""
    tw, th = tile
    x, y = LABEL_WIDTH + col * (tw + PAD), HEADER_HEIGHT + row * (th + PAD)
    return x, y, x + tw, y + th


def grid_image(
    rows: list[list[Image.Image]],
    row_labels: list[str],
    col_labels: list[str],
    title: str = "",
) -> Image.Image:
    """Tile `rows` (one list of same-sized images per row) into one RGB image, each row
    labelled with its text on the left and each column on top.

    Raises:
        ValueError: when the rows, labels and image sizes do not line up.
    """
    if len(rows) != len(row_labels) or not rows:
        raise ValueError(f"{len(rows)} rows of images for {len(row_labels)} row labels")
    if any(len(r) != len(col_labels) for r in rows):
        raise ValueError(f"every row needs {len(col_labels)} images (one per column label)")
    size = rows[0][0].size
    if any(img.size != size for r in rows for img in r):
        raise ValueError(f"every image must be {size[0]}x{size[1]}")
    tile = tile_size(size)
    right, bottom = tile_box(len(rows) - 1, len(col_labels) - 1, tile)[2:]
    grid = Image.new("RGB", (right + PAD, bottom + PAD), "white")
    draw = ImageDraw.Draw(grid)
    font = ImageFont.load_default(size=FONT_SIZE)
    draw.text((4, 4), title, fill="black", font=font)
    for c, label in enumerate(col_labels):
        left = tile_box(0, c, tile)[0]
        draw.text((left + 2, 4), label, fill="black", font=font)
    for r, (images, label) in enumerate(zip(rows, row_labels, strict=True)):
        top = tile_box(r, 0, tile)[1]
        lines = _wrap(label, font, LABEL_WIDTH - 8, max_lines=max(1, tile[1] // (FONT_SIZE + 3)))
        draw.multiline_text((4, top + 2), "\n".join(lines), fill="black", font=font, spacing=3)
        for c, img in enumerate(images):
            enlarged = img.convert("RGB").resize(tile, Image.Resampling.NEAREST)
            grid.paste(enlarged, tile_box(r, c, tile)[:2])
    return grid


def _wrap(text: str, font, width: int, max_lines: int) -> list[str]:
    """Greedy word wrap to `width` pixels; a prompt too long for the tile ends in '...'."""
    lines: list[str] = []
    for word in text.split():
        if lines and font.getlength(f"{lines[-1]} {word}") <= width:
            lines[-1] = f"{lines[-1]} {word}"
        else:
            lines.append(word)
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        last = lines[-1]
        while last and font.getlength(last + "...") > width:
            last = last[:-1]
        lines[-1] = last + "..."
    return lines
