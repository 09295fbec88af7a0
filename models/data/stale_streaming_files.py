"""Streaming's leftovers from killed processes: shared memory and lock files nobody uses.

Every `StreamingDataset` registers a numeric prefix (`000123_locals`, `000123_barrier`, ...)
in `/dev/shm` and lock files (`000123_barrier_filelock`) in the temp folder. A process that is
SIGKILLed never removes them, and a new dataset skips every prefix that still has them.
Streaming's own `clean_stale_shared_memory` walks prefixes from 0 and stops at the first free
one, so leftovers above a gap stay forever; it also removes prefixes that live processes on
the same machine are using. After many killed runs the prefixes climb, and a relaunch racing a
dead process's cleanup has failed with `FileExistsError` on one of them.

`clean_stale_streaming` removes exactly the prefixes that no live process holds: a prefix is
in use when any of its shared-memory files is open or mapped by a process in `/proc`. Other
jobs' datasets on the same machine are left alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
from pathlib import Path

from streaming.base.constant import BARRIER_FILELOCK, CACHE_FILELOCK, SHM_TO_CLEAN

__all__ = ["clean_stale_streaming"]

log = logging.getLogger(__name__)

# streaming's names only: `<6-digit prefix>_<name>`.
_SHM = re.compile(rf"^(\d{{6}})_(?:{'|'.join(SHM_TO_CLEAN)})$")
_LOCK = re.compile(rf"^(\d{{6}})_(?:{BARRIER_FILELOCK}|{CACHE_FILELOCK})$")


def _held(shm_dir: Path) -> set[str]:
    """Prefixes of shared-memory files under `shm_dir` that some live process has open or
    mapped. Processes whose /proc entries we may not read hold nothing of ours (their files
    are not ours to remove either)."""
    held: set[str] = set()
    base = str(shm_dir) + "/"
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        proc = Path("/proc", pid)
        try:
            for fd in os.listdir(proc / "fd"):
                try:
                    target = os.readlink(proc / "fd" / fd)
                except OSError:  # closed meanwhile (the listing's own descriptor, say)
                    continue
                if target.startswith(base) and (m := _SHM.match(target[len(base) :])):
                    held.add(m.group(1))
            with open(proc / "maps") as maps:
                for line in maps:
                    i = line.find(base)
                    if i >= 0 and (m := _SHM.match(line[i + len(base) :].split()[0])):
                        held.add(m.group(1))
        except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):
            continue  # exited meanwhile, or not ours
    return held


def clean_stale_streaming(shm_dir: str = "/dev/shm", lock_dir: str | None = None) -> list[str]:
    """Remove streaming's shared memory and lock files of prefixes no live process holds.

    Call it on one process per machine before any `StreamingDataset` is made. Returns the
    names removed.
    """
    shm, locks = Path(shm_dir), Path(lock_dir or tempfile.gettempdir())
    if not shm.is_dir():
        return []
    # The files first, then who holds them: a dataset another process registers while /proc
    # is read is not in this listing, so it cannot be taken for a dead one. Scanning first
    # would leave a window in which a new dataset's files are listed but not yet seen held
    # (a spawned loader worker then fails to attach to them).
    listed = []
    for folder, pattern in ((shm, _SHM), (locks, _LOCK)):
        for name in sorted(os.listdir(folder)):
            if m := pattern.match(name):
                with contextlib.suppress(FileNotFoundError):
                    listed.append((folder / name, m.group(1), (folder / name).stat().st_ino))
    held = _held(shm)
    removed = []
    for path, prefix, inode in listed:
        if prefix in held:
            continue
        try:
            if path.stat().st_ino != inode:  # removed and made again by a new dataset
                continue
            path.unlink()
            removed.append(path.name)
        except (FileNotFoundError, PermissionError):
            continue
    if removed:
        log.info(
            "removed %d stale streaming files (shared memory and locks of killed runs)",
            len(removed),
        )
    return removed
