"""Streaming's shared memory and lock files: a killed run's are removed, a live run's kept."""

import mmap
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from models.data.stale_streaming_files import _held, clean_stale_streaming

_DATASET = """
import os, signal, sys, time
from streaming import StreamingDataset
ds = StreamingDataset(local=sys.argv[1], batch_size=1)
next(iter(ds))  # the epoch's barrier takes its lock file too
print(ds._shm_prefix_int, flush=True)
if sys.argv[2] == "die":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(300)
"""


def _files(prefix: int) -> list[Path]:
    p = f"{prefix:06d}_"
    return [
        f
        for d in (Path("/dev/shm"), Path(tempfile.gettempdir()))
        for f in d.iterdir()
        if f.name.startswith(p)
    ]


def _taken(prefix: int) -> bool:
    """Whether a live process holds shared memory under `prefix` now."""
    return f"{prefix:06d}" in _held(Path("/dev/shm"))


@pytest.mark.integration
def test_a_killed_runs_leftovers_go_and_a_live_runs_stay(tiny_shards):
    _, root, version = tiny_shards
    local = str(next((root / "shards" / version).glob("32")))

    def start(mode: str) -> tuple[subprocess.Popen, int]:
        proc = subprocess.Popen(
            [sys.executable, "-c", _DATASET, local, mode], stdout=subprocess.PIPE, text=True
        )
        return proc, int(proc.stdout.readline())

    live, live_prefix = start("live")
    try:
        dead, dead_prefix = start("die")
        dead.wait(timeout=60)
        assert live_prefix != dead_prefix
        assert any(f.name.endswith("_filelock") for f in _files(dead_prefix)), "left behind"
        held = _files(live_prefix)
        assert any(f.parent == Path("/dev/shm") for f in held)
        removed = clean_stale_streaming()
        # Unless a process of another test took the freed prefix meanwhile (two test workers
        # train at once, and each launch cleans up and then takes the lowest free prefix).
        assert not _files(dead_prefix) or _taken(dead_prefix), "the killed run's files are gone"
        assert all(
            n.startswith(f"{dead_prefix:06d}_") or not n.startswith(f"{live_prefix:06d}_")
            for n in removed
        )
        assert sorted(_files(live_prefix)) == sorted(held), "the live run's files are kept"
    finally:
        live.kill()
        live.wait()
    clean_stale_streaming()
    assert not _files(live_prefix) or _taken(live_prefix), "once it is gone, its files go too"


def test_only_streamings_names_are_touched(tmp_path):
    shm, locks = tmp_path / "shm", tmp_path / "locks"
    shm.mkdir()
    locks.mkdir()
    for name in (
        "000900_locals",
        "000900_barrier",
        "000901_locals",
        "000902_mapped_only",
        "000904_epoch_data",
        "not_streaming",
        "000903_something_else",
    ):
        (shm / name).write_bytes(b"\0" * 4096)
    for name in (
        "000900_barrier_filelock",
        "000901_cache_filelock",
        "000905_cache_filelock",
        "000906_other_filelock",
    ):
        (locks / name).touch()
    with open(shm / "000904_epoch_data", "r+b") as f:  # mapped, its descriptor closed
        mapped = mmap.mmap(f.fileno(), 4096)
    with open(shm / "000901_locals", "rb"):  # open by this live process
        removed = clean_stale_streaming(str(shm), str(locks))
    mapped.close()
    assert sorted(removed) == [
        "000900_barrier",
        "000900_barrier_filelock",
        "000900_locals",
        "000905_cache_filelock",
    ]
    assert sorted(os.listdir(shm)) == [
        "000901_locals",
        "000902_mapped_only",
        "000903_something_else",
        "000904_epoch_data",
        "not_streaming",
    ]
    assert sorted(os.listdir(locks)) == ["000901_cache_filelock", "000906_other_filelock"]


def test_a_dataset_registered_while_processes_are_read_is_kept(tmp_path, monkeypatch):
    """Another process registers a new prefix after /proc was read: its files are not a dead
    run's, though no process was seen holding them."""
    import models.data.stale_streaming_files as stale

    shm, locks = tmp_path / "shm", tmp_path / "locks"
    shm.mkdir()
    locks.mkdir()
    (shm / "000910_locals").write_bytes(b"\0" * 64)  # a killed run's
    read_procs = stale._held

    def held_then_registered(folder):
        held = read_procs(folder)
        (shm / "000911_locals").write_bytes(b"\0" * 64)
        (locks / "000911_barrier_filelock").touch()
        return held

    monkeypatch.setattr(stale, "_held", held_then_registered)
    assert clean_stale_streaming(str(shm), str(locks)) == ["000910_locals"]
    assert os.listdir(shm) == ["000911_locals"]
    assert os.listdir(locks) == ["000911_barrier_filelock"]
