"""New data landed: the `kiln.ingest.completed` event, and whether it makes a retrain due.

After every ingest the ingest flow emits a Prefect event

    event:    kiln.ingest.completed
    resource: kiln.root.<hash of storage.root>   (name: the root; label kiln.retrain-due)
    payload:  new_accepted, new_since_training, min_new_images, retrain_due, ingest_id, ...

`new_since_training` counts the accepted images of the catalog view that are new or changed
(by source, key, sha256 and caption) since the catalog of the newest *finished* training run
(one that exported; a crashed or running one trained on nothing yet). The retrain is due when
that count reaches `retrain.min_new_images`, a finished training exists (a retrain continues
from a model: the first one is trained from scratch), the ingest ran on its own (the
pipeline's own ingest never asks for another pipeline), and no training holds the root.

A takedown also makes a retrain due: `kiln takedown add` emits `kiln.takedown.added` on the
same resource, labelled `kiln.retrain-due` "true" when the newest finished training's dataset
holds a taken-down image (`taken_down_since_training`), and the pipeline's `only_new_data`
check trains when that count is above zero, whatever arrived.

The `weekly-retrain` deployment's trigger matches `kiln.retrain-due: "true"` and passes the
event's root to `flows/retrain.py`, which does nothing for another root's event; the
threshold lives in the config, not in the trigger; the cron schedule stays as the fallback.
Without a Prefect server (`PREFECT_API_URL` unset) the event goes to the command's temporary
server, where no trigger runs: the report says so.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from tasks.catalog.dataset_lineage import dataset_rows
from tasks.catalog.takedown import takedown_set
from tasks.catalog.view import chain, scan_view, view_parts
from tasks.runtime.logs import task_logger
from tasks.storage.layout import Layout
from tasks.storage.lock import root_busy

__all__ = [
    "INGEST_COMPLETED",
    "TAKEDOWN_ADDED",
    "NewData",
    "emit_ingest_completed",
    "emit_takedown_added",
    "new_data",
    "root_resource_id",
    "taken_down_since_training",
]

INGEST_COMPLETED = "kiln.ingest.completed"
TAKEDOWN_ADDED = "kiln.takedown.added"
_IDENTITY = ["source", "key", "sha256", "caption"]


@dataclass(frozen=True)
class NewData:
    ingest_id: str
    new_accepted: int  # accepted images this ingest decoded (new or changed files)
    view_accepted: int  # accepted images of every source in the root
    new_since_training: int  # accepted images new or changed since the newest training's catalog
    trained_ingest_id: str | None  # the catalog the newest training run was sharded from
    trained_run_id: str | None
    min_new_images: int
    standalone: bool  # the ingest ran on its own, not as the first step of a pipeline
    root_busy: bool  # a training holds the root's lock
    retrain_due: bool
    server: bool = True  # a Prefect server receives the event (PREFECT_API_URL is set)
    taken_down_since_training: int = 0  # images of the newest training's dataset taken down

    def to_dict(self) -> dict:
        return asdict(self)


def _trained_run(layout: Layout) -> tuple[str | None, dict]:
    """(run id, run.json) of the newest training run that exported, or (None, {})."""
    runs = layout.folder("runs")
    for run in sorted(runs.glob("run-*"), reverse=True) if runs.is_dir() else []:
        path = run / "run.json"
        record = json.loads(path.read_text()) if path.is_file() else {}
        if record.get("export"):  # else crashed, cancelled or training: trained on nothing yet
            return run.name, record
    return None, {}


def _trained_catalog(layout: Layout) -> tuple[str | None, str | None]:
    """(run id, ingest id) of the newest training run that exported, or (None, None)."""
    run_id, record = _trained_run(layout)
    if not record.get("dataset_version"):  # nothing trained yet
        return run_id, None
    shards = layout.shards(record["dataset_version"]) / "shards.json"
    ingest = json.loads(shards.read_text()).get("ingest_id") if shards.is_file() else None
    return run_id, ingest


def taken_down_since_training(root: Path | str, rules=None) -> int:
    """How many images of the newest finished training's dataset are on the takedown list."""
    layout = Layout(Path(root))
    down = takedown_set(root)
    _, record = _trained_run(layout)
    version = record.get("dataset_version")
    if not down or not version or not (layout.shards(version) / "shards.json").is_file():
        return 0
    return int(down.mask(dataset_rows(root, version, rules), "contributor").sum())


def _identities(batch: pd.DataFrame) -> np.ndarray:
    """One 64-bit hash per row of (source, key, sha256, caption)."""
    return pd.util.hash_pandas_object(batch[_IDENTITY].astype(str), index=False).to_numpy()


def _view_identities(layout: Layout, ingest_id: str) -> np.ndarray:
    """`_identities` of every accepted row of the view after `ingest_id`, scanned a row group
    at a time."""
    got = [_identities(b) for b in scan_view(layout, ingest_id, "accepted", _IDENTITY)]
    return np.concatenate(got) if got else np.zeros(0, np.uint64)


