"""One training writer per storage root, and one catalog writer at a time.

Two `kiln train` / `kiln run` processes on the same root would race on `runs/LATEST`, on a
resumed run's checkpoints and on the MLflow run's state. The train flow holds an exclusive
`flock` on `<root>/.kiln-train.lock` for its whole run; a second one fails at once with a
message naming the holder (pid, host, what, since). The kernel drops the lock when the holder
exits, however it exits, so a crash never leaves a stale lock. Re-entrant within one process
(the pipeline flow's train subflow). `flock` is per machine: on a shared filesystem mounted
by several machines, give each its own root or serialise runs with the deployments'
concurrency limit.

The catalog's writers (an ingest, a validate, compaction, migration) hold
`<root>/.kiln-catalog.lock` while they read the current view and commit to it
(`catalog_writer`): a second one waits for the first, so two ingests never take the same
`ingest_seq`, two validates never write one verdict at once, and compaction never races a
commit.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

from kiln_config.errors import KilnError
from tasks.storage.layout import Layout

__all__ = ["RootBusy", "busy_reason", "catalog_writer", "root_busy", "root_lock"]

_held: dict[str, int] = {}  # lock path -> depth, in this process
_guard = threading.Lock()


class RootBusy(KilnError, RuntimeError):
    """Another process trains on this root."""


def _try_exclusive(fd: int) -> bool:
    """Take the lock without waiting; a `root_busy` probe holds it shared for an instant and
    writes no holder, so an empty lock file gets a few more tries before it counts as busy."""
    for attempt in range(5):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if os.pread(fd, 1, 0):  # a real holder wrote who it is
                return False
            time.sleep(0.05 * (attempt + 1))
    return False


@contextmanager
def root_lock(root: Path, what: str) -> Iterator[None]:
    """Hold `<root>/.kiln-train.lock` exclusively while the block runs.

    Raises:
        RootBusy: another process holds it; the message names it and what to do.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path = Layout(root).train_lock().resolve()

    def take(fd: int) -> None:
        if not _try_exclusive(fd):
            raise RootBusy(_busy_message(root, fd)) from None

    with _holding(path, str(path), what, take):
        yield


@contextmanager
def catalog_writer(root: Path, what: str, *, log_every_s: float = 30.0) -> Iterator[None]:
    """Hold `<root>/.kiln-catalog.lock` exclusively while the block runs, waiting for
    another writer to finish (logged every `log_every_s` seconds, naming it). Re-entrant
    within one thread."""
    path = Layout(Path(root)).catalog_lock()
    path.parent.mkdir(parents=True, exist_ok=True)

    def take(fd: int) -> None:
        waited = time.monotonic()
        while not _try_exclusive(fd):
            if time.monotonic() - waited >= log_every_s:
                holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
                logging.getLogger(__name__).info("%s waits for the catalog writer %s", what, holder)
                waited = time.monotonic()
            time.sleep(0.5)

    # Per thread: another thread of this process opens its own descriptor, which the lock
    # held on this one's excludes.
    with _holding(path, f"{path.resolve()}#{threading.get_ident()}", what, take):
        yield


@contextmanager
def _holding(path: Path, key: str, what: str, take: Callable[[int], None]) -> Iterator[None]:
    """Hold the flock on `path` while the block runs: `take(fd)` acquires it (or raises),
    then the holder (what, pid, host, since) is written into the file. Re-entrant for the
    same `key`."""
    with _guard:
        nested = key in _held
        if nested:
            _held[key] += 1
    if nested:
        try:
            yield
        finally:
            with _guard:
                _held[key] -= 1
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        take(fd)
        info = {
            "what": what,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        with _guard:
            _held[key] = 1
        try:
            yield
        finally:
            with _guard:
                _held.pop(key, None)
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _busy_message(root: Path, fd: int) -> str:
    """Who holds the lock open on `fd` (the holder writes it), and what to do."""
    holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "{}"
    try:
        h = json.loads(holder)
        who = f"{h.get('what')} (pid {h.get('pid')} on {h.get('host')}, since {h.get('since')})"
    except ValueError:
        who = "another process"
    return (
        f"{root} is in use by {who}: wait for it to finish, or give this run another "
        "storage.root (--root)"
    )


def busy_reason(root: Path) -> str | None:
    """The message `root_lock` would raise now, or None when no other process holds the
    lock: a probe for the CLI, which fails at once instead of after a Prefect server start.
    The flow still takes the lock itself (a probe is no reservation)."""
    path = Layout(Path(root)).train_lock()
    if not path.is_file() or not root_busy(root):
        return None
    with _guard:
        if str(path.resolve()) in _held:
            return None  # this process's own: root_lock re-enters
    fd = os.open(path, os.O_RDONLY)
    try:
        if not os.pread(fd, 1, 0):
            return None  # an instant's probe by another process, not a holder
        return _busy_message(Path(root), fd)
    finally:
        os.close(fd)


def root_busy(root: Path) -> bool:
    """Whether a training holds `<root>/.kiln-train.lock` now (this process's own counts)."""
    path = Layout(Path(root)).train_lock()
    if not path.is_file():
        return False
    key = str(path.resolve())
    with _guard:
        if key in _held:
            return True
    fd = os.open(key, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)
