import logging

import pytest
from prefect import flow

from tasks.runtime.progress import Progress, eta


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_line_about_every_interval_with_done_rate_and_time_left(caplog):
    clock = Clock()
    caplog.set_level(logging.INFO, logger="tasks.runtime.progress")
    p = Progress("validate", 1000, "rows", interval_s=10, clock=clock)
    for _ in range(4):  # 100 rows every 4 s: a line at 12 s, none between
        clock.now += 4
        p.advance(100)
    lines = [r.getMessage() for r in caplog.records if r.name == "tasks.runtime.progress"]
    assert lines == ["validate: 300/1000 rows (30.0%), 25 rows/s, about 28 s left"]
    clock.now += 24
    p.advance(600)
    p.finish()
    lines = [r.getMessage() for r in caplog.records if r.name == "tasks.runtime.progress"]
    assert lines[-1] == "validate: 1000/1000 rows (100.0%), 25 rows/s, about 0 s left"
    assert (eta(167), eta(3725), eta(9)) == ("2 min 47 s", "1 h 02 min", "9 s")
    with pytest.raises(ValueError, match="progress total must be >= 0, got -1"):
        Progress("ingest", -1)


@pytest.mark.integration
def test_inside_a_flow_run_the_progress_is_an_artifact():
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    @flow
    def work() -> None:
        clock = Clock()
        p = Progress("shard", 40, "images", interval_s=10, clock=clock)
        clock.now += 11
        p.advance(10)
        clock.now += 30
        p.advance(30)
        p.finish()

    work()

    async def read():
        async with get_client() as client:
            flt = ArtifactFilter(key=ArtifactFilterKey(any_=["shard-progress"]))
            return await client.read_artifacts(artifact_filter=flt)

    got = asyncio.run(read())
    assert got and got[-1].type == "progress" and float(got[-1].data) == 100.0