def new_since(layout: Layout, ingest_id: str, trained: str) -> int:
    """Accepted rows of the view after `ingest_id` that the view after `trained` lacks (by
    source, key, sha256 and caption).

    When `trained` is behind `ingest_id` in its chain (the usual case), a row of an ingest up
    to `trained` that is still in the view was in `trained`'s view too, so only the rows
    ingested since can be new: their identities are held, and the trained view is scanned a
    row group at a time for rows of the same keys (an item read again unchanged is not new).
    Memory then holds the rows since training, not the catalog. Otherwise the two views are
    compared whole.
    """
    links = chain(layout, ingest_id)
    seqs = {s["id"]: int(s["ingest_seq"]) for s in links}
    if trained not in seqs:
        current = _view_identities(layout, ingest_id)
        return int((~np.isin(current, _view_identities(layout, trained))).sum())
    since = list(scan_view(layout, ingest_id, "accepted", _IDENTITY, after_seq=seqs[trained]))
    if not since:
        return 0
    hashes = np.concatenate([_identities(b) for b in since])
    keys = pd.Index(pd.concat([b["key"] for b in since], ignore_index=True).unique())
    del since
    found = np.zeros(len(hashes), bool)
    for batch in scan_view(layout, trained, "accepted", _IDENTITY):
        same_key = batch[keys.get_indexer(batch["key"]) >= 0]
        if len(same_key):
            found |= np.isin(hashes, _identities(same_key))
    return int((~found).sum())


def new_data(
    root: Path | str, ingest_id: str, new_accepted: int, min_new_images: int, standalone: bool
) -> NewData:
    """What the ingest `ingest_id` brought since the newest training, and whether a retrain
    is due."""
    layout = Layout(Path(root))
    accepted = sum(p.rows for p in view_parts(layout, ingest_id, "accepted"))
    run_id, trained = _trained_catalog(layout)
    if trained is not None and (layout.catalog(trained) / "summary.json").is_file():
        since = new_since(layout, ingest_id, trained)
    else:
        if run_id is not None:
            task_logger(__name__).warning(
                "training run %s's catalog is not under %s: counting every accepted image as new",
                run_id,
                layout.root,
            )
        since = accepted
    busy = root_busy(layout.root)
    down = taken_down_since_training(root)
    from prefect.settings import PREFECT_API_URL

    return NewData(
        ingest_id=ingest_id,
        new_accepted=int(new_accepted),
        view_accepted=accepted,
        new_since_training=since,
        trained_ingest_id=trained,
        trained_run_id=run_id,
        min_new_images=min_new_images,
        standalone=standalone,
        root_busy=busy,
        retrain_due=(
            standalone and not busy and run_id is not None and (since >= min_new_images or down > 0)
        ),
        server=bool(PREFECT_API_URL.value()),
        taken_down_since_training=down,
    )


def root_resource_id(root: Path | str) -> str:
    """The event resource id of a storage root: stable, and free of the path's characters."""
    return "kiln.root." + hashlib.sha256(str(root).encode()).hexdigest()[:16]


def emit_ingest_completed(root: Path | str, data: NewData) -> None:
    """Emit `kiln.ingest.completed` for `data` (to the Prefect API of the run, if any)."""
    from prefect.events import emit_event

    emit_event(
        event=INGEST_COMPLETED,
        resource={
            "prefect.resource.id": root_resource_id(root),
            "prefect.resource.name": str(root),
            "kiln.retrain-due": "true" if data.retrain_due else "false",
        },
        payload=data.to_dict(),
    )
    task_logger(__name__).info(
        "%s: %d new accepted images, %d since the newest training (retrain at %d): retrain %s",
        INGEST_COMPLETED,
        data.new_accepted,
        data.new_since_training,
        data.min_new_images,
        "due" if data.retrain_due else "not due",
    )


def emit_takedown_added(root: Path | str, added: int, taken_down: int) -> bool:
    """Emit `kiln.takedown.added` after an addition to the takedown list; the retrain is due
    when the newest finished training's dataset holds `taken_down` > 0 taken-down images and
    no training holds the root. Returns whether it was due."""
    from prefect.events import emit_event

    due = taken_down > 0 and not root_busy(Path(root))
    emit_event(
        event=TAKEDOWN_ADDED,
        resource={
            "prefect.resource.id": root_resource_id(root),
            "prefect.resource.name": str(root),
            "kiln.retrain-due": "true" if due else "false",
        },
        payload={
            "added": int(added),
            "taken_down_since_training": int(taken_down),
            "retrain_due": due,
        },
    )
    task_logger(__name__).info(
        "%s: %d rows added; %d images of the newest training's dataset are taken down: retrain %s",
        TAKEDOWN_ADDED,
        added,
        taken_down,
        "due" if due else "not due",
    )
    return due
