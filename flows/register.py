"""Register flow: log the trained pipeline to MLflow and point the `candidate` alias at it.

The registry settings and the recorded `config_sha256` come from the training run's config
snapshot (overrides applied), not from the file passed in, which may have changed since.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from kiln_config import PipelineConfig, config_hash, run_config
from tasks.evaluation.prompts import prompt_set_name
from tasks.evaluation.study_metrics import metrics_lineage
from tasks.registry.model_lineage import register_lineage
from tasks.registry.tracking import register_model
from tasks.reports import model_card, registered_report
from tasks.storage.layout import Layout

__all__ = ["register_flow"]


def _study_scores(layout: Layout, study_id: str | None) -> dict | None:
    """The study id, its prompt set's name, and its CLIP score and FID when `kiln evaluate`
    computed them."""
    if not study_id:
        return None
    path = layout.study(study_id) / "metrics.json"
    metrics = json.loads(path.read_text()) if path.is_file() else {}
    study = layout.study(study_id) / "study.json"
    prompts = json.loads(study.read_text())["prompts_csv"] if study.is_file() else None
    return {
        "study_id": study_id,
        **({"prompts": prompt_set_name(prompts)} if prompts else {}),
        **{k: m["value"] for k, m in metrics.items() if isinstance(m, dict) and "value" in m},
    }


def _val_metrics(record: dict) -> dict[str, float]:
    """The last stage's validation loss and conditioning gap (EMA and raw weights), for the
    version's metrics; empty when it had no validation split."""
    stages = record.get("stages", {})
    val = stages[list(stages)[-1]].get("val") if stages else None
    keys = ("ema/val/loss", "ema/val/cond_gap", "raw/val/loss", "raw/val/cond_gap")
    return {k: float(val[k]) for k in keys if val and k in val}


@flow(name="kiln-register", log_prints=True)
def register_flow(
    config: PipelineConfig,
    run_id: str | None = None,
    study_id: str | None = None,
) -> dict:
    """Register the run's final export as a new version of `registry.model_name`.

    Args:
        config: The loaded config: finds the root; the settings come from the run's snapshot.
        run_id: Training run; default the newest.
        study_id: Evaluation study recorded in the lineage; default the newest, if any.
    """
    layout = Layout(Path(config.storage.root))
    run_id, record = layout.finished_run(run_id, "register")
    cfg = run_config(config, layout.run_config(run_id), get_run_logger())
    if study_id is None:
        study_id = layout.latest_or_none("eval")
    ingest = json.loads((layout.catalog(record["ingest_id"]) / "summary.json").read_text())
    lineage = {
        "run_id": run_id,
        "mlflow_run_id": record["mlflow_run_id"],
        "dataset_version": record["dataset_version"],
        "ingest_id": record["ingest_id"],
        "source": ingest["source"],
        "study_id": study_id or "",
        "config_sha256": config_hash(cfg),
    }
    shards_json = layout.shards(record["dataset_version"]) / "shards.json"
    shards = json.loads(shards_json.read_text()) if shards_json.is_file() else {}
    warm = record.get("init_from_model")
    if warm:  # a warm-started retrain names the model it continued from
        lineage["parent_model"] = warm.get("resolved", warm["ref"])
        if warm.get("version"):
            lineage["parent_version"] = warm["version"]
    if study_id:  # the study's CLIP score and FID (when computed), next to its id
        lineage.update(metrics_lineage(layout.study(study_id)))
    info = register_model(
        cfg.tracking_uri,
        record["mlflow_run_id"],
        record["export"],
        cfg.registry.model_name,
        cfg.registry.alias,
        lineage,
        _val_metrics(record),
        card=model_card(record, shards, _study_scores(layout, study_id)),
        evaluate=cfg.evaluate,
    )
    # The contributors' report, the earliest license end and any takedowns, on the version.
    info["licensing"] = register_lineage(
        cfg.storage.root, cfg.tracking_uri, info["name"], info["version"], cfg.quality
    )
    create_markdown_artifact(
        key="registered-model",
        description=f"{info['name']} v{info['version']}",
        markdown=registered_report(info, lineage, cfg.tracking_uri)
        + f"\n- contributors' report: artifact `{info['licensing']['report']}`"
        f"\n- earliest license end: `{info['licensing']['earliest_license_end']}`",
    )
    return {**info, "lineage": lineage}
