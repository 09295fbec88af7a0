"""Samples -> one batch of tensors (`KilnCollate`), and the batch's pixels on the device.

Everything that can run on a whole batch runs here rather than per sample: JPEG decode
straight into the batch (`models.data.images.decode_into`), the Rust tokenizer for captions
whose shards carry no token ids, and one copy of each other column into the batch, which in
a loader worker is a reused shared buffer (`models.data.shared_batch_buffers`).

A batch is a dict: `pixel_values` uint8 (B, 3, H, W) with channels-last strides (the
decoder's layout), `flip` bool (B,) where hflip is on, `input_ids` int64 (B, L); or for
precomputed shards `latent_mean`, `latent_std` and `text_hidden` (or `input_ids`) and `drop`;
and `key`, a list. Its first value is a tensor, which is what
`StreamingDataLoader.state_dict()` needs to count samples for mid-epoch resumption. The
trainer takes the pixels through `device_pixels`, which makes them contiguous and mirrors the
flagged images on the device.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from models.data.images import Size, decode_into, image_size, width_height, wrong_size
from models.data.shared_batch_buffers import BatchRing, InRing
from models.data.tokenization import CaptionTokenizer

if TYPE_CHECKING:
    from torch.utils.data import Dataset

__all__ = ["KilnCollate", "device_pixels"]


def device_pixels(batch: dict, device: torch.device | str) -> torch.Tensor:
    """A loader batch's images on `device`: uint8 (B, 3, H, W), contiguous, each image the
    batch's `flip` marks mirrored left to right (`hflip`).

    The loader only decides which images to flip; mirroring is done here, on the device, with
    the transpose out of the decoder's layout: nearly free on a GPU, where flipping each image
    in a loader worker cost 14 us of CPU (8% of the loader's rate at 256 px).
    """
    pixels = batch["pixel_values"].to(device, non_blocking=True).contiguous()
    flip = batch.get("flip")
    if flip is not None:
        flip = flip.to(device, non_blocking=True)
        pixels = torch.where(flip[:, None, None, None], pixels.flip(-1), pixels)
    return pixels


class KilnCollate:
    """Turns a list of `ImageCaptionDataset` samples into one batch dict of tensors.

    Args:
        tokenizer: The model's tokenizer (`CaptionTokenizer`), for captions whose shards carry
            no token ids, and for the empty caption of a dropped one.
        size: Expected image size: a square side, or (width, height); or a list of them for
            aspect buckets, where every batch must hold one of the sizes.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, size: Size | list[Size]):
        self.ids = CaptionTokenizer(tokenizer)
        self.max_length = self.ids.max_length
        if isinstance(size, list):
            self.sizes = {width_height(x) for x in size}
        else:
            self.sizes = {width_height(size)}
        self._empty: torch.Tensor | None = None
        self.ring: BatchRing | None = None  # set by KilnLoader around forking its workers

    def __getstate__(self) -> dict:
        # Workers started by spawn or forkserver get no ring: it is shared by fork only.
        return {**self.__dict__, "ring": None}

    def slot_bytes(self, dataset: Dataset, batch_size: int) -> int:
        """Bytes of the largest batch this collate makes from `dataset`: a ring slot's size.

        Worked out from the expected sizes for images, and from the dataset's first sample
        for precomputed latents (scaled to the largest bucket's area, where buckets differ).
        """
        probe = dataset[0]
        ids = _aligned(batch_size * self.max_length * 8)
        if "image" in probe:  # pixels, token ids and the flip flags
            pixels = _aligned(batch_size * max(w * h for w, h in self.sizes) * 3)
            return pixels + ids + _aligned(batch_size)
        areas = [w * h for w, h in self.sizes]
        scale = max(areas) / min(areas)
        total = _aligned(batch_size)  # drop flags
        for col in ("latent_mean", "latent_std", "text_hidden", "input_ids"):
            if col in probe:
                each = probe[col].nbytes * (scale if col.startswith("latent") else 1)
                total += ids if col == "input_ids" else _aligned(batch_size * int(each + 1))
        return total

    def __call__(self, samples: list[dict]) -> dict:
        first, n = samples[0], len(samples)
        # name -> (shape, dtype, fill): `fill(dest)` writes the column into `dest`, or fill is
        # a finished tensor. And the view each column is handed out as.
        cols: dict[str, tuple] = {}
        perm: dict[str, tuple] = {}
        if "latent_mean" in first:
            for col in ("latent_mean", "latent_std", "text_hidden"):
                if col in first:
                    arrays = [s[col] for s in samples]
                    cols[col] = (
                        (n, *arrays[0].shape),
                        _dtype(arrays[0]),
                        functools.partial(_stack, arrays),
                    )
        else:
            images = [s["image"] for s in samples]
            w, h = self._batch_size(images[0])
            # Decoders write (H, W, 3); the batch is decoded in that layout straight into its
            # buffer, and handed out as a (B, 3, H, W) view (channels-last strides). Stacking
            # (3, H, W) views into a (B, 3, H, W)-contiguous batch instead is a strided
            # transpose (measured 84 vs 34 us per 256-px image); the trainer makes the batch
            # contiguous on the device, where the transpose is nearly free.
            cols["pixel_values"] = (
                (n, h, w, 3),
                torch.uint8,
                functools.partial(decode_into, images),
            )
            perm["pixel_values"] = (0, 3, 1, 2)
            if "flip" in first:  # which images to mirror; `device_pixels` does it
                flip = torch.tensor([s["flip"] for s in samples])
                cols["flip"] = ((n,), torch.bool, flip)
        if "text_hidden" in first:
            drop = torch.tensor([s["drop"] for s in samples])
            cols["drop"] = (tuple(drop.shape), drop.dtype, drop)
        elif "input_ids" in first:  # precomputed ids; a dropped caption gets the empty one
            if self._empty is None:
                self._empty = self.ids([""])[0].numpy()
            arrays = [s["input_ids"] for s in samples]
            drop = [s["drop"] for s in samples]
            fill = functools.partial(_ids_into, arrays, drop, self._empty)
            cols["input_ids"] = ((n, *arrays[0].shape), torch.int64, fill)
        else:
            ids = self.ids([s["caption"] for s in samples])
            cols["input_ids"] = (tuple(ids.shape), ids.dtype, ids)
        out = self._emit(cols, perm)
        out["key"] = [s["key"] for s in samples]
        return out

    def _batch_size(self, image: memoryview | bytes) -> tuple[int, int]:
        """(width, height) of a batch whose first image is `image`: the one expected size, or
        for aspect buckets the size that image's header gives."""
        if len(self.sizes) == 1:
            return next(iter(self.sizes))
        got = image_size(image)
        if got not in self.sizes:
            wrong_size(got, self.sizes)
        return got

    def _emit(self, cols: dict, perm: dict) -> dict:
        """Write each column into one slot of the ring (in a worker that has one, when the
        batch fits and a slot is free), else into fresh tensors."""
        layout, total = {}, 0
        for name, (shape, dtype, _) in cols.items():
            layout[name] = total
            total += _aligned(math.prod(shape) * dtype.itemsize)
        info = torch.utils.data.get_worker_info()
        slot = None
        if self.ring is not None and info is not None and total <= self.ring.slot_bytes:
            slot = self.ring.claim(info.id)
        out = {}
        for name, (shape, dtype, fill) in cols.items():
            if slot is None:
                if isinstance(fill, torch.Tensor):
                    t = fill
                else:
                    t = _new(shape, dtype)
                    fill(out=t)
                out[name] = t.permute(perm[name]) if name in perm else t
                continue
            dest = self.ring.tensor(slot, layout[name], dtype, shape)
            if isinstance(fill, torch.Tensor):
                dest.copy_(fill)
            else:
                fill(out=dest)
            out[name] = InRing(self.ring, slot, layout[name], dest, perm.get(name))
        return out


