"""Progress of a long data step (ingest, validate, shard), shown the way training shows it.

Inside a Prefect flow or task run, a progress artifact (`<step>-progress`) follows the work;
in any case a log line about every `interval_s` seconds says the items done out of the total,
the rate and the time left:

    validate: 1310720/10000000 rows (13.1%), 52000 rows/s, about 2 min 47 s left
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.context import FlowRunContext, TaskRunContext

from tasks.runtime.logs import task_logger

__all__ = ["Progress", "eta"]


def eta(seconds: float) -> str:
    """`seconds` as "1 h 02 min", "2 min 47 s" or "12 s"."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    return f"{s // 60} min {s % 60:02d} s" if s >= 60 else f"{s} s"


class Progress:
    """Counts `total` items of `step` as they finish; logs and updates the artifact at most
    every `interval_s` seconds (`clock`: seconds, monotonic)."""

    def __init__(
        self,
        step: str,
        total: int,
        unit: str = "items",
        *,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if total < 0:
            raise ValueError(f"progress total must be >= 0, got {total}")
        self.step, self.total, self.unit = step, total, unit
        self.done, self._clock, self._interval = 0, clock, interval_s
        self._start = self._last = clock()
        self._log = task_logger(__name__)
        self._artifact = None
        if total and (FlowRunContext.get() or TaskRunContext.get()):
            self._artifact = create_progress_artifact(
                progress=0.0,
                key=f"{step}-progress",
                description=f"{step}: {unit} done out of {total}",
            )

    def line(self) -> str:
        """Done out of total, the rate and the time left, as one line."""
        spent = max(self._clock() - self._start, 1e-9)
        rate = self.done / spent
        left = (self.total - self.done) / rate if rate else float("inf")
        pct = 100.0 * self.done / self.total if self.total else 100.0
        tail = f"about {eta(left)} left" if left != float("inf") else "time left unknown"
        return (
            f"{self.step}: {self.done}/{self.total} {self.unit} ({pct:.1f}%), "
            f"{rate:.0f} {self.unit}/s, {tail}"
        )

    def advance(self, n: int) -> None:
        """`n` more items done; log and update the artifact when `interval_s` has passed."""
        self.done += n
        now = self._clock()
        if now - self._last >= self._interval:
            self._last = now
            self._report()

    def finish(self) -> None:
        """Log the final line (when anything was counted) and fill the artifact."""
        if self.total:
            self._report()

    def _report(self) -> None:
        self._log.info("%s", self.line())
        if self._artifact is not None:
            pct = 100.0 * min(self.done, self.total) / self.total
            update_progress_artifact(self._artifact, progress=pct)
