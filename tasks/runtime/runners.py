"""The task runner for partitioned work (ingest and shard): local threads or a Dask cluster.

Locally, partition tasks run on threads and hand their CPU work to a process pool the caller
owns; with a Dask scheduler address they run on the cluster's workers through prefect-dask.
"""

from __future__ import annotations

from prefect.task_runners import ThreadPoolTaskRunner

__all__ = ["partition_runner"]


def partition_runner(workers: int, dask_address: str | None):
    """A task runner (use it as a context manager) for `workers` local partitions or Dask."""
    if dask_address:
        from prefect_dask import DaskTaskRunner

        return DaskTaskRunner(address=dask_address)
    return ThreadPoolTaskRunner(max_workers=max(2, workers))
