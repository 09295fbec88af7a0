"""The Prefect automation that marks a dead flow run `Crashed`.

A flow-run process killed outright (the OOM killer, SIGKILL to the worker's process tree, a
machine that went away) tells the server nothing: the run stays `Running` for ever, and
a deployment with a concurrency limit (`tiny-pipeline`, `weekly-retrain`) queues its next run
behind them. Prefect's answer, for a server a team runs itself: each flow run sends a heartbeat
event every `PREFECT_FLOWS_HEARTBEAT_FREQUENCY` seconds (set it in the worker's environment, 30
or more), and an automation marks a run whose heartbeats stop `Crashed`. A crashed run gives
back its deployment's concurrency slot.

    PREFECT_API_URL=... PREFECT_API_AUTH_STRING=... python -m deployments.automations

creates it on the server (once: an automation of that name is left as it is). `kiln stack`
does so on every start. What else a dead run held comes back by itself: the root's training
lock is a `flock` the kernel drops with its process, a GPU slot is a lease that expires
(`launch.gpu_limit.lease_s`), and a local launch dies with its flow run
(tasks/launch/orphan_guard.py). A SLURM job or a Kubernetes TrainJob does not: cancel it before
resuming (docs/operations.md, "Running Kiln for a team").
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta

from prefect.automations import Automation
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState
from prefect.events.schemas.automations import EventTrigger, Posture
from prefect.events.schemas.events import ResourceSpecification

from deployments.stack import HEARTBEAT_S

__all__ = ["NAME", "crash_automation", "ensure_crash_automation"]

NAME = "kiln: crash flow runs whose heartbeats stopped"


def crash_automation(within_s: int) -> Automation:
    """A run whose last heartbeat is `within_s` seconds old with no end state is Crashed."""
    return Automation(
        name=NAME,
        description="A flow run's heartbeats stopped (its worker died): mark it Crashed, "
        "which frees its deployment's concurrency slot.",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={
                "prefect.flow-run.heartbeat",
                "prefect.flow-run.Completed",
                "prefect.flow-run.Failed",
                "prefect.flow-run.Cancelled",
                "prefect.flow-run.Crashed",
            },
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=within_s),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"No heartbeat for {within_s} s: its worker or process died.",
            )
        ],
    )


def ensure_crash_automation(within_s: int = 3 * HEARTBEAT_S) -> bool:
    """Create the automation on the server `PREFECT_API_URL` names, unless one of its name is
    there. Returns whether it was created."""
    try:
        Automation.read(name=NAME)
        return False
    except ValueError:  # Automation.read: "automation not found"
        pass
    crash_automation(within_s).create()
    return True


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--within-s",
        type=int,
        default=3 * HEARTBEAT_S,
        help="Seconds without a heartbeat before a run is marked Crashed.",
    )
    a = p.parse_args(argv)
    made = ensure_crash_automation(a.within_s)
    sys.stdout.write(f"{'created' if made else 'exists:'} {NAME!r}\n")


if __name__ == "__main__":
    main()
