"""Streaming data for training: MDS shards -> normalised pixels and token ids.

The loader is a `StreamingDataLoader` over a `StreamingDataset`. Streaming partitions samples
across ranks itself (from the WORLD_SIZE/RANK that `accelerate launch` sets), so this loader
must stay out of `accelerator.prepare`: wrapping it again would silently double-shard. Batches
are dicts whose first value is a tensor, which is what `StreamingDataLoader.state_dict()` needs
to count samples correctly for mid-epoch resumption.
"""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image
from streaming import StreamingDataLoader, StreamingDataset
from transformers import PreTrainedTokenizerBase

__all__ = [
    "ImageCaptionDataset",
    "build_loader",
    "decode_pixels",
    "decode_uint8",
    "normalize_pixels",
    "precomputed_columns",
]


def precomputed_columns(local: str) -> set[str]:
    """Which precomputed columns (latent_mean, text_hidden) a local MDS dataset carries."""
    import json
    from pathlib import Path

    index = json.loads((Path(local) / "index.json").read_text())
    names = set(index["shards"][0].get("column_names", [])) if index["shards"] else set()
    return names & {"latent_mean", "text_hidden"}


def decode_uint8(jpeg: bytes, resolution: int) -> torch.Tensor:
    """Image bytes -> uint8 tensor (3, H, W). The loader ships uint8 (a quarter of the bytes
    of float32 through worker shared memory); the training step normalises on the device."""
    img = Image.open(io.BytesIO(jpeg)).convert("RGB")
    if img.size != (resolution, resolution):
        raise ValueError(
            f"shard image is {img.size[0]}x{img.size[1]}, expected {resolution}x{resolution}: "
            "were these shards written for another stage?"
        )
    return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)


def normalize_pixels(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 (..., 3, H, W) -> float32 in [-1, 1]."""
    return pixels.float().div_(127.5).sub_(1.0)


def decode_pixels(jpeg: bytes, resolution: int) -> torch.Tensor:
    """Image bytes -> float tensor (3, H, W) in [-1, 1]."""
    return normalize_pixels(decode_uint8(jpeg, resolution))


class ImageCaptionDataset(StreamingDataset):
    """A StreamingDataset of Kiln's MDS shards, yielding `pixel_values`, `input_ids` and `key`.

    Args:
        local: Folder of the stage's MDS dataset (or the local cache, with `remote`).
        tokenizer: Tokenizes captions to fixed-length ids.
        resolution: Expected square image size.
        caption_dropout: Probability of training on the empty caption, which gives the model
            its unconditional branch for classifier-free guidance. Decided per sample index
            from `seed`, so a resumed run drops exactly the same captions.
        **kwargs: Passed to `StreamingDataset` (remote, batch_size, shuffle, shuffle_seed...).
    """

    def __init__(
        self,
        *,
        local: str | None = None,
        tokenizer: PreTrainedTokenizerBase,
        resolution: int,
        caption_dropout: float = 0.0,
        seed: int = 0,
        **kwargs,
    ):
        if kwargs.get("streams"):
            super().__init__(**kwargs)
        else:
            super().__init__(local=local, **kwargs)
        self.tokenizer = tokenizer
        self.resolution = resolution
        self.caption_dropout = caption_dropout
        self.seed = seed

    def _ids(self, caption: str) -> torch.Tensor:
        return self.tokenizer(
            caption,
            padding="max_length",
            truncation=True,
            max_length=self.tokenizer.model_max_length,
            return_tensors="pt",
        ).input_ids[0]

    def __getitem__(self, idx: int) -> dict:
        sample = super().__getitem__(idx)
        caption = sample["caption"]
        drop = bool(
            self.caption_dropout
            and np.random.default_rng([self.seed, idx]).random() < self.caption_dropout
        )
        if drop:
            caption = ""
        if "latent_mean" in sample:
            # Precomputed shards (models/precompute.py): no image decode, no VAE.
            # fp16 as stored (half the bytes through worker shared memory); the training step
            # casts on the device.
            out = {
                "latent_mean": torch.from_numpy(np.ascontiguousarray(sample["latent_mean"])),
                "latent_std": torch.from_numpy(np.ascontiguousarray(sample["latent_std"])),
            }
            if "text_hidden" in sample:
                out["text_hidden"] = torch.from_numpy(np.ascontiguousarray(sample["text_hidden"]))
                out["drop"] = torch.tensor(drop)
            else:
                ids = sample["input_ids"]
                out["input_ids"] = self._ids("") if drop else torch.from_numpy(ids.astype(np.int64))
            out["key"] = sample["key"]
            return out
        ids = self._ids(caption)
        # A tensor first: StreamingDataLoader counts a batch by its first value.
        return {
            "pixel_values": decode_uint8(sample["image"], self.resolution),
            "input_ids": ids,
            "key": sample["key"],
        }


def build_loader(
    local: str,
    tokenizer: PreTrainedTokenizerBase,
    resolution: int,
    batch_size: int,
    *,
    shuffle_seed: int,
    seed: int = 0,
    caption_dropout: float = 0.0,
    num_workers: int = 0,
    remote: str | None = None,
    mix: list[tuple[str, float]] | None = None,
    shuffle_algo: str = "py1e",
    predownload: int | None = None,
    cache_limit: str | None = None,
) -> StreamingDataLoader:
    """A per-rank loader of `batch_size` samples; the rank split comes from the environment.

    `mix` adds other datasets as streams, each (local folder, proportion); `local` then gets
    the remaining share. Proportions fix each epoch's composition (streaming up- or
    down-samples each stream to its share).
    """
    streams = None
    if mix:
        from streaming import Stream

        rest = 1.0 - sum(p for _, p in mix)
        streams = [Stream(local=local, remote=remote, proportion=rest)] + [
            Stream(local=path, proportion=p) for path, p in mix
        ]
    dataset = ImageCaptionDataset(
        local=None if streams else local,
        remote=None if streams else remote,
        streams=streams,
        tokenizer=tokenizer,
        resolution=resolution,
        caption_dropout=caption_dropout,
        seed=seed,
        batch_size=batch_size,
        shuffle=True,
        shuffle_seed=shuffle_seed,
        shuffle_algo=shuffle_algo,
        predownload=predownload,
        cache_limit=cache_limit,
    )
    return StreamingDataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=num_workers,
        drop_last=True,
        persistent_workers=False,
        # Each new iterator draws a base seed from this generator. Left at the default, it
        # would draw from the global torch RNG, and a resumed run (which restores that RNG
        # and then starts a new iterator) would sample different noise than the original.
        generator=torch.Generator().manual_seed(seed),
    )
