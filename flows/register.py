"""Register flow: log the trained pipeline to MLflow and point the `candidate` alias at it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from flows.config import load_config
from tasks.layout import Layout
from tasks.registry import register_model

__all__ = ["register_flow"]


@flow(name="kiln-register", log_prints=True)
def register_flow(
    config_path: str,
    root: str | None = None,
    run_id: str | None = None,
    study_id: str | None = None,
) -> dict:
    """Register the run's final export as a new version of `registry.model_name`.

    Args:
        config_path: Pipeline YAML.
        root: Overrides `storage.root`.
        run_id: Training run; default the newest.
        study_id: Evaluation study recorded in the lineage; default the newest, if any.
    """
    cfg = load_config(config_path, root=root)
    layout = Layout(Path(cfg.storage.root))
    run_id, record = layout.finished_run(run_id, "register")
    if study_id is None and (layout.root / "eval" / "LATEST").is_file():
        study_id = layout.latest("eval", "register")
    ingest = json.loads((layout.catalog(record["ingest_id"]) / "summary.json").read_text())
    lineage = {
        "run_id": run_id,
        "mlflow_run_id": record["mlflow_run_id"],
        "dataset_version": record["dataset_version"],
        "ingest_id": record["ingest_id"],
        "source": ingest["source"],
        "study_id": study_id or "",
        "config_sha256": hashlib.sha256(Path(config_path).read_bytes()).hexdigest()[:16],
    }
    info = register_model(
        cfg.tracking_uri,
        record["mlflow_run_id"],
        record["export"],
        cfg.registry.model_name,
        cfg.registry.alias,
        lineage,
    )
    create_markdown_artifact(
        key="registered-model",
        description=f"{info['name']} v{info['version']}",
        markdown=(
            f"## `{info['name']}` version {info['version']} → alias `{info['alias']}`\n\n"
            "```python\nimport mlflow, pandas as pd\n"
            f"mlflow.set_tracking_uri({cfg.tracking_uri!r})\n"
            f"model = mlflow.pyfunc.load_model({info['uri_by_alias']!r})\n"
            "out = model.predict(pd.DataFrame({'prompt': ['a red circle']}))\n```\n\n"
            + "\n".join(f"- {k}: `{v}`" for k, v in lineage.items())
        ),
    )
    return {**info, "lineage": lineage}