def _ids_into(
    arrays: list[np.ndarray], drop: list[bool], empty: np.ndarray, out: torch.Tensor
) -> torch.Tensor:
    """Stored token ids (int32 views of the shard) into `out` (B, L) int64, the empty
    caption's ids in the rows of dropped captions. Gathered by one small numpy copy and cast
    on the way into `out` (3 us a batch; a shared-memory temporary cost 100 times more)."""
    rows = out.numpy()
    rows[...] = np.array(arrays)
    if any(drop):
        rows[drop] = empty
    return out


def _new(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor; in a DataLoader worker in shared memory, allocated up front as torch's
    own `default_collate` does, so handing it over copies nothing more."""
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    elem = torch.empty(0, dtype=dtype)
    storage = elem._typed_storage()._new_shared(int(np.prod(shape)), device=elem.device)
    return elem.new(storage).resize_(shape)


def _aligned(nbytes: int, to: int = 64) -> int:
    return -(-nbytes // to) * to


def _dtype(arr) -> torch.dtype:
    return (
        arr.dtype
        if isinstance(arr, torch.Tensor)
        else torch.from_numpy(np.empty(0, arr.dtype)).dtype
    )


def _stack(arrays: list[np.ndarray] | list[torch.Tensor], out: torch.Tensor | None = None):
    """Stack same-shape arrays (or tensors) into one tensor with a single copy: into `out`
    when given, else into a new one (`_new`)."""
    first = arrays[0]
    if out is None:
        out = _new((len(arrays), *first.shape), _dtype(first))
    if isinstance(first, torch.Tensor):
        torch.stack(arrays, out=out)
        return out
    # One torch op for the whole batch: it drops the GIL once, where numpy drops it per array
    # and then waits for streaming's download threads to hand it back each time (measured
    # 40x slower). Viewed as bytes: MDS stores arrays at arbitrary offsets, which a uint8 view
    # of any dtype accepts.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        views = [torch.from_numpy(a.view(np.uint8)) for a in arrays]
    torch.stack(views, out=out.view(torch.uint8))
    return out
