"""Streaming data for training: MDS shards -> uint8 pixels (or latents) and token ids.

The loader is a `StreamingDataLoader` over a `StreamingDataset`. Streaming partitions samples
across ranks itself (from the WORLD_SIZE/RANK that `accelerate launch` sets), so this loader
must stay out of `accelerator.prepare`: wrapping it again would silently double-shard.

The per-sample path is kept to reading the stored bytes: `ImageCaptionDataset.__getitem__`
maps the shard file once per worker and returns views into it. Everything that can run on a
whole batch does, in `KilnCollate`: JPEG decode (libjpeg-turbo, straight into the batch),
the Rust tokenizer for the captions (unless the shards carry token ids), and one copy of each
other column into the batch, which in a worker is a reused shared buffer (`KilnLoader`,
`models/ring.py`). Batches are dicts whose
first value is a tensor, which is what `StreamingDataLoader.state_dict()` needs to count
samples for mid-epoch resumption.
"""

from __future__ import annotations

import bisect
import functools
import io
import json
import logging
import math
import mmap
import multiprocessing as mp
import os
import struct
import warnings
import weakref
from collections import OrderedDict
from pathlib import Path

import numpy as np
import simplejpeg
import torch
from PIL import Image
from streaming import StreamingDataLoader, StreamingDataset
from torchvision.io import ImageReadMode, decode_image, decode_jpeg
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from models.ring import BatchRing, InRing

__all__ = [
    "CaptionTokenizer",
    "ImageCaptionDataset",
    "KilnCollate",
    "KilnLoader",
    "build_loader",
    "dataset_buckets",
    "decode_pixels",
    "decode_uint8",
    "device_pixels",
    "fast_tokenizer",
    "normalize_pixels",
    "precomputed_columns",
]

log = logging.getLogger("kiln.data")

Size = int | tuple[int, int]  # a square side, or (width, height) for an aspect bucket


def dataset_buckets(local: str) -> list[dict] | None:
    """A bucketed stage's aspect buckets, from its `buckets.json` ({name, width, height,
    samples} each, one MDS dataset per `name` subfolder); None for a plain MDS dataset."""
    path = Path(local) / "buckets.json"
    return json.loads(path.read_text())["buckets"] if path.is_file() else None


def precomputed_columns(local: str) -> set[str]:
    """Which precomputed columns (latent_mean, text_hidden) a local MDS dataset carries."""
    buckets = dataset_buckets(local)
    if buckets:
        local = str(Path(local) / buckets[0]["name"])
    index = json.loads((Path(local) / "index.json").read_text())
    names = set(index["shards"][0].get("column_names", [])) if index["shards"] else set()
    return names & {"latent_mean", "text_hidden"}


def _wh(size: Size) -> tuple[int, int]:
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
    (unless None).

    The loader ships uint8 (a quarter of the bytes of float32 through worker shared memory);
    the training step normalises on the device.
    """
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
    w, h = _wh(size)
    if tuple(img.shape[1:]) != (h, w):
        raise ValueError(
            f"shard image is {img.shape[2]}x{img.shape[1]}, expected {w}x{h}: "
            "were these shards written for another stage or bucket?"
        )
    return img


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


def normalize_pixels(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 (..., 3, H, W) -> float32 in [-1, 1]."""
    return pixels.float().div_(127.5).sub_(1.0)


def decode_pixels(data: bytes, size: Size) -> torch.Tensor:
    """Image bytes -> float tensor (3, H, W) in [-1, 1]."""
    return normalize_pixels(decode_uint8(data, size))


def fast_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """The Rust ("fast") version of `tokenizer`; converted once from its files if it is slow."""
    if tokenizer.is_fast:
        return tokenizer
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kiln-tok-") as d:
        tokenizer.save_pretrained(d)
        return AutoTokenizer.from_pretrained(d, use_fast=True)


