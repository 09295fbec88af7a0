"""The task runner for partitioned work (ingest and shard): local threads or a Dask cluster.

Locally, partition tasks run on threads and hand their CPU work to a process pool the caller
owns; with a Dask scheduler address they run on the cluster's workers through prefect-dask.
"""

from __future__ import annotations

import ctypes

from prefect.task_runners import ThreadPoolTaskRunner

__all__ = ["partition_runner", "release_freed_memory"]


def partition_runner(workers: int, dask_address: str | None):
    """A task runner (use it as a context manager) for `workers` local partitions or Dask."""
    if dask_address:
        from prefect_dask import DaskTaskRunner

        return DaskTaskRunner(address=dask_address)
    return ThreadPoolTaskRunner(max_workers=max(2, workers))


def release_freed_memory() -> None:
    """Give the memory that finished partitions freed back to the OS: Arrow's pool's unused
    pages, and glibc's free heap (`malloc_trim`; skipped elsewhere). Each local partition
    thread allocates from its own glibc arena, and neither an arena nor Arrow's pool hands
    freed pages back by itself: without this, the driver carries the peak of one phase (row
    checks, the duplicate search) into the next."""
    import pyarrow as pa

    pa.default_memory_pool().release_unused()
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)
