"""One GPU user at a time: a Prefect global concurrency limit around every `accelerate launch`.

The training deployments' `concurrency_limit` keeps two runs *of one deployment* apart; a run
started from the UI, a scheduled retrain and a triggered one are different deployments (or
none), and they would share the GPUs. Every launch (training stages, evaluation images,
precomputed latents, the pre-flight check) therefore holds a slot of the global limit
`launch.gpu_limit.name` (default `gpu`) while its process runs. A launch that finds every slot
taken waits, and says so in the run log.

Kiln creates the limit on first use with `launch.gpu_limit.slots` slots (1: one launch per
machine). To create it yourself, or to give a node with 8 GPUs room for two 4-GPU launches:

    prefect gcl create gpu --limit 1
    prefect gcl update gpu --limit 2

A held slot is a lease renewed while the launch runs: on a Prefect server, a holder killed
outright frees its slot after `launch.gpu_limit.lease_s` seconds. Prefect keeps leases in the
server's memory, so a server restarted while a launch held a slot leaves the slot taken; free it
with `prefect gcl update gpu --active-slots 0` (the waiting launch's log line says so).

Without a Prefect server (`PREFECT_API_URL` unset: `kiln run`, `make demo`), each command
starts a temporary server of its own, whose leases would die with it and whose limit no other
run shares: launches then take no slot (the root's lock still keeps two trainings of one root
apart). Set `launch.gpu_limit: null` to launch without it everywhere.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.client.schemas.responses import GlobalConcurrencyLimitResponse
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from kiln_config import GpuLimitConfig

__all__ = ["ensure_limit", "gpu_slot"]


def _shared_server() -> bool:
    """Whether runs talk to a Prefect server (`PREFECT_API_URL`), not a temporary one."""
    from prefect.settings import PREFECT_API_URL

    return bool(PREFECT_API_URL.value())


def ensure_limit(limit: GpuLimitConfig) -> GlobalConcurrencyLimitResponse:
    """The global concurrency limit `limit.name`, created with `limit.slots` if missing (a
    concurrent creator is fine: whoever loses the race reads the winner's)."""
    with get_client(sync_client=True) as client:
        try:
            return client.read_global_concurrency_limit_by_name(limit.name)
        except ObjectNotFound:
            pass
        with suppress(ObjectAlreadyExists):
            client.create_global_concurrency_limit(
                GlobalConcurrencyLimitCreate(name=limit.name, limit=limit.slots)
            )
        return client.read_global_concurrency_limit_by_name(limit.name)


@contextmanager
def gpu_slot(
    limit: GpuLimitConfig | None, logger: logging.Logger | logging.LoggerAdapter, what: str
) -> Iterator[None]:
    """Hold one slot of `limit` while the block runs (nothing when `limit` is None)."""
    if limit is None or not _shared_server():
        yield
        return
    gcl = ensure_limit(limit)
    if not gcl.active:
        logger.warning(
            "global concurrency limit %r is inactive: %s runs without it", limit.name, what
        )
    elif gcl.active_slots >= gcl.limit:
        logger.info(
            "waiting for the %r concurrency limit (%d of %d slots taken: another launch is "
            "using the GPUs) before %s; if no launch runs, a restarted server kept a dead "
            "holder's slot: `prefect gcl update %s --active-slots 0`",
            limit.name,
            gcl.active_slots,
            gcl.limit,
            what,
            limit.name,
        )
    started = time.monotonic()
    with concurrency(
        limit.name,
        occupy=1,
        lease_duration=limit.lease_s,
        strict=True,
        raise_on_lease_renewal_failure=False,
    ):
        waited = time.monotonic() - started
        if waited >= 1:
            logger.info("got a %r slot after %.0fs: starting %s", limit.name, waited, what)
        yield