class CaptionTokenizer:
    """Captions -> token ids, padded and truncated to the model's `model_max_length`, by the
    tokenizer's Rust backend. The loader and the shard step (which can store the ids in the
    shards) both tokenize with this, so stored ids are the ones the loader would make."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        from tokenizers import Tokenizer

        fast = fast_tokenizer(tokenizer)
        self.max_length = int(tokenizer.model_max_length)
        # A private copy of the backend: padding and truncation are set on it once, instead
        # of being re-applied by the Python wrapper on every call.
        backend = Tokenizer.from_str(fast.backend_tokenizer.to_str())
        backend.enable_truncation(self.max_length)
        backend.enable_padding(length=self.max_length, pad_id=fast.pad_token_id,
                               pad_token=fast.pad_token)  # fmt: skip
        self.backend = backend

    def __call__(self, captions: list[str]) -> torch.Tensor:
        """Token ids (len(captions), max_length), int64."""
        # One caption at a time on this thread: `encode_batch` hands the batch to a Rayon
        # thread pool, whose wake-up costs more than the work here (measured 42 vs 17 us per
        # caption between decodes) and which oversubscribes the cores loader workers share.
        enc = self.backend.encode
        return torch.tensor([enc(c).ids for c in captions], dtype=torch.int64)


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
        self.sizes = {_wh(x) for x in size} if isinstance(size, list) else {_wh(size)}
        self._empty: torch.Tensor | None = None
        self.ring: BatchRing | None = None  # set by KilnLoader around forking its workers

    def __getstate__(self) -> dict:
        # Workers started by spawn or forkserver get no ring: it is shared by fork only.
        return {**self.__dict__, "ring": None}

    def slot_bytes(self, dataset: ImageCaptionDataset, batch_size: int) -> int:
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
                    cols[col] = ((n, *arrays[0].shape), _dtype(arrays[0]),
                                 functools.partial(_stack, arrays))  # fmt: skip
        else:
            images = [s["image"] for s in samples]
            w, h = self._batch_size(images[0])
            # Decoders write (H, W, 3); the batch is decoded in that layout straight into its
            # buffer, and handed out as a (B, 3, H, W) view (channels-last strides). Stacking
            # (3, H, W) views into a (B, 3, H, W)-contiguous batch instead is a strided
            # transpose (measured 84 vs 34 us per 256-px image); the trainer makes the batch
            # contiguous on the device, where the transpose is nearly free.
            cols["pixel_values"] = ((n, h, w, 3), torch.uint8,
                                    functools.partial(_decode_into, images))  # fmt: skip
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
        if image[:2] == b"\xff\xd8":
            h, w, _, _ = simplejpeg.decode_jpeg_header(image)
        else:
            with Image.open(io.BytesIO(bytes(image))) as img:  # reads the header only
                w, h = img.size
        if (w, h) not in self.sizes:
            _wrong_size((w, h), self.sizes)
        return w, h

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


def _wrong_size(got: tuple[int, int], sizes: set[tuple[int, int]]):
    raise ValueError(
        f"a batch holds images of {[got]} (width x height), expected one of {sorted(sizes)}: "
        "were these shards written for another stage, or are buckets batched per stream?"
    )


def _decode_into(images: list, out: torch.Tensor) -> torch.Tensor:
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
                _wrong_size(hdr, sizes)
            if got != (h, w, 3):
                _wrong_size((got[1], got[0]), sizes)
        else:
            img = decode_uint8(data, None)
            if tuple(img.shape[1:]) != (h, w):
                _wrong_size((int(img.shape[2]), int(img.shape[1])), sizes)
            row[...] = img.permute(1, 2, 0).numpy()
    return out


def _ids_into(arrays: list[np.ndarray], drop: list[bool], empty: np.ndarray,
              out: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Stored token ids (int32 views of the shard) into `out` (B, L) int64, the empty
    caption's ids in the rows of dropped captions. Gathered by one small numpy copy and cast
    on the way into `out` (3 us a batch; a shared-memory temporary cost 100 times more)."""
    rows = out.numpy()
    rows[...] = np.array(arrays)
    if any(drop):
        rows[drop] = empty
    return out


def _jpeg_header(data) -> tuple[int, int] | None:
    try:
        h, w, _, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    return w, h


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


