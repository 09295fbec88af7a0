"""A `StreamingDataset` that reads uncompressed MDS samples as views of the mapped shard file.

`MDSReader.read_sample` maps each shard file once per process and returns a sample's columns
as views into it: no open/seek/read and no copy per sample. Shards it cannot map (compressed,
or not downloaded yet) go through streaming's own `get_item`, which fetches them.

Every override of mosaicml-streaming's methods, and every use of its private names, is in
this module (`models/data/stale_streaming_files.py` reads only its public naming constants); a
minor release may change them, which is why pyproject.toml pins streaming below the next
one. Overridden or used here:

- `StreamingDataset.prepare_shard` (public, called per sample by streaming's download
  thread): skipped for a shard already local when nothing can be evicted, since each call
  takes the cache's file lock.
- `StreamingDataset._prepare_thread` and `_ready_thread` (private, the two threads each
  worker runs per epoch): finished at once when every shard is local and none can be
  evicted, instead of walking every sample id while competing with the reader for the GIL.
  They mark the iterator done through its private fields `prepare_index`, `ready_index`,
  `total` and `on_exit()`, which is what the threads themselves do when they run out.
- `StreamingDataset._shard_states` and `streaming.base.dataset._ShardState` (private): which
  shards are local.
- A shard's `raw_data`, `column_names`, `column_encodings`, `column_sizes`, `dirname` and
  `split`, and `streaming.base.format.mds.encodings._get_coder` (private): the MDS layout,
  read once per shard (`_plan`).
- `streaming.base.dataset.get_shm_prefix` (the name `StreamingDataset.__init__` calls),
  replaced for every dataset in a process that imports this module by `agreed_shm_prefix`,
  which uses the private `_check_self`, `_check_and_find_retrying` and `_get_path`,
  `_pack_locals` and `_unpack_locals` of `streaming.base.shared.prefix`: the ranks of a node
  agree on the shared-memory prefix before the local leader registers it.
"""

from __future__ import annotations

import bisect
import mmap
import os
import struct
import time
from collections import OrderedDict

import numpy as np
import streaming.base.dataset as _streaming_dataset
from streaming import StreamingDataset
from streaming.base.constant import LOCALS, SHM_TO_CLEAN
from streaming.base.shared import SharedMemory
from streaming.base.shared import prefix as _prefix
from torch import distributed as dist

__all__ = ["MDSReader", "agreed_shm_prefix", "release_shared_memory"]


class MDSReader(StreamingDataset):
    """A StreamingDataset whose `read_sample` returns stored samples as views of the shard.

    Args:
        **kwargs: Passed to `StreamingDataset` (local, remote, streams, batch_size, ...).
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._starts: list[int] | None = None

    def release(self) -> None:
        """Free the shared memory this dataset holds (streaming's `SharedMemory` objects, each
        an open file under /dev/shm, which streaming keeps until the process exits). For a
        dataset read in a long-lived process (validation in the training process, a test
        session): about two dozen descriptors per dataset otherwise. Unusable afterwards."""
        release_shared_memory(self)

    def read_sample(self, idx: int, columns: frozenset[str] | None = None) -> dict:
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


# Open shard maps of this process, least recently used first. Mapped once, a sample read is a
# slice (no open/seek/read per sample); bounded so a long epoch over many shards does not
# hold thousands of maps. Keyed by path: a published shard file never changes (a new dataset
# version is a new folder, and a shard evicted and fetched again has the same bytes).
_MAPS: OrderedDict[str, memoryview] = OrderedDict()
_MAX_MAPS = 64
_CLAIM_TRIES = 5  # looks for a free shared-memory prefix when another job takes ours first


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


def _plan(shard) -> tuple | None:
    """(file path, struct format of the variable-size columns' sizes, [(name, fixed size,
    decoder)]) of an uncompressed MDS shard, worked out once per shard, not once per sample."""
    plan = getattr(shard, "_kiln_plan", False)
    if plan is False:
        plan = None
        raw = getattr(shard, "raw_data", None)
        if raw is not None and hasattr(shard, "column_sizes"):
            columns = []
            for name, enc, size in zip(
                shard.column_names, shard.column_encodings, shard.column_sizes, strict=True
            ):
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


def release_shared_memory(dataset: StreamingDataset) -> None:
    """Close (and unlink what it created) every streaming `SharedMemory` a dataset holds,
    directly or inside its shared arrays, scalars and barrier (private attributes of
    streaming's shared-memory classes: see the module docstring)."""
    from streaming.base.shared import SharedMemory

    seen: set[int] = set()

    def visit(obj, depth: int = 0) -> None:
        if id(obj) in seen or depth > 3:
            return
        seen.add(id(obj))
        if isinstance(obj, SharedMemory):
            obj.cleanup()
            return
        if type(obj).__module__.startswith("streaming.base.shared"):
            for v in vars(obj).values():
                visit(v, depth + 1)

    for v in list(vars(dataset).values()):
        visit(v)


def agreed_shm_prefix(streams_local, streams_remote, world, retry: int = 100):
    """streaming's `get_shm_prefix`, with the ranks of each node agreeing on the prefix.

    streaming has every rank look for the first free shared-memory prefix on its own, before
    its barrier. When another job on the machine registers one between two ranks' looks, they
    pick different prefixes, and a non-leader rank fails: "shared memory prefix=N was not
    registered by local leader" (seen in this test suite, with a dataset of the other test
    worker's opening at that moment). Here every rank's pick is gathered, and the ranks of a
    node all take that node's largest, which was free when its rank looked; then, as in
    streaming, the local leader registers it and the other ranks check it.

    Returns:
        (the prefix, its `SharedMemory` of the registered locals), as streaming's.
    """
    if not (dist.is_available() and dist.is_initialized()):
        for attempt in range(_CLAIM_TRIES):
            try:
                return _prefix.get_shm_prefix(streams_local, streams_remote, world, retry)
            except FileExistsError:
                # another job on this machine took the prefix between streaming's look for a
                # free one and its claim (seen with the other test worker's dataset): look again
                if attempt == _CLAIM_TRIES - 1:
                    raise
                time.sleep(0.05 * (attempt + 1))
    _prefix._check_self(streams_local)
    mine = max(
        _prefix._check_and_find_retrying(streams_local, streams_remote, shm_name=name, retry=retry)
        for name in SHM_TO_CLEAN
    )
    picks: list = [None] * dist.get_world_size()
    dist.all_gather_object(picks, (world.node, mine))
    prefix_int = max(p for node, p in picks if node == world.node)
    name = _prefix._get_path(prefix_int, LOCALS)
    if world.is_local_leader:
        data = _prefix._pack_locals(streams_local, prefix_int)
        shm = SharedMemory(name, True, len(data))
        shm.buf[: len(data)] = data
    dist.barrier()
    if not world.is_local_leader:
        try:
            shm = SharedMemory(name, False)
        except FileNotFoundError:
            raise RuntimeError(
                f"shared memory prefix {prefix_int} was not registered by this node's leader "
                "rank: do all ranks pass the same `local` folders?"
            ) from None
        their_locals, their_prefix = _prefix._unpack_locals(bytes(shm.buf))
        if streams_local != their_locals or prefix_int != their_prefix:
            raise RuntimeError(
                f"the leader rank registered {their_locals} at prefix {their_prefix}; this "
                f"rank expected {streams_local} at {prefix_int}"
            )
    return prefix_int, shm


# Every StreamingDataset created in this process (MDSReader and plain ones) agrees on its prefix.
_streaming_dataset.get_shm_prefix = agreed_shm_prefix
