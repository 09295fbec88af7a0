"""models/process_exit.py: a finished command keeps what Python's exit does that matters
(threads, atexit callbacks, logging, buffered output, the status) and skips the teardown."""

import os
import subprocess
import sys
import textwrap

import pytest

PROGRAM = """
import atexit, concurrent.futures, gc, logging, sys, threading, time
from pathlib import Path
from models.process_exit import run_then_exit

gc.disable()  # so that only an explicit collection finds the cycle below
out = Path(sys.argv[1])
EXECUTOR = concurrent.futures.ThreadPoolExecutor(1)  # referenced to the end: joined only
# after threading's exit callbacks tell it to stop (a bare join would wait forever)

class Teardown:
    def __del__(self):  # runs in the interpreter's teardown of this module, not before
        (out / "teardown").write_text("ran")

KEEP = Teardown()

class Cycle:  # garbage only a collection finds: an unclosed connection's engine, say
    def __init__(self):
        self.me = self
    def __del__(self):
        (out / "cycle").write_text("collected")

def main():
    Cycle()
    logging.basicConfig(filename=out / "log.txt", level=logging.INFO)
    logging.getLogger("t").info("logged")
    atexit.register(lambda: (out / "atexit").write_text("ran"))
    def late():
        time.sleep(0.5)
        (out / "thread").write_text("ran")
    threading.Thread(target=late).start()  # non-daemon: still running when main returns
    EXECUTOR.submit(time.sleep, 0.1)
    sys.stdout.write("buffered, no newline")
    {ending}

run_then_exit(main)
"""


def _run(tmp_path, ending: str) -> subprocess.CompletedProcess:
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(PROGRAM).replace("{ending}", ending))
    return subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    "ending,code,stderr",
    [
        ("return None", 0, ""),
        ("raise SystemExit(3)", 3, ""),
        ("raise SystemExit('health check failed')", 1, "health check failed\n"),
    ],
)
def test_a_finished_main_keeps_threads_callbacks_logs_output_and_status(
    tmp_path, ending, code, stderr
):
    proc = _run(tmp_path, ending)
    assert (proc.returncode, proc.stderr) == (code, stderr)
    assert proc.stdout == "buffered, no newline"
    assert (tmp_path / "thread").read_text() == "ran"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert "logged" in (tmp_path / "log.txt").read_text()
    assert (tmp_path / "cycle").read_text() == "collected", "the exit's garbage collection"
    assert not (tmp_path / "teardown").exists(), "the interpreter's teardown is skipped"


def test_an_exception_leaves_as_python_does(tmp_path):
    proc = _run(tmp_path, "raise RuntimeError('boom')")
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "RuntimeError: boom" in proc.stderr
    assert (tmp_path / "thread").read_text() == "ran"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "teardown").read_text() == "ran", "the usual teardown"


def test_a_closed_stdout_and_a_failing_thread_callback_do_not_change_the_status(tmp_path):
    """Started with stdout closed (`kiln ... >&-`), and a threading exit callback that raises:
    reported, as Python's exit does, and the status stays main's."""
    script = tmp_path / "prog.py"
    script.write_text(
        textwrap.dedent("""
        import threading
        from models.process_exit import run_then_exit
        threading._register_atexit(lambda: 1 / 0)
        run_then_exit(lambda: None)
    """)
    )
    proc = subprocess.run([sys.executable, str(script)], stderr=subprocess.PIPE, text=True,
                          timeout=60, preexec_fn=lambda: os.close(1))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "ZeroDivisionError" in proc.stderr
