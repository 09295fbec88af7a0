"""The `gpu` global concurrency limit around launches, against a real Prefect API: created on
first use, one launch at a time with one slot, two at once with two."""

from __future__ import annotations

import logging
import sys
import threading
import uuid

import pytest
from prefect.client.orchestration import get_client

from kiln_config import GpuLimitConfig
from tasks.launch.accelerate import run_launch

pytestmark = pytest.mark.integration

HOLD = "import sys, time; print('start', time.time()); time.sleep(2); print('end', time.time())"


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _two_launches(limit: GpuLimitConfig) -> tuple[list[tuple[float, float]], list[str]]:
    """Start two launches at once; return each one's (start, end) and the log lines."""
    handler = _Lines()
    logger = logging.getLogger(f"test-gpu-limit-{uuid.uuid4().hex}")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    errors = []

    def launch():
        try:
            run_launch([sys.executable, "-c", HOLD], logger=logger, gpu_limit=limit)
        except Exception as e:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=launch) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    starts = [float(x.split()[1]) for x in handler.lines if x.startswith("start ")]
    ends = [float(x.split()[1]) for x in handler.lines if x.startswith("end ")]
    return list(zip(sorted(starts), sorted(ends), strict=True)), handler.lines


def test_one_slot_means_one_launch_at_a_time():
    limit = GpuLimitConfig(name=f"gpu-{uuid.uuid4().hex[:8]}", slots=1)
    spans, lines = _two_launches(limit)
    (s1, e1), (s2, e2) = spans
    assert s2 >= e1, f"the second launch started before the first ended: {spans}"
    assert any("waiting for the" in x and "1 of 1 slots taken" in x for x in lines) or any(
        "got a" in x for x in lines
    ), lines
    with get_client(sync_client=True) as client:
        gcl = client.read_global_concurrency_limit_by_name(limit.name)
    assert (gcl.limit, gcl.active_slots) == (1, 0), "created on first use, released after"


def test_two_slots_let_two_launches_run_together():
    limit = GpuLimitConfig(name=f"gpu-{uuid.uuid4().hex[:8]}", slots=2)
    spans, lines = _two_launches(limit)
    (s1, e1), (s2, e2) = spans
    assert s2 < e1, f"two slots, yet the launches ran one after the other: {spans}"
    assert not any("waiting for the" in x for x in lines)


def test_no_limit_configured_takes_no_slot():
    spans, _ = _two_launches(None)
    assert spans[1][0] < spans[0][1]
