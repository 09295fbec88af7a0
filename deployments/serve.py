"""Serve Kiln's flows from this process, without a work pool:

    python deployments/serve.py --config configs/sd2-base.yaml --cron "0 3 * * 0"

The retraining pipeline runs on the cron schedule, and when the ingest of this config's root
reports enough new images (the `kiln.ingest.completed` event, tasks/registry/new_data.py);
every flow can also be started on demand from the Prefect UI. Parameters are config paths,
never copies of hyperparameters: each deployment runs an entry of flows/entry.py, which loads
and checks the path and runs the flow on the loaded config.
"""

from __future__ import annotations

import argparse

from prefect import serve
from prefect.client.schemas.objects import ConcurrencyLimitConfig
from prefect.events import DeploymentEventTrigger

from flows import entry
from flows.ingest import root_resource_id
from kiln_config import load_config


def build_deployments(config_path: str, cron: str | None) -> list:
    """One deployment per flow; the pipeline gets the retraining schedule, and the new-data
    trigger (the `kiln.ingest.completed` or `kiln.takedown.added` event labelled
    `kiln.retrain-due`)."""
    params = {"config": config_path}
    # Two trainings never overlap: a second run waits for the first (ENQUEUE).
    one = ConcurrencyLimitConfig(limit=1, collision_strategy="ENQUEUE")
    new_data = DeploymentEventTrigger(
        # New data landed, or a takedown removed images the newest training saw.
        expect={"kiln.ingest.completed", "kiln.takedown.added"},
        # Only this config's root: another root's ingest on the same server starts nothing.
        match={
            "prefect.resource.id": root_resource_id(load_config(config_path).storage.root),
            "kiln.retrain-due": "true",
        },
    )
    deployments = [
        entry.pipeline.to_deployment(
            "retrain", parameters=params, cron=cron, concurrency_limit=one, triggers=[new_data]
        )
    ]
    for f in (
        entry.ingest,
        entry.validate,
        entry.shard,
        entry.train,
        entry.evaluate,
        entry.register,
    ):
        limit = one if f is entry.train else None
        deployments.append(
            f.to_deployment(
                f.name.removeprefix("kiln-"), parameters=params, concurrency_limit=limit
            )
        )
    return deployments


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/tiny.yaml", help="Pipeline YAML path")
    p.add_argument("--cron", default=None, help="Retraining schedule, e.g. '0 3 * * 0'")
    args = p.parse_args()
    serve(*build_deployments(args.config, args.cron))


if __name__ == "__main__":
    main()
