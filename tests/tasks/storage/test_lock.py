"""One training writer per root: a second fails at once, a killed holder leaves no stale lock."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tasks.storage.lock import RootBusy, busy_reason, root_lock

HOLD = """
import sys, time
from pathlib import Path
from tasks.storage.lock import root_lock
with root_lock(Path(sys.argv[1]), "kiln train run-x"):
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_second_holder_fails_at_once_and_a_killed_one_frees_the_root(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        with pytest.raises(RootBusy) as e, root_lock(tmp_path, "kiln train run-y"):
            pass
        assert time.monotonic() - t0 < 5, "fails at once, does not wait"
        msg = str(e.value)
        assert f"kiln train run-x (pid {holder.pid} on" in msg and "another storage.root" in msg
        assert busy_reason(tmp_path) == msg, "the CLI's probe names the holder the same way"
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
    # The kernel dropped the dead holder's lock; the same process may nest (a train subflow).
    assert busy_reason(tmp_path) is None
    with root_lock(tmp_path, "kiln train run-y"), root_lock(tmp_path, "nested train subflow"):
        assert busy_reason(tmp_path) is None, "this process's own lock re-enters"
    with root_lock(tmp_path, "again"):  # released on exit
        pass


@pytest.mark.integration
def test_kiln_train_and_run_on_a_busy_root_fail_at_once_and_touch_nothing(
    tmp_path, demo_src, make_config
):
    root = tmp_path / "root"
    cfg = make_config(tmp_path / "tiny.yaml", root, demo_src)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(root)], stdout=subprocess.PIPE, text=True
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    try:
        assert holder.stdout.readline().strip() == "held"
        procs = [
            subprocess.run(
                [sys.executable, "-m", "kiln_cli", cmd, "--config", str(cfg)],
                capture_output=True,
                text=True,
                env=env,
                timeout=300,
            )
            for cmd in ("train", "run")
        ]
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
    for proc in procs:
        assert proc.returncode == 1, proc.stderr[-2000:]
        (line,) = proc.stderr.splitlines()  # one line, no traceback
        assert line.startswith(
            f"kiln: error: {root} is in use by kiln train run-x (pid {holder.pid} on "
        )
        assert line.endswith("or give this run another storage.root (--root)")
    # Refused before any flow run: no Prefect server, database or run folder was made.
    assert not (tmp_path / "prefect").exists(), "a Prefect server was started"
    assert sorted(p.name for p in root.iterdir()) == [".kiln-train.lock"], "nothing touched"


def test_two_ingests_into_one_root_at_once_take_turns(tmp_path):
    """Two ingests of two sources into one root, started together: the catalog writer's
    lock makes the second wait, so they take ingest_seq 1 and 2 and the view holds both."""
    import json
    import threading

    from kiln_config import IngestConfig
    from kiln_demo.data import write_demo_dataset
    from tasks.catalog.view import read_view
    from tasks.ingest.run import ingest_source
    from tasks.storage.layout import Layout

    root = tmp_path / "root"
    srcs = [tmp_path / "a", tmp_path / "b"]
    for i, src in enumerate(srcs):
        write_demo_dataset(src, n=10, seed=i)
    results, errors = {}, []

    def ingest(src):
        try:
            results[src.name] = ingest_source(IngestConfig(source=str(src)), str(root))
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=ingest, args=(s,)) for s in srcs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors
    seqs = sorted(
        json.loads((root / "catalog" / r.ingest_id / "summary.json").read_text())["ingest_seq"]
        for r in results.values()
    )
    assert seqs == [1, 2]
    last = max(results.values(), key=lambda r: r.view_accepted)
    accepted = read_view(Layout(root), last.ingest_id)[0]
    assert accepted["source"].nunique() == 2
    assert last.view_accepted == sum(r.accepted for r in results.values())


HOLD_CATALOG = """
import sys, time
from pathlib import Path
from tasks.storage.lock import catalog_writer
with catalog_writer(Path(sys.argv[1]), "kiln ingest of s3://held"):
    print("held", flush=True)
    time.sleep(120)
"""


def test_validate_waits_for_the_catalog_writer(tmp_path):
    """A validate started while an ingest (another process) holds the catalog's lock waits
    for it and touches nothing meanwhile; once the lock is free it runs to its verdict."""
    import threading

    from kiln_config import IngestConfig, QualityConfig
    from kiln_demo.data import write_demo_dataset
    from tasks.ingest.run import ingest_source
    from tasks.quality.validate import validate_catalog

    root, src = tmp_path / "root", tmp_path / "src"
    write_demo_dataset(src, n=12, seed=3)
    ing = ingest_source(IngestConfig(source=str(src)), str(root))
    cat = root / "catalog" / ing.ingest_id
    before = sorted(p.name for p in cat.iterdir())
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_CATALOG, str(root)], stdout=subprocess.PIPE, text=True
    )
    out = {}

    def validate():
        try:
            out["result"] = validate_catalog.fn(
                str(root), ing.ingest_id, QualityConfig(), allow_failed_gate=True
            )
        except Exception as e:  # reported below
            out["error"] = e

    try:
        assert holder.stdout.readline().strip() == "held"
        t = threading.Thread(target=validate)
        t.start()
        time.sleep(3)
        assert t.is_alive(), "validate must wait for the catalog writer"
        assert sorted(p.name for p in cat.iterdir()) == before, "nothing written while waiting"
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
    t.join(timeout=300)
    assert "error" not in out, out.get("error")
    assert out["result"].listed == 12 and (cat / "verdict.json").is_file()
