"""Load and durability: 50 concurrent raters x 20 votes over loopback HTTP, on SQLite and on
PostgreSQL, and a kill -9 of the app mid-load on SQLite (tests/human_eval/rating_load.py
simulates the raters; benchmarks/ratings_load.py restarts PostgreSQL too)."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
import yaml

from human_eval.store import RatingStore, sqlite_url
from human_eval.studies import create_comparison, load_study
from tasks.storage.layout import Layout
from tests.servers import free_port

from .conftest import REPO, many_prompts, serve_argv, start_server, stop, write_study
from .rating_load import check_exact, join, latency_summary, run_load

pytestmark = pytest.mark.integration

RATERS, VOTES_EACH, LIMIT_S = 50, 20, 240


def _setup(root, url=None):
    prompts = many_prompts(250)  # 250 pairs x K=5: room for 1,250 votes
    a = write_study(root, "study-a", prompts=prompts, size=16)
    b = write_study(root, "study-b", prompts=prompts, size=16, colour=(0, 0, 250))
    url = url or sqlite_url(Layout(root).ratings_db())
    store = RatingStore(url)
    cid, _ = create_comparison(store, load_study(a), load_study(b), raters_per_pair=5, gold=0)
    tokens = [t for _, t in store.add_raters(cid, RATERS)]
    return store, url, cid, tokens


def _config(tmp_path, url: str) -> str:
    """A config whose ratings store is `url`."""
    path = tmp_path / "ratings.yaml"
    base = str(REPO / "configs" / "tiny.yaml")
    path.write_text(yaml.safe_dump({"base": base, "human_eval": {"database_url": url}}))
    return str(path)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_50_concurrent_raters_cast_exactly_1000_votes(tmp_path, backend, request):
    url = request.getfixturevalue("postgres")("load") if backend == "postgresql" else None
    store, url, cid, tokens = _setup(tmp_path / "root", url)
    port = free_port()
    config = _config(tmp_path, url) if backend == "postgresql" else None
    argv = serve_argv(tmp_path / "root", port, config)
    proc, base = start_server(argv, port)
    try:
        raters, t0, deadline = run_load(base, tokens, VOTES_EACH, LIMIT_S)
        join(raters, deadline)
        wall = time.perf_counter() - t0
        # The admin page counts what the database holds (ballots: two answers each).
        token = store.new_admin_token(rotate=True)
        page = httpx.get(f"{base}/admin/{token}", timeout=30).text
        assert f"votes {store.count_votes(cid) // 2} of " in page
    finally:
        stop(proc)
    check_exact(store, cid, RATERS, VOTES_EACH)
    got = latency_summary(raters, wall)
    print(f"\n{backend}: 50 raters x 20 votes: {got} on {os.cpu_count()} cores")


def test_kill_9_mid_load_loses_nothing_and_duplicates_nothing(tmp_path):
    store, url, cid, tokens = _setup(tmp_path / "root")
    port = free_port()
    argv = serve_argv(tmp_path / "root", port)
    proc, base = start_server(argv, port)
    halfway = threading.Event()
    raters, _, deadline = run_load(
        base, tokens, VOTES_EACH, LIMIT_S, lambda n: n >= 300 and halfway.set()
    )
    try:
        assert halfway.wait(timeout=LIMIT_S), "load never reached 300 votes"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        proc, _ = start_server(argv, port)  # same port: the raters re-send what failed
        join(raters, deadline)
    finally:
        stop(proc)
    assert sum(r.failures for r in raters) > 0, "the kill interrupted no request"
    check_exact(store, cid, RATERS, VOTES_EACH)
