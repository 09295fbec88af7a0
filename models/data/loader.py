"""The training loader: Kiln's MDS shards -> batches of uint8 pixels (or latents) and token ids.

`build_loader` makes a `KilnLoader` (a `StreamingDataLoader`) over an `ImageCaptionDataset`,
configured by the `train` section. Streaming partitions samples across ranks itself (from the
WORLD_SIZE/RANK that `accelerate launch` sets), so this loader must stay out of
`accelerator.prepare`: wrapping it again would silently double-shard.

The per-sample path is kept to reading the stored bytes (`models.data.mds_reader`) and the
per-sample decisions a resumed run must repeat (caption dropout, hflip); everything else runs
on the whole batch in `models.data.collation.KilnCollate`, which in a worker writes into reused
shared buffers (`models.data.shared_batch_buffers`) that `KilnLoader` makes before its workers
fork.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import weakref
from pathlib import Path

import numpy as np
import torch
from streaming import StreamingDataLoader
from transformers import PreTrainedTokenizerBase

from kiln_config import TrainConfig
from kiln_config.errors import InputError, MissingInput
from models.data.collation import KilnCollate
from models.data.images import Size, width_height
from models.data.mds_reader import MDSReader
from models.data.shared_batch_buffers import BatchRing
from models.data.tokenization import CaptionTokenizer

__all__ = [
    "TRAINING_COLUMNS",
    "ImageCaptionDataset",
    "KilnLoader",
    "build_loader",
    "dataset_buckets",
    "precomputed_columns",
]

log = logging.getLogger("kiln.data")

# The columns training reads; the others (original size, crop, metadata) are not decoded.
TRAINING_COLUMNS = frozenset(
    {"latent_mean", "latent_std", "text_hidden", "input_ids", "image", "caption", "key"}
)


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


class ImageCaptionDataset(MDSReader):
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
        self.columns = TRAINING_COLUMNS

    def __getitem__(self, idx: int) -> dict:
        sample = self.read_sample(idx, self.columns)
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


class KilnLoader(StreamingDataLoader):
    """A `StreamingDataLoader` whose workers stack batches into reused shared buffers
    (`models.data.shared_batch_buffers.BatchRing`), made before the workers fork.

    The next epoch's workers inherit the same ring once the last epoch's workers are gone;
    then every slot that no tensor in this process still views is free again, including
    those of batches that were prefetched and never read (an epoch left early). While an
    earlier iterator's workers still run, a new iterator gets a ring of its own.
    """

    _ring: BatchRing | None = None
    _ring_iter: weakref.ref | None = None
    _slot_bytes: int | None = None

    # Overrides torch's private DataLoader._get_iterator: where a new iterator forks its
    # workers, which must find the ring already made.
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


def _stored_ids_match(dataset: ImageCaptionDataset, tokenize: CaptionTokenizer) -> bool:
    """Whether every shard stores token ids, and they are what `tokenize` makes of the stored
    captions (each stream's first sample): ids written with another tokenizer or length are
    not used."""
    if not all("input_ids" in getattr(sh, "column_names", ()) for sh in dataset.shards):
        return False
    for offset, count in zip(
        dataset.sample_offset_per_stream, dataset.samples_per_stream, strict=True
    ):
        if not count:
            continue
        s = dataset.read_sample(int(offset), frozenset({"caption", "input_ids", "key"}))
        want = tokenize([s["caption"]])[0].numpy()
        got = np.asarray(s["input_ids"])
        if got.shape != want.shape or not np.array_equal(got, want):
            log.warning(
                "the token ids stored with %s are not this tokenizer's (sample %s): "
                "tokenizing captions in the loader instead",
                dataset.streams[0].local if len(dataset.streams) == 1 else "a stream",
                s["key"],
            )
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
        raise MissingInput(
            f"{remote} has neither index.json nor buckets.json: is this dataset version "
            "published there (the shard flow publishes it when shards.remote is set)?"
        ) from e


def _streams(local: str, remote: str | None, mix: list, resolution: Size) -> tuple[list, list]:
    """Streaming's streams for `local` (with `remote`) and each `mix` entry, and the aspect
    buckets' sizes (empty when no dataset is bucketed)."""
    from streaming import Stream

    def parts(path: str, remote: str | None, share: float) -> tuple[list, list]:
        if remote:
            _fetch_top_file(path, remote)
        buckets = dataset_buckets(path)
        if buckets is None:
            return [Stream(local=path, remote=remote, proportion=share)], []
        total = sum(b["samples"] for b in buckets)
        return [
            Stream(
                local=str(Path(path) / b["name"]),
                remote=f"{remote}/{b['name']}" if remote else None,
                proportion=share * b["samples"] / total,
            )
            for b in buckets
        ], [(b["width"], b["height"]) for b in buckets]

    rest = 1.0 - sum(m[1] for m in mix)
    streams, sizes = parts(local, remote, rest)
    for path, p, *more_remote in mix:
        more, more_sizes = parts(path, more_remote[0] if more_remote else None, p)
        streams += more
        sizes += more_sizes
    if sizes:
        sizes = sorted(set(sizes) | {width_height(resolution)})
    return streams, sizes


def build_loader(
    cfg: TrainConfig,
    local: str,
    tokenizer: PreTrainedTokenizerBase,
    resolution: Size,
    batch_size: int,
    *,
    stage_index: int = 0,
    remote: str | None = None,
    mix: list[tuple[str, float]] | list[tuple[str, float, str]] | None = None,
    token_ids: bool = True,
    epoch_size: int | None = None,
) -> KilnLoader:
    """A per-rank loader of `batch_size` samples; the rank split comes from the environment.

    Args:
        cfg: The `train` section. Read here: `seed` (caption dropout, hflip and the workers'
            base seeds), `shuffle_seed` (plus `stage_index`, so each stage shuffles its own
            way), `caption_dropout`, `hflip`, `num_workers`, `shuffle_algo`, `predownload`
            and `cache_limit`.
        local: Folder of the stage's MDS dataset; with `remote` (an `s3://` or folder copy
            published by `tasks.shards.publish`), the cache that shards are streamed into. A
            bucketed stage (`buckets.json`, see `tasks/shards/write.py`) becomes one stream per
            aspect bucket, each with its share of the dataset's proportion, batched
            `per_stream`: every batch comes from one bucket, so its images have one shape.
        tokenizer: The model's tokenizer.
        resolution: The stage's image size (the square side, or (width, height)).
        batch_size: Samples per batch on this rank.
        stage_index: The stage, added to `cfg.shuffle_seed`.
        remote: Published copy of `local`'s dataset.
        mix: Other datasets added as streams, each (local folder, proportion), or (local
            cache, proportion, remote); `local` then gets the remaining share. Proportions fix
            each epoch's composition (streaming up- or down-samples each stream to its share).
        token_ids: Use token ids stored in the shards (`shards.token_ids`, or precomputed with
            latents) when they are the ids `tokenizer` gives the stored captions (checked on
            each stream's first sample); otherwise the loader tokenizes the captions itself.
        epoch_size: Samples per epoch (streaming's `epoch_size`: the streams are up- or
            down-sampled to it, in their proportions); by default an epoch is the data once.

    `cfg.hflip` mirrors that share of the images left to right, chosen per sample index from
    `cfg.seed` (so a resumed run flips the same ones). Precomputed latents are not flipped.
    """
    if not 0 <= cfg.hflip <= 1:  # validated in TrainConfig, but a copy can bypass that
        raise InputError(f"hflip is a probability in [0, 1], got {cfg.hflip!r}")
    streams, sizes = _streams(local, remote, mix or [], resolution)
    dataset = _dataset(
        cfg, local, remote, streams, bool(sizes), batch_size, stage_index, epoch_size
    )
    collate = KilnCollate(tokenizer, sizes or resolution)
    if token_ids and _stored_ids_match(dataset, collate.ids):
        dataset.columns = TRAINING_COLUMNS - {"caption"}  # only tokenizing needs the captions
    else:
        dataset.columns = TRAINING_COLUMNS - {"input_ids"}
    return KilnLoader(
        dataset,
        batch_size=batch_size,
        collate_fn=collate,
        num_workers=cfg.num_workers,
        drop_last=True,
        persistent_workers=False,
        # Each new iterator draws a base seed from this generator. Left at the default, it
        # would draw from the global torch RNG, and a resumed run (which restores that RNG
        # and then starts a new iterator) would sample different noise than the original.
        generator=torch.Generator().manual_seed(cfg.seed),
    )


def _dataset(
    cfg: TrainConfig,
    local: str,
    remote: str | None,
    streams: list,
    bucketed: bool,
    batch_size: int,
    stage_index: int,
    epoch_size: int | None,
) -> ImageCaptionDataset:
    """The stage's dataset: `local` (and `remote`) alone, or `streams` when there are several;
    a bucketed one batches per stream, so every batch has one image shape."""
    single = len(streams) == 1
    dataset = ImageCaptionDataset(
        local=local if single else None,
        remote=remote if single else None,
        streams=None if single else streams,
        batching_method="per_stream" if bucketed else "random",
        caption_dropout=cfg.caption_dropout,
        hflip=cfg.hflip,
        seed=cfg.seed,
        batch_size=batch_size,
        shuffle=True,
        shuffle_seed=cfg.shuffle_seed + stage_index,
        shuffle_algo=cfg.shuffle_algo,
        # Fixed, not streaming's count of the nodes it runs on: 2 nodes x 1 process and
        # 1 node x 2 processes then see the same samples in the same order.
        num_canonical_nodes=cfg.canonical_nodes(),
        predownload=cfg.predownload,
        cache_limit=cfg.cache_limit,
        epoch_size=epoch_size,
    )
    if cfg.hflip and "latent_mean" in getattr(dataset.shards[0], "column_names", ()):
        log.warning(
            "hflip=%s is not applied: these shards hold precomputed latents, which "
            "are never flipped",
            cfg.hflip,
        )
    return dataset
