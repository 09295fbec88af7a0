"""CPU threads per training process: one rule for `accelerate launch` and `kiln plan`.

Without a GPU, `accelerate launch` gives each process `OMP_NUM_THREADS` threads, or 1 when
that is unset (it divides the cores only for configs with `use_cpu: true`). A one-process
CPU launch then trains on one core while `kiln plan` measured its rate on all of them: the
plan came out about 30% short on 2 cores. Kiln passes `--num_cpu_threads_per_process` with
this count, and the planner measures with the same count.
"""

from __future__ import annotations

import os

__all__ = ["cpu_threads_per_process"]


def _cores() -> int:
    """Physical cores this process may run on (logical ones where psutil cannot tell)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    try:
        import psutil

        physical = psutil.cpu_count(logical=False)
    except ImportError:  # pragma: no cover - psutil comes with accelerate
        physical = None
    counts = [c for c in (usable, physical, os.cpu_count()) if c]
    return max(1, min(counts)) if counts else 1


def cpu_threads_per_process(local_processes: int) -> int:
    """`OMP_NUM_THREADS` when set (an operator's or a test suite's choice), else this
    machine's cores divided among its `local_processes` training processes (at least 1)."""
    try:
        env = int(os.environ.get("OMP_NUM_THREADS", "").strip())
    except ValueError:  # unset, empty, or OpenMP's list form ("4,2"): divide the cores
        env = 0
    if env > 0:
        return env
    return max(1, _cores() // max(1, local_processes))