class KilnLoader(StreamingDataLoader):
    """A `StreamingDataLoader` whose workers stack batches into reused shared buffers
    (`models.ring.BatchRing`), made before the workers fork.

    The next epoch's workers inherit the same ring once the last epoch's workers are gone;
    then every slot that no tensor in this process still views is free again, including
    those of batches that were prefetched and never read (an epoch left early). While an
    earlier iterator's workers still run, a new iterator gets a ring of its own.
    """

    _ring: BatchRing | None = None
    _ring_iter: weakref.ref | None = None
    _slot_bytes: int | None = None

    def _get_iterator(self):
        collate = self.collate_fn
        if not (self.num_workers and isinstance(collate, KilnCollate) and self._forks()):
            return super()._get_iterator()
        prev = self._ring_iter() if self._ring_iter is not None else None
        busy = prev is not None and any(w.is_alive() for w in getattr(prev, "_workers", []))
        if self._ring is None or busy or not self._ring.reclaim():
            # Per worker: its prefetched batches, the one being filled and the one in use.
            slots = (self.prefetch_factor or 2) + 2
            if self._slot_bytes is None:
                self._slot_bytes = collate.slot_bytes(self.dataset, self.batch_size)
            self._ring = BatchRing(self.num_workers, slots, self._slot_bytes)
        collate.ring = self._ring
        try:
            it = super()._get_iterator()  # forks the workers, which keep the ring
        finally:
            collate.ring = None
        self._ring_iter = weakref.ref(it)
        return it

    def _forks(self) -> bool:
        """Whether workers start by fork, the only way they share the ring's mapping."""
        ctx = self.multiprocessing_context
        if ctx is not None:
            return ctx.get_start_method() == "fork"
        method = mp.get_start_method(allow_none=True)  # None: the platform's default
        return (method or mp.get_all_start_methods()[0]) == "fork"


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


def _plan(shard) -> tuple | None:
    """(file path, struct format of the variable-size columns' sizes, [(name, fixed size,
    decoder)]) of an uncompressed MDS shard, worked out once per shard, not once per sample."""
    plan = getattr(shard, "_kiln_plan", False)
    if plan is False:
        plan = None
        raw = getattr(shard, "raw_data", None)
        if raw is not None and hasattr(shard, "column_sizes"):
            columns = []
            for name, enc, size in zip(shard.column_names, shard.column_encodings,
                                       shard.column_sizes, strict=True):  # fmt: skip
                if enc == "bytes":
                    decode = _as_view
                elif enc == "str":
                    decode = _utf8
                else:
                    decode = _coder(enc)
                columns.append((name, size, decode))
            path = os.path.join(shard.dirname, shard.split or "", raw.basename)
            plan = (path, f"<{sum(size is None for size in shard.column_sizes)}I", columns)
        shard._kiln_plan = plan
    return plan


def _as_view(data: memoryview) -> memoryview:
    return data


def _utf8(data: memoryview) -> str:
    return str(data, "utf-8")


def _coder(encoding: str):
    # streaming's decoder for one encoding, parsed once. The others get bytes.
    from streaming.base.format.mds.encodings import _get_coder

    coder = _get_coder(encoding)
    if coder is None:
        raise ValueError(f"unsupported MDS column encoding: {encoding!r}")
    if encoding.startswith("ndarray"):
        return _NDArrayView(coder)
    return _Decode(coder)


class _Decode:
    """streaming's decoder for one scalar column (a class, not a lambda: the plan cached on
    a shard is pickled with the dataset when workers are spawned)."""

    def __init__(self, coder):
        self.coder = coder

    def __call__(self, data: memoryview):
        return self.coder.decode(bytes(data))


class _NDArrayView:
    """Decodes an MDS ndarray column as a view of the mapped shard (no copy).

    An ndarray without a fixed shape in its encoding stores a small dtype/shape header per
    sample. Every sample of a Kiln column has the same shape, so the header of the first
    sample is parsed by streaming and remembered; later samples with identical header bytes
    skip the parse.
    """

    def __init__(self, coder):
        self.coder = coder
        self.header: bytes | None = None
        self.dtype = self.shape = None

    def __call__(self, data: memoryview) -> np.ndarray:
        h = self.header
        if h is not None and data[: len(h)] == h:
            return np.frombuffer(data, self.dtype, offset=len(h)).reshape(self.shape)
        arr = self.coder.decode(data)
        nbytes = arr.size * arr.dtype.itemsize
        self.header = bytes(data[: len(data) - nbytes])
        self.dtype, self.shape = arr.dtype, arr.shape
        return arr


# Open shard maps of this process, least recently used first. Mapped once, a sample read is a
# slice (no open/seek/read per sample); bounded so a long epoch over many shards does not
# hold thousands of maps. Keyed by path: a published shard file never changes (a new dataset
# version is a new folder, and a shard evicted and fetched again has the same bytes).
_MAPS: OrderedDict[str, memoryview] = OrderedDict()
_MAX_MAPS = 64


