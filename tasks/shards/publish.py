"""Publish: mirror a finished dataset version to object storage, for training to stream from.

`<root>/shards/<version>/` (its stages, aspect buckets, validation splits and precomputed
latents: every complete dataset folder in it) is copied to `<shards.remote>/<version>/` with
the same layout. Training machines then stream it through
a node-local cache (`shards.cache_dir`) instead of reading every sample from a shared mount,
as MosaicML's SD2 run streamed from object storage.

Publishing is atomic per dataset, like the shard step. Every data file is uploaded first;
then the index files, deepest first, so that a dataset's top `index.json` (or a bucketed
stage's `buckets.json`, after every bucket's index) is the last object it gets; last comes the
version's `shards.json`. A loader finds a dataset through that top file, so it never sees a
dataset whose shards are not all there. A crashed publish resumes: objects already there
with the same size are not sent again. A dataset whose top file is already remote is skipped
whole: a version never changes, since its name hashes its input and settings.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from kiln_config.errors import MissingInput
from tasks.runtime.logs import task_logger
from tasks.storage.layout import Layout, is_published
from tasks.storage.objects import Storage

__all__ = ["PublishResult", "publish_dataset", "publish_shards"]

INDEX_FILES = ("index.json", "buckets.json")


@dataclass
class PublishResult:
    remote: str  # URI of the version's copy
    uploaded: int = 0  # objects sent by this call
    already_there: int = 0  # objects of unfinished datasets found there, same size
    bytes: int = 0  # bytes sent by this call
    published: list[str] = field(default_factory=list)  # datasets completed by this call
    reused: list[str] = field(default_factory=list)  # datasets that were already complete

    def to_dict(self) -> dict:
        return asdict(self)


def _top_file(dataset: Path) -> str:
    return "buckets.json" if (dataset / "buckets.json").is_file() else "index.json"


def publish_dataset(base: str | Path, dest: Storage, workers: int = 8) -> PublishResult:
    """Copy the dataset version at `base` (`<root>/shards/<version>`) to `dest`/<version>/.

    Args:
        base: A finished version folder (it has `shards.json`).
        dest: Where versions are published (`Storage(shards.remote)`).
        workers: Concurrent uploads.

    Raises:
        FileNotFoundError: `base` is not a finished dataset version.
    """
    base = Path(base)
    if not (base / "shards.json").is_file():
        raise MissingInput(
            f"{base} is not a finished dataset version (no shards.json): run `kiln shard` first"
        )
    log = task_logger(__name__)
    version = base.name
    result = PublishResult(remote=dest.url(version))
    datasets = sorted(p for p in base.iterdir() if p.is_dir() and is_published(p))
    for ds in datasets:
        prefix = f"{version}/{ds.name}"
        if dest.exists(f"{prefix}/{_top_file(ds)}"):
            result.reused.append(ds.name)
            continue
        there = {o.key: o.size for o in dest.list(prefix + "/")}
        # Dot-files are temporaries of an interrupted local write; they are not data.
        files = [p for p in sorted(ds.rglob("*")) if p.is_file() and not p.name.startswith(".")]
        todo = [(p, f"{prefix}/{p.relative_to(ds).as_posix()}") for p in files]
        todo = [
            (p, k) for p, k in todo if there.get(k) != p.stat().st_size or p.name in INDEX_FILES
        ]
        result.already_there += len(files) - len(todo)
        data = [(p, k) for p, k in todo if p.name not in INDEX_FILES]
        with ThreadPoolExecutor(max(1, workers)) as pool:
            list(pool.map(lambda pk: dest.upload_file(pk[1], pk[0]), data))
        # Index files after every data file, deepest first: the dataset's top file last.
        indexes = sorted(
            (pk for pk in todo if pk[0].name in INDEX_FILES),
            key=lambda pk: -len(pk[0].relative_to(ds).parts),
        )
        for p, key in indexes:
            dest.upload_file(key, p)
        result.uploaded += len(todo)
        result.bytes += sum(p.stat().st_size for p, _ in todo)
        result.published.append(ds.name)
    dest.upload_file(f"{version}/shards.json", base / "shards.json")
    log.info(
        "published %s to %s: %d objects (%.1f MB) sent, %d already there; %s complete before",
        version,
        result.remote,
        result.uploaded,
        result.bytes / 1e6,
        result.already_there,
        result.reused or "none",
    )
    return result


# Idempotent (finished datasets are skipped, the rest resumes), so retrying is safe.
@task(name="publish-shards", retries=2, retry_delay_seconds=5, cache_policy=NO_CACHE)
def publish_shards(
    root: str,
    version: str,
    remote: str,
    endpoint_url: str | None = None,
    dest: Storage | None = None,
) -> dict:
    """Publish dataset `version` under `root` to `remote` (see `publish_dataset`).

    `dest` replaces `Storage(remote, endpoint_url)` (tests pass one that fails mid-way).
    """
    dest = dest or Storage(remote, endpoint_url=endpoint_url)
    return publish_dataset(Layout(Path(root)).shards(version), dest).to_dict()
