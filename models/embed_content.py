"""Embed images and captions with a team's CLIP, for the content rules of `kiln validate`.

    accelerate launch --config_file TOPOLOGY -m models.embed_content --config embed.yaml

The run file (`kiln_config.EmbedRun`) names the CLIP folder and two Parquet files: the images
(by content hash, as JPEG thumbnails at the CLIP's input side that validate's driver wrote
while it read each new image once, one row group per batch) and the captions (by hash) that
the content store lacks. Rank r takes batches r, r + world, ... and writes each as
`images-<batch>.parquet` or `captions-<batch>.parquet` (key and the L2-normalised embedding)
atomically, so a relaunch after a crash, on any number of processes, skips the batches
already written. The caller (tasks/quality/content.py) appends the parts to the content
store. This process reads no source: the thumbnails travel in the work list.
"""

from __future__ import annotations

import argparse
import io
import logging
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from accelerate import Accelerator
from PIL import Image

from kiln_config import EmbedRun, load_yaml_model
from models.evaluation.image_metrics import load_clip

__all__ = ["embed_captions", "embed_images", "main"]

log = logging.getLogger("kiln.embed_content")


def _normalised(x: torch.Tensor) -> np.ndarray:
    x = x.float()
    return (x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)).cpu().numpy()


@torch.no_grad()
def embed_images(model, processor, images: list[Image.Image]) -> np.ndarray:
    """Normalised CLIP image embeddings (n, D) of RGB images."""
    device = next(model.parameters()).device
    pixels = processor(images=images, return_tensors="pt")["pixel_values"].to(device)
    return _normalised(model.get_image_features(pixel_values=pixels.to(model.dtype)))


@torch.no_grad()
def embed_captions(model, processor, captions: list[str]) -> np.ndarray:
    """Normalised CLIP text embeddings (n, D), captions truncated to the model's length."""
    device = next(model.parameters()).device
    limit = model.config.text_config.max_position_embeddings
    tok = processor.tokenizer(
        captions, padding=True, truncation=True, max_length=limit, return_tensors="pt"
    )
    return _normalised(
        model.get_text_features(
            input_ids=tok["input_ids"].to(device), attention_mask=tok["attention_mask"].to(device)
        )
    )


def _write(out: Path, keys, emb: np.ndarray) -> None:
    table = pa.table(
        {
            "key": pa.array(list(keys), pa.string()),
            "embedding": pa.array(list(emb), pa.list_(pa.float32())),
        }
    )
    tmp = out.with_name(out.name + ".tmp")
    pq.write_table(table, tmp)
    tmp.replace(out)


def _run(accelerator, run: EmbedRun, model, processor) -> int:
    """This rank's batches of images (row groups of `run.images`) and captions; returns the
    batches done."""
    out, done = Path(run.out_dir), 0
    rank, world = accelerator.process_index, accelerator.num_processes
    images = pq.ParquetFile(run.images)
    for b in range(images.metadata.num_row_groups):
        path = out / f"images-{b:06d}.parquet"
        if b % world != rank or path.is_file():
            continue
        t = images.read_row_group(b)
        pics = [Image.open(io.BytesIO(x)).convert("RGB") for x in t["image"].to_pylist()]
        _write(path, t["key"].to_pylist(), embed_images(model, processor, pics))
        done += 1
    captions, size = pd.read_parquet(run.captions), run.batch_size
    for b, start in enumerate(range(0, len(captions), size)):
        path = out / f"captions-{b:06d}.parquet"
        if b % world != rank or path.is_file():
            continue
        batch = captions.iloc[start : start + size]
        _write(path, batch["key"], embed_captions(model, processor, batch["caption"].tolist()))
        done += 1
    return done


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="Run file (kiln_config.EmbedRun)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    run: EmbedRun = load_yaml_model(EmbedRun, args.config)
    Path(run.out_dir).mkdir(parents=True, exist_ok=True)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    model, processor = load_clip(run.clip_model)
    model.to(accelerator.device)
    done = _run(accelerator, run, model, processor)
    log.info("rank %d embedded %d batches", accelerator.process_index, done)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