def _shard_map(path: str) -> memoryview:
    """A read-only view of the shard file at `path`, mapped once per process."""
    m = _MAPS.get(path)
    if m is None:
        with open(path, "rb") as f:
            # MAP_POPULATE maps the whole (page-cached) shard in one call instead of one page
            # fault per 4 KiB on first touch, which costs more than the copy itself.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            m = memoryview(mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ))
        _MAPS[path] = m
        if len(_MAPS) > _MAX_MAPS:
            # Dropped, not closed: a batch being collated may still hold views of it.
            _MAPS.popitem(last=False)
    else:
        _MAPS.move_to_end(path)
    return m


# The columns training reads; the others (original size, crop, metadata) are not decoded.
_USED = frozenset({"latent_mean", "latent_std", "text_hidden", "input_ids", "image", "caption",
                   "key"})  # fmt: skip


class ImageCaptionDataset(StreamingDataset):
    """A StreamingDataset of Kiln's MDS shards (images or precomputed latents).

    `dataset[i]` is the stored sample with its caption dropout applied, its arrays and image
    bytes as views of the mapped shard; `KilnCollate` turns a list of them into a batch.

    Args:
        local: Folder of the stage's MDS dataset (or the local cache, with `remote`).
        caption_dropout: Probability of training on the empty caption, which gives the model
            its unconditional branch for classifier-free guidance. Decided per sample index
            from `seed`, so a resumed run drops exactly the same captions.
        hflip: Probability of mirroring an image left to right (image shards only; stored
            latents are never flipped). Decided per sample index like `caption_dropout`.
        **kwargs: Passed to `StreamingDataset` (remote, streams, batch_size, shuffle...).
    """

    def __init__(
        self,
        *,
        local: str | None = None,
        caption_dropout: float = 0.0,
        hflip: float = 0.0,
        seed: int = 0,
        **kwargs,
    ):
        if kwargs.get("streams"):
            super().__init__(**kwargs)
        else:
            super().__init__(local=local, **kwargs)
        self.caption_dropout = caption_dropout
        self.hflip = hflip
        self.seed = seed
        # What __getitem__ reads; build_loader leaves out the captions (stored ids used) or
        # the ids (captions tokenized).
        self.columns = _USED
        self._starts: list[int] | None = None

    def prepare_shard(self, shard_id: int, blocking: bool = True) -> None:
        # Streaming's download thread calls this for every sample, and each call takes the
        # cache's file lock. Without a cache limit nothing is ever evicted, so a shard found
        # LOCAL stays LOCAL and needs no lock (this matters while some shards are remote;
        # when all are local the thread does not run at all, below).
        from streaming.base.dataset import _ShardState

        if not self.cache_limit and self._shard_states[shard_id] == _ShardState.LOCAL:
            return
        super().prepare_shard(shard_id, blocking)

    def _all_local(self) -> bool:
        from streaming.base.dataset import _ShardState

        return not self.cache_limit and bool(
            (self._shard_states.numpy() == _ShardState.LOCAL).all()
        )

    # Streaming runs two threads per epoch (in every worker) that walk every sample id to
    # download its shard and then mark it ready. When every shard is already local and none
    # can be evicted there is nothing for them to do, yet they compete with the reading thread
    # for the GIL for every sample. Both are then finished at once.
    def _prepare_thread(self, it) -> None:
        if not self._finished_at_once(it, "prepare_index"):
            super()._prepare_thread(it)

    def _ready_thread(self, it) -> None:
        if not self._finished_at_once(it, "ready_index"):
            super()._ready_thread(it)

    def _finished_at_once(self, it, index: str) -> bool:
        if not self._all_local():
            return False
        setattr(it, index, it.total)
        it.on_exit()  # what the thread does when it runs out of samples
        return True

    def _read(self, idx: int, columns: frozenset[str] | None = None) -> dict:
        """Sample `idx` as stored: the given columns (default all), arrays and bytes as views."""
        starts = self._starts
        if starts is None:  # each shard's first sample index, as plain ints for bisect
            starts = self._starts = [0, *np.cumsum(self.samples_per_shard).tolist()]
        idx = int(idx)
        if not 0 <= idx < starts[-1]:
            raise IndexError(f"sample index {idx} is not in [0, {starts[-1]})")
        shard_id = bisect.bisect_right(starts, idx) - 1
        rel = idx - starts[shard_id]
        shard = self.shards[shard_id]
        plan = _plan(shard)
        try:
            m = None if plan is None else _shard_map(plan[0])
        except FileNotFoundError:  # not downloaded (or evicted): streaming fetches it
            m = None
        if m is None:  # or not an uncompressed MDS shard: streaming's own reader
            sample = self.get_item(idx)
            return sample if columns is None else {k: sample[k] for k in columns & sample.keys()}
        _, var_format, plan_columns = plan
        # The sample's [begin, end) from the shard's offset table, then the sizes of its
        # variable-size columns from its head: plain ints, through struct (numpy scalars and
        # views cost microseconds a sample here).
        begin, end = struct.unpack_from("<2I", m, 4 + 4 * rel)
        data = m[begin:end]
        var = iter(struct.unpack_from(var_format, data))
        pos, sample = struct.calcsize(var_format), {}
        for name, size, decode in plan_columns:
            if size is None:
                size = next(var)
            if columns is None or name in columns:
                sample[name] = decode(data[pos : pos + size])
            pos += size
        return sample

    def __getitem__(self, idx: int) -> dict:
        sample = self._read(idx, self.columns)
        drop = bool(self.caption_dropout and _uniform(self.seed, idx) < self.caption_dropout)
        if drop and "caption" in sample:
            sample["caption"] = ""
        sample["drop"] = drop
        if self.hflip and "image" in sample:
            sample["flip"] = _uniform(self.seed, idx, 1) < self.hflip
        return sample


