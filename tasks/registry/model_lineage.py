"""Lineage in the model registry: what each registered version trained on, and which versions
saw an image.

Each registered version's tags name its dataset version and run (`dataset_version`,
`run_id`, tasks/registry/tracking.py). From there `model_lineage` gives its rows by source, license
and contributor and each contributor's draws per stage (tasks/catalog/dataset_lineage.py);
`register_lineage` logs that table as a CSV on the version's training run
(`lineage/contributors.csv`), tags the version with the earliest license end among its
images and names the report in its description; `tag_takedowns` tags every version whose
dataset holds a taken-down image with how many (`kiln.takedown.images`), which the MLflow
UI shows and `kiln promote` checks.
"""

from __future__ import annotations

import json
import logging
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd
from mlflow.tracking import MlflowClient

from kiln_config import QualityConfig
from kiln_config.errors import InputError
from tasks.catalog.dataset_lineage import (
    REPORT_ARTIFACT,
    contributors_report,
    dataset_rows,
    earliest_license_end,
    resolve_image,
    run_draws,
)
from tasks.catalog.takedown import takedown_set
from tasks.registry.tracking import model_version, tag_id
from tasks.storage.layout import Layout

__all__ = [
    "LICENSE_END_TAG",
    "TAKEDOWN_TAG",
    "image_lineage",
    "model_lineage",
    "register_lineage",
    "tag_takedowns",
]

TAKEDOWN_TAG = "kiln.takedown.images"  # images of the version's dataset on the takedown list
LICENSE_END_TAG = "kiln.earliest_license_end"  # the first license among its images to end


def _client(tracking_uri: str) -> MlflowClient:
    return MlflowClient(tracking_uri, registry_uri=tracking_uri)


def model_lineage(
    root: str | Path, tracking_uri: str, ref: str, rules: QualityConfig | None = None
) -> dict:
    """What registered version `ref` (models:/NAME/N or models:/NAME@ALIAS) trained on.

    Returns:
        {"name", "version", "aliases", "dataset_version", "run_id", "rows" (a frame of
        counts by source, license and contributor), "report" (contributors_report),
        "earliest_license_end", "images"}.

    Raises:
        ValueError: `ref` is not a models:/ URI, or the version has no dataset_version tag.
        ModelVersionNotFound: no such version.
    """
    mv = model_version(_client(tracking_uri), ref)
    version, run_id = tag_id(mv, "dataset_version"), tag_id(mv, "run_id") or ""
    if not version:
        raise InputError(f"{ref}: the version has no dataset_version tag (not registered by Kiln)")
    rows = dataset_rows(root, version, rules)
    by = (
        rows.assign(**{c: rows[c].fillna("(none)") for c in ("license", "contributor")})
        .groupby(["source", "license", "contributor"], sort=True)
        .size()
        .reset_index(name="images")
    )
    draws = run_draws(root, run_id) if run_id else {}
    return {
        "name": mv.name,
        "version": str(mv.version),
        "aliases": list(mv.aliases or []),
        "dataset_version": version,
        "run_id": run_id,
        "rows": by,
        "report": contributors_report(rows, draws),
        "images": len(rows),
        "earliest_license_end": earliest_license_end(rows),
        "exposure_recorded": bool(draws),
    }


def register_lineage(
    root: str | Path, tracking_uri: str, name: str, version: str, rules: QualityConfig | None = None
) -> dict:
    """At registration: log the contributors' report on the version's run, tag the earliest
    license end (and any takedowns), and name the report in the version's description.

    Returns:
        {"report" (the artifact's path), "earliest_license_end", "takedown_images"}.
    """
    client = _client(tracking_uri)
    try:
        info = model_lineage(root, tracking_uri, f"models:/{name}/{version}", rules)
    except FileNotFoundError as e:  # its dataset is not under this root: nothing to report
        logging.getLogger(__name__).warning(
            "no contributors' report for %s v%s: %s", name, version, e
        )
        client.set_model_version_tag(name, version, LICENSE_END_TAG, "unknown")
        return {"report": None, "earliest_license_end": None, "takedown_images": 0}
    mv = client.get_model_version(name, version)
    run = mv.run_id or mv.tags.get("mlflow_run_id")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / Path(REPORT_ARTIFACT).name
        info["report"].to_csv(path, index=False)
        client.log_artifact(run, str(path), str(Path(REPORT_ARTIFACT).parent))
    end = info["earliest_license_end"] or "none"
    client.set_model_version_tag(name, version, LICENSE_END_TAG, end)
    top = info["report"].sort_values("draws_total", ascending=False).head(5)
    names = ", ".join(
        f"{c} ({s:.1%})" for c, s in zip(top["contributor"], top["share"], strict=True)
    )
    note = (
        f"\n\n**Contributors' report** (revenue share): artifact `{REPORT_ARTIFACT}` of run "
        f"`{run}`, {len(info['report'])} contributors over {info['images']} images"
        + (
            f"; most drawn: {names}"
            if info["exposure_recorded"]
            else "; draws not recorded (train.log_sample_keys was off)"
        )
        + f". Earliest license end: {end}; `kiln lineage model models:/{name}/{version}`."
    )
    client.update_model_version(name, version, description=(mv.description or "") + note)
    down = tag_takedowns(root, tracking_uri, name, rules).get(str(version), 0)
    return {
        "report": REPORT_ARTIFACT,
        "earliest_license_end": info["earliest_license_end"],
        "takedown_images": down,
    }


