"""Promote flow: move `champion` to a candidate when the gate passes, or roll it back.

The same decision as `kiln promote` / `kiln rollback`, as a Prefect flow so it can run from the
UI or a deployment. The decision (passed or refused, with the numbers read) is tagged on the
candidate's version by `tasks.registry.promotion` and shown here as a markdown artifact; a refusal
fails the flow run with the reasons.
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from kiln_config import PipelineConfig
from tasks.registry.model_lineage import tag_takedowns
from tasks.registry.promotion import PromotionRefused, promote, rollback

__all__ = ["promote_flow", "rollback_flow"]


def _markdown(title: str, record: dict) -> str:
    lines = [f"## {title}\n"]
    lines += [f"- **{k}**: {v}" for k, v in record.items() if k != "checks"]
    if record.get("checks"):
        lines += ["\n| check | ok | detail |", "|---|---|---|"]
        lines += [
            f"| {c['check']} | {'yes' if c['ok'] else '**no**'} | {c['detail']} |"
            for c in record["checks"]
        ]
    return "\n".join(lines)


@flow(name="kiln-promote", log_prints=True)
def promote_flow(
    config: PipelineConfig,
    candidate: str | None = None,
    first: bool = False,
    force: bool = False,
    reason: str | None = None,
    allow_takedown: bool = False,
) -> dict:
    """Move `champion` to `candidate` (default `models:/<name>@<registry.alias>`) if the gate
    in `registry.gate` passes, and its dataset holds no taken-down image.

    Args:
        config: The loaded config (registry and gate settings).
        candidate: models:/NAME@ALIAS or models:/NAME/VERSION.
        first: Promote with no champion yet (nothing to compare against).
        force: Promote past a refused gate; needs `reason`.
        reason: Why, recorded on the version.
        allow_takedown: Promote a candidate whose dataset holds taken-down images; needs
            `reason`.
    """
    ref = candidate or f"models:/{config.registry.model_name}@{config.registry.alias}"
    # The takedown tags as of now (a takedown since the last tagging is counted too).
    tag_takedowns(
        config.storage.root, config.tracking_uri, config.registry.model_name, config.quality
    )
    try:
        record = promote(
            config.tracking_uri,
            ref,
            config.registry.gate,
            first=first,
            force=force,
            reason=reason,
            allow_takedown=allow_takedown,
        )
    except PromotionRefused as e:
        create_markdown_artifact(
            key="promotion",
            description=f"{ref}: refused",
            markdown=f"## {ref}: not promoted\n\n```\n{e}\n```",
        )
        raise
    get_run_logger().info(
        "%s version %s is now champion (%s)", record["name"], record["version"], record["outcome"]
    )
    create_markdown_artifact(
        key="promotion",
        description=f"{ref}: {record['outcome']}",
        markdown=_markdown(f"{ref} → champion", record),
    )
    return record


@flow(name="kiln-rollback", log_prints=True)
def rollback_flow(config: PipelineConfig, reason: str | None = None) -> dict:
    """Swap `champion` and `previous-champion` of `registry.model_name`."""
    record = rollback(config.tracking_uri, config.registry.model_name, reason)
    create_markdown_artifact(
        key="rollback",
        description=f"{config.registry.model_name} rolled back",
        markdown=_markdown("Rollback", record),
    )
    return record