_M64 = (1 << 64) - 1


def _uniform(seed: int, idx: int, salt: int = 0) -> float:
    """A number in [0, 1) fixed by (seed, idx), for per-sample decisions that a resumed run
    must repeat: splitmix64's mix of the pair (0.3 us a sample, where seeding a numpy
    Generator per sample costs 8). Each kind of decision has its own `salt`, so that they
    are independent (caption dropout 0, flip 1)."""
    z = ((int(seed) & _M64) * 0x9E3779B97F4A7C15 + int(idx) + 0x9E3779B97F4A7C15) & _M64
    z = (z + int(salt) * 0xD1B54A32D192ED03) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return ((z ^ (z >> 31)) >> 11) * 2.0**-53


def _stored_ids_match(dataset: ImageCaptionDataset, tokenize: CaptionTokenizer) -> bool:
    """Whether every shard stores token ids, and they are what `tokenize` makes of the stored
    captions (each stream's first sample): ids written with another tokenizer or length are
    not used."""
    if not all("input_ids" in getattr(sh, "column_names", ()) for sh in dataset.shards):
        return False
    for offset, count in zip(dataset.sample_offset_per_stream, dataset.samples_per_stream,
                             strict=True):  # fmt: skip
        if not count:
            continue
        s = dataset._read(int(offset), frozenset({"caption", "input_ids", "key"}))
        want = tokenize([s["caption"]])[0].numpy()
        got = np.asarray(s["input_ids"])
        if got.shape != want.shape or not np.array_equal(got, want):
            log.warning("the token ids stored with %s are not this tokenizer's (sample %s): "
                        "tokenizing captions in the loader instead", dataset.streams[0].local
                        if len(dataset.streams) == 1 else "a stream", s["key"])  # fmt: skip
            return False
    return True


def _fetch_top_file(local: str, remote: str) -> None:
    """Bring a remote dataset's top file into its cache: `index.json`, or for a stage written
    as aspect buckets, `buckets.json` (which says which bucket datasets to stream)."""
    from streaming.base.storage.download import CloudDownloader

    if any((Path(local) / name).is_file() for name in ("index.json", "buckets.json")):
        return
    try:
        CloudDownloader.direct_download(f"{remote}/index.json", str(Path(local) / "index.json"))
        return
    except Exception:  # noqa: BLE001 - a probe: not a plain dataset; try the bucketed layout
        pass
    try:
        CloudDownloader.direct_download(f"{remote}/buckets.json", str(Path(local) / "buckets.json"))
    except Exception as e:
        raise FileNotFoundError(
            f"{remote} has neither index.json nor buckets.json: is this dataset version "
            "published there (the shard flow publishes it when shards.remote is set)?"
        ) from e


