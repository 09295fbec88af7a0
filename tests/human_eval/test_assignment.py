"""Task assignment under concurrency, on SQLite and on PostgreSQL: 50 raters each open their
page twice at once against a real `kiln rate serve` process. Every rater holds at most one
open task, no pair is given past its quota, and no request fails."""

from __future__ import annotations

import threading

import httpx
import pytest
import yaml
from sqlalchemy import func, select

from human_eval.store import Pair, RatingStore, Task, sqlite_url
from human_eval.studies import create_comparison, load_study
from tasks.storage.layout import Layout
from tests.servers import free_port

from .conftest import many_prompts, start_server, stop, write_study

pytestmark = pytest.mark.integration

RATERS, K = 50, 2


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path):
    if request.param == "sqlite":
        return sqlite_url(Layout(tmp_path / "root").ratings_db())
    return request.getfixturevalue("postgres")("assignment")


def test_concurrent_page_loads_give_one_open_task_each_and_keep_every_quota(
    store_url, tmp_path, make_config
):
    root = tmp_path / "root"
    prompts = many_prompts(12)  # 12 pairs x K=2: fewer places than raters
    a = write_study(root, "study-a", prompts=prompts, size=16)
    b = write_study(root, "study-b", prompts=prompts, size=16, colour=(0, 0, 250))
    store = RatingStore(store_url)
    cid, _ = create_comparison(store, load_study(a), load_study(b), raters_per_pair=K, gold=2)
    tokens = [t for _, t in store.add_raters(cid, RATERS)]
    port = free_port()
    config = make_config(tmp_path / "c.yaml", root, tmp_path)
    data = yaml.safe_load(config.read_text())
    data["human_eval"] = {"database_url": store_url, "port": port}
    config.write_text(yaml.safe_dump(data))
    proc, base = start_server(["kiln_cli", "rate", "serve", "--config", str(config)], port)
    statuses: list[int] = []
    gate = threading.Barrier(2 * RATERS)

    def load(token: str) -> None:
        gate.wait()  # every request leaves at once
        with httpx.Client(timeout=60) as client:
            statuses.append(client.get(f"{base}/rate/{token}").status_code)

    try:
        threads = [threading.Thread(target=load, args=(t,)) for t in tokens for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        stop(proc)
    assert statuses == [200] * 2 * RATERS
    with store.session() as s:
        open_per_rater = s.execute(
            select(Task.rater_id, func.count()).where(~Task.answered).group_by(Task.rater_id)
        ).all()
        per_pair = s.execute(
            select(Task.pair_id, func.count())
            .join(Pair, Pair.id == Task.pair_id)
            .where(~Pair.gold)
            .group_by(Task.pair_id)
        ).all()
    store.close()
    assert open_per_rater and max(n for _, n in open_per_rater) == 1
    assert len(open_per_rater) == RATERS, "every rater got a task (a pair or a gold check)"
    assert len(per_pair) == 12 and max(n for _, n in per_pair) == K