def tag_takedowns(
    root: str | Path, tracking_uri: str, name: str, rules: QualityConfig | None = None
) -> dict[str, int]:
    """Tag every version of `name` whose dataset holds a taken-down image with the count
    (`kiln.takedown.images`, and `kiln.takedown.checked_at`). Returns {version: count} of the
    versions tagged."""
    rules = rules or QualityConfig()
    client, down = _client(tracking_uri), takedown_set(root)
    out: dict[str, int] = {}
    if not down:
        return out
    for mv in client.search_model_versions(f"name='{name}'"):
        version = tag_id(mv, "dataset_version")
        if not version or not (Layout(Path(root)).shards(version) / "shards.json").is_file():
            continue  # not Kiln's, or its dataset is not under this root
        rows = dataset_rows(root, version, rules)
        n = int(down.mask(rows, "contributor").sum())
        if n:
            client.set_model_version_tag(name, mv.version, TAKEDOWN_TAG, str(n))
            at = datetime.now(UTC).isoformat(timespec="seconds")
            client.set_model_version_tag(name, mv.version, "kiln.takedown.checked_at", at)
            out[str(mv.version)] = n
    return out


def image_lineage(
    root: str | Path,
    tracking_uri: str,
    name: str,
    key_or_path: str,
    rules: QualityConfig | None = None,
) -> pd.DataFrame:
    """Every dataset version, training run and registered version of `name` that included
    the image `key_or_path` (a catalog key or `<source>/<key>`): one row per dataset version
    holding it, with `stages`, the `runs` that trained on it, their `draws`, and the
    registered `versions` with their aliases ("3 (champion)")."""
    layout = Layout(Path(root))
    images = set(resolve_image(root, key_or_path, rules))
    runs: dict[str, list[str]] = {}
    for rj in sorted(layout.folder("runs").glob("run-*/run.json")):
        record = json.loads(rj.read_text())
        if "dataset_version" in record:
            runs.setdefault(str(record["dataset_version"]), []).append(rj.parent.name)
    versions: dict[str, list[str]] = {}
    client = _client(tracking_uri)
    for found in client.search_model_versions(f"name='{name}'"):
        mv = client.get_model_version(name, found.version)  # a search leaves out the aliases
        aliases = f" ({', '.join(mv.aliases)})" if mv.aliases else ""
        versions.setdefault(mv.tags.get("dataset_version", ""), []).append(f"{mv.version}{aliases}")
    out = []
    for sj in sorted(layout.folder("shards").glob("*/shards.json")):
        version = sj.parent.name
        rows = dataset_rows(root, version, rules)
        hit = rows[[(s, k) in images for s, k in zip(rows["source"], rows["key"], strict=True)]]
        for _, r in hit.iterrows():
            trained = runs.get(version, [])
            drawn = sum(
                sum(c.get(r["key"], 0) for c in run_draws(root, run).values()) for run in trained
            )
            out.append(
                {
                    "source": r["source"],
                    "key": r["key"],
                    "dataset_version": version,
                    "stages": r["stages"],
                    "runs": ",".join(trained),
                    "draws": drawn,
                    "versions": ",".join(versions.get(version, [])),
                }
            )
    cols = ["source", "key", "dataset_version", "stages", "runs", "draws", "versions"]
    return pd.DataFrame(out, columns=cols)