def build_loader(
    local: str,
    tokenizer: PreTrainedTokenizerBase,
    resolution: Size,
    batch_size: int,
    *,
    shuffle_seed: int,
    seed: int = 0,
    caption_dropout: float = 0.0,
    hflip: float = 0.0,
    num_workers: int = 0,
    remote: str | None = None,
    mix: list[tuple[str, float]] | list[tuple[str, float, str]] | None = None,
    shuffle_algo: str = "py1e",
    predownload: int | None = None,
    cache_limit: str | None = None,
    token_ids: bool = True,
    epoch_size: int | None = None,
) -> KilnLoader:
    """A per-rank loader of `batch_size` samples; the rank split comes from the environment.

    `mix` adds other datasets as streams, each (local folder, proportion), or (local cache,
    proportion, remote); `local` then gets the remaining share. Proportions fix each epoch's
    composition (streaming up- or down-samples each stream to its share).

    With `remote` (an `s3://` or folder copy published by `tasks.publish`), `local` is the
    cache that shards are streamed into.

    A bucketed stage (`buckets.json`, see `tasks/shard.py`) becomes one stream per aspect
    bucket, each with its share of the dataset's proportion, batched `per_stream`: every batch
    comes from one bucket, so its images have one shape.

    Token ids stored in the shards (`shards.token_ids`, or precomputed with latents) are used
    when `token_ids` is on and they are the ids `tokenizer` gives the stored captions (checked
    on each stream's first sample); otherwise the loader tokenizes the captions itself.

    `hflip` mirrors that share of the images left to right, chosen per sample index from
    `seed` (so a resumed run flips the same ones). Precomputed latents are not flipped.

    `epoch_size` sets the samples per epoch (streaming's `epoch_size`: the streams are up- or
    down-sampled to it, in their proportions); by default an epoch is the data once.
    """
    from streaming import Stream

    if not 0 <= hflip <= 1:
        raise ValueError(f"hflip is a probability in [0, 1], got {hflip!r}")

    def parts(path: str, remote: str | None, share: float) -> tuple[list, list]:
        if remote:
            _fetch_top_file(path, remote)
        buckets = dataset_buckets(path)
        if buckets is None:
            return [Stream(local=path, remote=remote, proportion=share)], []
        total = sum(b["samples"] for b in buckets)
        return [
            Stream(local=str(Path(path) / b["name"]),
                   remote=f"{remote}/{b['name']}" if remote else None,
                   proportion=share * b["samples"] / total)
            for b in buckets
        ], [(b["width"], b["height"]) for b in buckets]  # fmt: skip

    rest = 1.0 - sum(m[1] for m in mix or [])
    streams, sizes = parts(local, remote, rest)
    for path, p, *more_remote in mix or []:
        more, more_sizes = parts(path, more_remote[0] if more_remote else None, p)
        streams += more
        sizes += more_sizes
    bucketed = bool(sizes)
    if bucketed:
        sizes = sorted(set(sizes) | {_wh(resolution)})
    single = len(streams) == 1
    dataset = ImageCaptionDataset(
        local=local if single else None,
        remote=remote if single else None,
        streams=None if single else streams,
        batching_method="per_stream" if bucketed else "random",
        caption_dropout=caption_dropout,
        hflip=hflip,
        seed=seed,
        batch_size=batch_size,
        shuffle=True,
        shuffle_seed=shuffle_seed,
        shuffle_algo=shuffle_algo,
        predownload=predownload,
        cache_limit=cache_limit,
        epoch_size=epoch_size,
    )
    if hflip and "latent_mean" in getattr(dataset.shards[0], "column_names", ()):
        log.warning("hflip=%s is not applied: these shards hold precomputed latents, which "
                    "are never flipped", hflip)  # fmt: skip
    collate = KilnCollate(tokenizer, sizes if bucketed else resolution)
    if token_ids and _stored_ids_match(dataset, collate.ids):
        dataset.columns = _USED - {"caption"}  # only tokenizing needs the captions
    else:
        dataset.columns = _USED - {"input_ids"}
    return KilnLoader(
        dataset,
        batch_size=batch_size,
        collate_fn=collate,
        num_workers=num_workers,
        drop_last=True,
        persistent_workers=False,
        # Each new iterator draws a base seed from this generator. Left at the default, it
        # would draw from the global torch RNG, and a resumed run (which restores that RNG
        # and then starts a new iterator) would sample different noise than the original.
        generator=torch.Generator().manual_seed(seed),
    )
