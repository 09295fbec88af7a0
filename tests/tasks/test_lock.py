"""One training writer per root: a second fails at once, a killed holder leaves no stale lock."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tasks.lock import RootBusy, root_lock

HOLD = """
import sys, time
from pathlib import Path
from tasks.lock import root_lock
with root_lock(Path(sys.argv[1]), "kiln train run-x"):
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_second_holder_fails_at_once_and_a_killed_one_frees_the_root(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        with pytest.raises(RootBusy) as e, root_lock(tmp_path, "kiln train run-y"):
            pass
        assert time.monotonic() - t0 < 5, "fails at once, does not wait"
        msg = str(e.value)
        assert f"kiln train run-x (pid {holder.pid} on" in msg and "another storage.root" in msg
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
    # The kernel dropped the dead holder's lock; the same process may nest (a train subflow).
    with root_lock(tmp_path, "kiln train run-y"), root_lock(tmp_path, "nested train subflow"):
        pass
    with root_lock(tmp_path, "again"):  # released on exit
        pass
