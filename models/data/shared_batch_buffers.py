"""Batch buffers shared between DataLoader workers and the trainer, reused instead of fresh.

By default every batch a loader worker makes is a fresh shared-memory segment: the worker
creates and maps it, faults in every page, and hands the file descriptor to the main
process, which maps it again. For a 32-image 256-px batch (6.3 MB) that costs about 4 ms on
the VMs measured, as much as collating it; `docs/benchmarks.md` has the figures.

`BatchRing` is one anonymous shared mapping made by the main process before the workers
fork, cut into slots, a few per worker. A worker stacks its batch into a free slot of its
own and sends a few numbers instead of a tensor (`InRing`); the main process rebuilds a
tensor that views the slot in place.

A slot is reused only when nothing in the main process references its memory any more. Each
rebuilt tensor's storage holds a numpy view of the slot, and a finalizer on that view frees
the slot when the last tensor over it is gone: after the trainer has moved the batch to the
device and dropped it, or the pin-memory thread has copied it. A batch kept for longer (a
test holding every batch, a user's list) keeps its slot. A worker that finds none of its
slots free stacks into a fresh segment as before, so a held batch is never overwritten, and
a worker never waits.

Only the fork start method shares the mapping; under spawn or forkserver the collate is
pickled without it (`KilnCollate.__getstate__`) and workers use fresh segments.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import multiprocessing as mp
import secrets
import threading
import weakref

import numpy as np
import torch

__all__ = ["BatchRing", "InRing"]

_PAGE = mmap.PAGESIZE
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14
# Rings of this process by token, for rebuilding tensors as batches arrive. Weak: a ring
# lives while its loader or any tensor over one of its slots does.
_RINGS: weakref.WeakValueDictionary[str, BatchRing] = weakref.WeakValueDictionary()


class BatchRing:
    """`slots_per_worker` slots of `slot_bytes` for each of `num_workers` loader workers."""

    def __init__(self, num_workers: int, slots_per_worker: int, slot_bytes: int):
        if num_workers < 1 or slots_per_worker < 1 or slot_bytes < 1:
            raise ValueError(f"ring of {num_workers} x {slots_per_worker} x {slot_bytes} bytes")
        self.token = secrets.token_hex(8)
        self.per_worker = slots_per_worker
        self.slot_bytes = -(-slot_bytes // _PAGE) * _PAGE
        ctx = mp.get_context("fork")
        # Slot states shared with the workers: 0 free, 1 filled by its worker and not yet
        # released by the main process. The lock orders each worker's writes into a slot
        # after the main process's last read of it (a barrier on weakly ordered CPUs too).
        self.state = ctx.RawArray("B", num_workers * slots_per_worker)
        self.lock = ctx.Lock()
        # MAP_SHARED|MAP_ANONYMOUS: inherited by forked workers, gone with the last process
        # that maps it (nothing to clean up after a crash). Populated once, here.
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_ANONYMOUS", 0x20)
        flags |= getattr(mmap, "MAP_POPULATE", 0)
        self.mm = mmap.mmap(-1, len(self.state) * self.slot_bytes, flags=flags)
        self._next = 0  # worker side: the slot to try first, round robin
        self._mapped: set[int] = set()  # worker side: slots whose pages this process mapped
        self._live: dict[int, int] = {}  # main side: live tensors per slot
        self._live_lock = threading.Lock()
        self.rebuilt = 0  # main side: tensors rebuilt from slots (for tests and benchmarks)
        _RINGS[self.token] = self

    def __getstate__(self):
        raise TypeError("a BatchRing is shared by fork only")

    # -- worker side ---------------------------------------------------------------------------
    def claim(self, worker: int) -> int | None:
        """A free slot of `worker`, now marked filled; None when all of them are held."""
        first = worker * self.per_worker
        with self.lock:
            for i in range(self.per_worker):
                slot = first + (self._next + i) % self.per_worker
                if self.state[slot] == 0:
                    self.state[slot] = 1
                    self._next = (slot - first + 1) % self.per_worker
                    break
            else:
                return None
        if slot not in self._mapped:
            # A forked worker has no page-table entries for the shared mapping: its first
            # write to each page of a slot faults. One madvise maps the whole slot instead.
            self._mapped.add(slot)
            with contextlib.suppress(OSError, ValueError):  # before Linux 5.14: fault lazily
                self.mm.madvise(_MADV_POPULATE_WRITE, slot * self.slot_bytes, self.slot_bytes)
        return slot

    def tensor(self, slot: int, offset: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        """A writable tensor over part of `slot`, from `offset` bytes."""
        nbytes = math.prod(shape) * dtype.itemsize
        assert offset + nbytes <= self.slot_bytes, (offset, nbytes, self.slot_bytes)
        arr = np.frombuffer(self.mm, np.uint8, nbytes, slot * self.slot_bytes + offset)
        return torch.from_numpy(arr).view(dtype).view(shape)

    # -- main side -----------------------------------------------------------------------------
    def reclaim(self) -> bool:
        """Free every slot no tensor in this process views. Only while no worker runs: a slot
        filled and never read (prefetched by an iterator that was left) is free again.

        False when the lock cannot be had: a worker was killed holding it, and this ring
        should be dropped for a new one.
        """
        if not self.lock.acquire(timeout=10):
            return False
        try:
            with self._live_lock:
                for slot in range(len(self.state)):
                    if slot not in self._live:
                        self.state[slot] = 0
        finally:
            self.lock.release()
        return True

    def _rebuild(self, slot: int, offset: int, dtype: torch.dtype, shape: tuple, perm):
        nbytes = math.prod(shape) * dtype.itemsize
        arr = np.frombuffer(self.mm, np.uint8, nbytes, slot * self.slot_bytes + offset)
        with self._live_lock:
            self._live[slot] = self._live.get(slot, 0) + 1
            self.rebuilt += 1
        # The tensor's storage holds `arr`; `arr` dies with the last tensor viewing it.
        weakref.finalize(arr, self._release, slot).atexit = False
        t = torch.from_numpy(arr).view(dtype).view(shape)
        return t.permute(perm) if perm else t

    def _release(self, slot: int) -> None:
        with self._live_lock:
            self._live[slot] -= 1
            if self._live[slot]:
                return
            del self._live[slot]
        if self.lock.acquire(timeout=10):  # a worker killed holding it: keep the slot busy
            try:
                self.state[slot] = 0
            finally:
                self.lock.release()


class InRing:
    """A tensor a worker stacked into a ring slot; unpickles in the main process as a tensor
    over that slot (the pickle carries only these numbers)."""

    __slots__ = ("token", "slot", "offset", "dtype", "shape", "perm")

    def __init__(self, ring: BatchRing, slot: int, offset: int, tensor: torch.Tensor, perm=None):
        self.token, self.slot, self.offset = ring.token, slot, offset
        self.dtype, self.shape, self.perm = tensor.dtype, tuple(tensor.shape), perm

    def __reduce__(self):
        return _rebuild, (self.token, self.slot, self.offset, self.dtype, self.shape, self.perm)


def _rebuild(token, slot, offset, dtype, shape, perm) -> torch.Tensor:
    ring = _RINGS.get(token)
    if ring is None:
        raise RuntimeError(
            f"batch ring {token} is not in this process: was the loader's "
            "iterator dropped while batches were in flight?"
        )
    return ring._rebuild(slot, offset, dtype, shape, perm)
