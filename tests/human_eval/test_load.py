"""Load and durability: 50 concurrent raters x 20 votes over loopback HTTP, with a kill -9.

A simulated rater follows the app's own flow (GET the page, read the task id, POST the
answers). When a request fails (the server was killed), it re-sends the same POST once the
server answers again; the unique key makes a re-sent vote that had been committed a no-op.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import httpx
import numpy as np
import pytest

from human_eval.store import RatingStore, sqlite_url
from human_eval.studies import create_comparison, load_study
from tasks.storage.layout import Layout

from .conftest import free_port, many_prompts, serve_argv, start_server, stop, write_study

pytestmark = pytest.mark.integration

RATERS, VOTES_EACH, LIMIT_S = 50, 20, 240


def _setup(root):
    prompts = many_prompts(250)  # 250 pairs x K=5: room for 1,250 votes
    a = write_study(root, "study-a", prompts=prompts, size=16)
    b = write_study(root, "study-b", prompts=prompts, size=16, colour=(0, 0, 250))
    url = sqlite_url(Layout(root).ratings_db())
    store = RatingStore(url)
    cid, _ = create_comparison(store, load_study(a), load_study(b), raters_per_pair=5, gold=0)
    tokens = [t for _, t in store.add_raters(cid, RATERS)]
    return store, url, cid, tokens


class Rater(threading.Thread):
    """One rater: 20 tasks, each POST re-sent until the server acknowledges it."""

    def __init__(self, base, token, deadline, progress):
        super().__init__(daemon=True)
        self.base, self.token, self.deadline, self.progress = base, token, deadline, progress
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
                while len(self.done) < VOTES_EACH:
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


def _run_load(base, tokens, on_count=None):
    lock, count = threading.Lock(), [0]

    def progress():
        with lock:
            count[0] += 1
            if on_count:
                on_count(count[0])

    deadline = time.monotonic() + LIMIT_S
    raters = [Rater(base, t, deadline, progress) for t in tokens]
    t0 = time.perf_counter()
    for r in raters:
        r.start()
    return raters, t0, deadline


def _join(raters, deadline):
    for r in raters:
        r.join(timeout=max(0.0, deadline - time.monotonic()) + 5)
        assert not r.is_alive(), "a rater is still running after the time limit"
    errors = [r.error for r in raters if r.error]
    assert not errors, errors[:3]


def _check_exact(store, cid):
    with store.engine.connect() as con:
        rows = con.exec_driver_sql(
            "SELECT rater_id, COUNT(DISTINCT pair_id), COUNT(*) FROM votes GROUP BY rater_id"
        ).all()
        dup = con.exec_driver_sql(
            "SELECT COUNT(*) FROM (SELECT 1 FROM votes GROUP BY rater_id, pair_id, question "
            "HAVING COUNT(*) > 1)"
        ).scalar()
        over = con.exec_driver_sql(
            "SELECT COUNT(*) FROM (SELECT pair_id FROM votes WHERE question = 'quality' "
            "GROUP BY pair_id HAVING COUNT(*) > 5)"
        ).scalar()
    assert len(rows) == RATERS
    assert all(pairs == VOTES_EACH and n == 2 * VOTES_EACH for _, pairs, n in rows)
    assert dup == 0 and over == 0
    assert store.count_votes(cid) == RATERS * VOTES_EACH * 2  # 1,000 ballots, 2 questions each


def test_50_concurrent_raters_cast_exactly_1000_votes(tmp_path):
    store, url, cid, tokens = _setup(tmp_path / "root")
    port = free_port()
    proc, base = start_server(serve_argv(tmp_path / "root", port), port)
    try:
        raters, t0, deadline = _run_load(base, tokens)
        _join(raters, deadline)
        wall = time.perf_counter() - t0
    finally:
        stop(proc)
    _check_exact(store, cid)
    lat = np.array([x for r in raters for x in r.latencies]) * 1000
    print(
        f"\n50 raters x 20 votes: {1000 / wall:.1f} votes/s (page + vote per task), vote "
        f"latency p50 {np.percentile(lat, 50):.1f} ms, p99 {np.percentile(lat, 99):.1f} ms, "
        f"{wall:.1f} s, {os.cpu_count()} cores"
    )


def test_kill_9_mid_load_loses_nothing_and_duplicates_nothing(tmp_path):
    store, url, cid, tokens = _setup(tmp_path / "root")
    port = free_port()
    argv = serve_argv(tmp_path / "root", port)
    proc, base = start_server(argv, port)
    halfway = threading.Event()
    raters, _, deadline = _run_load(base, tokens, lambda n: n >= 300 and halfway.set())
    try:
        assert halfway.wait(timeout=LIMIT_S), "load never reached 300 votes"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        proc, _ = start_server(argv, port)  # same port: the raters re-send what failed
        _join(raters, deadline)
    finally:
        stop(proc)
    assert sum(r.failures for r in raters) > 0, "the kill interrupted no request"
    _check_exact(store, cid)
