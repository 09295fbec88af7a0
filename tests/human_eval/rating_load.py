"""Simulated raters over loopback HTTP: the load of tests/human_eval/test_load.py and of
benchmarks/ratings_load.py (which loads this file by its path).

A rater follows the app's own flow (GET the page, read the task id, POST the answers). When a
request fails (the server was killed), it re-sends the same POST once the server answers again;
the unique key makes a re-sent vote that had been committed a no-op.
"""

from __future__ import annotations

import re
import threading
import time

import httpx
import numpy as np

__all__ = ["Rater", "check_exact", "join", "latency_summary", "run_load"]


class Rater(threading.Thread):
    """One rater: `votes` tasks, each POST re-sent until the server acknowledges it."""

    def __init__(self, base, token, deadline, progress, votes):
        super().__init__(daemon=True)
        self.base, self.token, self.deadline, self.progress = base, token, deadline, progress
        self.votes = votes
        self.done: set[int] = set()
        self.latencies: list[float] = []
        self.failures = 0
        self.error: str | None = None

    def _retry(self, fn):
        while time.monotonic() < self.deadline:
            try:
                return fn()
            except httpx.TransportError:
                self.failures += 1
                time.sleep(0.05)  # poll: the server is being restarted
        raise TimeoutError("deadline passed")

    def run(self):
        rng = np.random.default_rng(abs(hash(self.token)) % 2**32)
        try:
            with httpx.Client(timeout=30) as c:
                while len(self.done) < self.votes:
                    page = self._retry(lambda: c.get(f"{self.base}/rate/{self.token}"))
                    m = re.search(r'name="task_id" value="(\d+)"', page.text)
                    if m is None:
                        self.error = f"no task after {len(self.done)}: {page.status_code}"
                        return
                    form = {
                        "task_id": m.group(1),
                        "quality": rng.choice(["left", "right"]),
                        "alignment": rng.choice(["left", "right", "tie"]),
                    }
                    t0 = time.perf_counter()
                    vote_url = f"{self.base}/rate/{self.token}/vote"
                    r = self._retry(lambda f=form, u=vote_url: c.post(u, data=f))
                    self.latencies.append(time.perf_counter() - t0)
                    assert r.status_code == 303, r.text
                    self.done.add(int(m.group(1)))
                    self.progress()
        except Exception as e:  # reported by the test
            self.error = repr(e)


def run_load(base, tokens, votes, limit_s, on_count=None):
    """Start one `Rater` per token; returns (raters, start time, deadline)."""
    lock, count = threading.Lock(), [0]

    def progress():
        with lock:
            count[0] += 1
            if on_count:
                on_count(count[0])

    deadline = time.monotonic() + limit_s
    raters = [Rater(base, t, deadline, progress, votes) for t in tokens]
    t0 = time.perf_counter()
    for r in raters:
        r.start()
    return raters, t0, deadline


def join(raters, deadline):
    for r in raters:
        r.join(timeout=max(0.0, deadline - time.monotonic()) + 5)
        assert not r.is_alive(), "a rater is still running after the time limit"
    errors = [r.error for r in raters if r.error]
    assert not errors, errors[:3]


def check_exact(store, cid, raters: int, votes: int) -> None:
    """Every rater's votes stored once each, on distinct pairs (no rater saw a pair twice),
    no pair over its K=5 quota."""
    with store.engine.connect() as con:
        rows = con.exec_driver_sql(
            "SELECT rater_id, COUNT(DISTINCT pair_id), COUNT(*) FROM votes GROUP BY rater_id"
        ).all()
        dup = con.exec_driver_sql(
            "SELECT COUNT(*) FROM (SELECT 1 FROM votes GROUP BY rater_id, pair_id, question "
            "HAVING COUNT(*) > 1) AS dup"
        ).scalar()
        over = con.exec_driver_sql(
            "SELECT COUNT(*) FROM (SELECT pair_id FROM votes WHERE question = 'quality' "
            "GROUP BY pair_id HAVING COUNT(*) > 5) AS over"
        ).scalar()
    assert len(rows) == raters
    assert all(pairs == votes and n == 2 * votes for _, pairs, n in rows)
    assert dup == 0 and over == 0
    assert store.count_votes(cid) == raters * votes * 2  # 2 questions a ballot


def latency_summary(raters, wall_s: float) -> dict:
    """Votes per second (a page and a vote per task) and the vote POST's p50/p99 in ms."""
    lat = np.array([x for r in raters for x in r.latencies]) * 1000
    return {
        "votes": len(lat),
        "wall_s": round(wall_s, 1),
        "votes_per_s": round(len(lat) / wall_s, 1),
        "p50_ms": round(float(np.percentile(lat, 50)), 1),
        "p99_ms": round(float(np.percentile(lat, 99)), 1),
    }
