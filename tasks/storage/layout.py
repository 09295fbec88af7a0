"""Where every artefact lives under the storage root (docs/architecture.md, "Storage layout").

Each step records the id of its newest output in `<root>/<kind>/LATEST`, so that the next
step, run on its own, finds its input without being told. Two defaults under the root are
the config's, since kiln_config is below this layer: the tracking store
(`sqlite:///<root>/mlflow.db`, `PipelineConfig.tracking_uri`) and the streaming cache
(`<root>/cache`, `shards.cache_dir`).

Every id that names a folder here (an ingest, a dataset version, a run, a study, a comparison,
a downloaded model) passes `kiln_config.check_id` first: one path component, never `..`, so
that no id, from a command line, a deployment's parameters or a registry tag, leaves the root.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from kiln_config import check_id
from kiln_config.errors import MissingInput

__all__ = ["Layout", "is_published", "new_run_id"]

KINDS = ("catalog", "shards", "runs", "eval")


def is_published(dataset: Path) -> bool:
    """Whether an MDS dataset folder is complete: its index.json, or for a stage written as
    aspect-ratio buckets, its buckets.json (written after every bucket's index)."""
    return (dataset / "index.json").is_file() or (dataset / "buckets.json").is_file()


def new_run_id() -> str:
    """A new training run's id: `run-<UTC timestamp>`."""
    return time.strftime("run-%Y%m%d-%H%M%S", time.gmtime())


@dataclass(frozen=True)
class Layout:
    root: Path

    def folder(self, kind: str) -> Path:
        """The folder of every output of one kind (`catalog`, `shards`, `runs`, `eval`)."""
        assert kind in KINDS, kind
        return self.root / kind

    def catalog(self, ingest_id: str) -> Path:
        return self.folder("catalog") / check_id("ingest id", ingest_id)

    def catalog_staging(self, ingest_id: str) -> Path:
        """Where an ingest stages its rows while it decodes (removed when it commits)."""
        return self.folder("catalog") / f"{check_id('ingest id', ingest_id)}.staging"

    def catalog_tables(self) -> Path:
        """The catalog's Delta tables, one folder each (tasks/catalog/view.py)."""
        return self.folder("catalog") / "tables"

    def quality(self, ingest_id: str) -> Path:
        return self.root / "quality" / check_id("ingest id", ingest_id)

    def shards(self, version: str, resolution: int | None = None) -> Path:
        base = self.folder("shards") / check_id("dataset version", version)
        return base if resolution is None else base / str(resolution)

    def latents(self, version: str, resolution: int, encoder_key: str) -> Path:
        """Precomputed latents of a stage, for one set of frozen encoders."""
        return self.shards(version) / f"{resolution}-latents-{encoder_key}"

    def val_shards(self, version: str, resolution: int) -> Path:
        """A stage's held-out validation split (never in the training shards)."""
        return self.shards(version) / f"{resolution}-val"

    def val_latents(self, version: str, resolution: int, encoder_key: str) -> Path:
        """Precomputed latents of a stage's validation split."""
        return self.shards(version) / f"{resolution}-val-latents-{encoder_key}"

    def vae_cache(self) -> Path:
        """Fitted VAEs (`train.model.vae.fit`), one folder per key (`models.components.vae_fit`)."""
        return self.root / "vae"

    def run(self, run_id: str) -> Path:
        return self.folder("runs") / check_id("run id", run_id)

    def run_record(self, run_id: str) -> Path:
        """The run's `run.json`: its stages, dataset version, MLflow run and export."""
        return self.run(run_id) / "run.json"

    def run_config(self, run_id: str) -> Path:
        """The run's config snapshot: what every step of the run reads after it starts."""
        return self.run(run_id) / "config.yaml"

    def plan(self) -> Path:
        """`kiln plan`'s newest plan, which `kiln train` reads for its world sizes."""
        return self.folder("runs") / "plan.json"

    def catalog_lock(self) -> Path:
        """The lock each writer of the catalog holds while it commits (tasks/storage/lock.py)."""
        return self.root / ".kiln-catalog.lock"

    def train_lock(self) -> Path:
        """The lock one training holds on the root (tasks/storage/lock.py)."""
        return self.root / ".kiln-train.lock"

    def mlflow_artifacts(self) -> Path:
        """The artifact root of the experiments a local tracking store creates."""
        return self.root / "mlartifacts"

    def registered_model(self, name: str, version: str | int) -> Path:
        """A registered version downloaded from the registry (tasks/registry/tracking.py)."""
        name = check_id("registered model name", name)
        return self.root / "models" / check_id("registered model", f"{name}-v{version}")

    def stage(self, run_id: str, resolution: int) -> Path:
        return self.run(run_id) / f"stage-{resolution}"

    def takedowns(self) -> Path:
        """The takedown list: one file per addition, never edited (tasks/catalog/takedown.py)."""
        return self.root / "takedowns"

    def dataset_rows(self, version: str) -> Path:
        """The rows a dataset version holds, with their licensing columns
        (tasks/catalog/dataset_lineage.py)."""
        return self.shards(version) / "rows.parquet"

    def study(self, study_id: str) -> Path:
        return self.folder("eval") / check_id("study id", study_id)

    def ratings_db(self) -> Path:
        """The human evaluation's SQLite store when `human_eval.database_url` is unset."""
        return self.root / "human_eval" / "ratings.db"

    def comparison(self, comparison_id: str) -> Path:
        """A human comparison's report, votes and chart (human_eval/report.py)."""
        return self.root / "human_eval" / check_id("comparison id", comparison_id)

    def set_latest(self, kind: str, ident: str) -> None:
        path = self.folder(kind) / "LATEST"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(ident + "\n")
        tmp.replace(path)

    def latest_or_none(self, kind: str) -> str | None:
        path = self.folder(kind) / "LATEST"
        return path.read_text().strip() if path.is_file() else None

    def latest(self, kind: str, needed_by: str) -> str:
        """The newest id of `kind`, or a clear error naming the step that must run first."""
        path = self.folder(kind) / "LATEST"
        if not path.is_file():
            before = {"catalog": "ingest", "shards": "shard", "runs": "train", "eval": "evaluate"}
            raise MissingInput(
                f"{needed_by} needs the output of `kiln {before[kind]}`, but {path} does not "
                f"exist under root {self.root}; run `kiln {before[kind]}` first"
            )
        return path.read_text().strip()

    def finished_run(self, run_id: str | None, needed_by: str) -> tuple[str, dict]:
        """(run id, run.json) of a training run that has exported; default the newest run."""
        run_id = run_id or self.latest("runs", needed_by)
        path = self.run_record(run_id)
        if not path.is_file():
            raise MissingInput(f"{needed_by}: no training run {run_id} under {self.root}")
        record = json.loads(path.read_text())
        if "export" not in record:
            raise MissingInput(
                f"{needed_by}: training run {run_id} has not finished (no export in run.json); "
                f"resume it with `kiln train --run-id {run_id}`"
            )
        return run_id, record
