"""Takedown flow: withdraw images or a contributor from every future dataset.

    append to the takedown list -> tag every registered version whose dataset holds a
    taken-down image -> emit `kiln.takedown.added` (a retrain is due when the newest
    training saw one)

The next validate quarantines the listed rows (reason `takedown`); `kiln promote` refuses a
version whose tag counts taken-down images unless told why (tasks/registry/promotion.py).
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from kiln_config import PipelineConfig
from tasks.catalog.dataset_lineage import resolve_image
from tasks.catalog.takedown import add_takedown
from tasks.registry.model_lineage import tag_takedowns
from tasks.registry.new_data import emit_takedown_added, taken_down_since_training

__all__ = ["takedown_flow"]


@flow(name="kiln-takedown", log_prints=True)
def takedown_flow(
    config: PipelineConfig,
    reason: str,
    keys: list[str] | None = None,
    contributor: str | None = None,
    by: str | None = None,
) -> dict:
    """Append images (`keys`: catalog keys or `<source>/<key>` paths) or a `contributor` to
    the takedown list, tag the registered versions that hold them, and emit
    `kiln.takedown.added`.

    Args:
        config: The loaded config.
        reason: Why; recorded with who and when.
        keys: Images to take down; each must be in the newest catalog.
        contributor: A contributor whose every image is taken down.
        by: Who asked (default: the current user).
    """
    root = config.storage.root
    images = sorted({uid for k in keys or [] for uid in resolve_image(root, k, config.quality)})
    added = add_takedown(root, reason, images=images or None, contributor=contributor, by=by)
    tagged = tag_takedowns(root, config.tracking_uri, config.registry.model_name, config.quality)
    down = taken_down_since_training(root, config.quality)
    due = emit_takedown_added(root, len(added), down)
    what = f"{len(images)} images" if images else f"contributor `{contributor}`"
    get_run_logger().info(
        "takedown %s: %s (%s); versions tagged: %s",
        added["id"].iloc[0],
        what,
        reason,
        tagged or "none",
    )
    create_markdown_artifact(
        key="takedown",
        description=f"takedown of {what}",
        markdown=(
            f"## Takedown `{added['id'].iloc[0]}`: {what}\n\nReason: {reason}. By "
            f"{added['by'].iloc[0]} at {added['at'].iloc[0]}.\n\nRegistered versions holding "
            "taken-down images (tag `kiln.takedown.images`): "
            + (", ".join(f"v{v} ({n})" for v, n in tagged.items()) or "none")
            + f".\n\nImages of the newest training's dataset taken down: {down}; retrain "
            + ("**due**." if due else "not due.")
            + "\n\nThe next validate quarantines them (reason `takedown`)."
        ),
    )
    return {
        "id": added["id"].iloc[0],
        "rows": len(added),
        "images": len(images),
        "contributor": contributor,
        "tagged_versions": tagged,
        "taken_down_since_training": down,
        "retrain_due": due,
    }
