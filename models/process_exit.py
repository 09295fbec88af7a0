"""End a finished command's process without Python's interpreter teardown.

Python's teardown clears every module that torch, diffusers, transformers, streaming and
MLflow have imported, one object at a time: about 1.3 CPU-seconds per process on this
project's 2-core machine (benchmarks/process_exit.py). Every stage, generation and precompute
launch pays it once per rank, and a short training stage or a CLI command spends more time
tearing down than training or working. `run_then_exit` keeps what Python's exit does that
matters and skips the rest:

- threads are shut down as Python does it: the `threading` exit callbacks run (executors
  and streaming's prepare threads are told to stop), then non-daemon threads are joined;
- every `atexit` callback runs, in Python's order: MLflow ending its runs and flushing
  asynchronous logging, streaming unlinking its shared memory, multiprocessing reaping its
  children, logging flushing its handlers;
- one garbage collection, as Python's exit runs before the teardown: what only cyclic garbage
  still holds is closed (an unclosed SQLite connection, whose write-ahead log would stay);
- the standard streams are flushed (a failed flush makes the status 120, as Python's).

What is skipped is freeing memory the kernel reclaims anyway. Only a `main` that returns or
raises `SystemExit` takes this path: another exception leaves as usual, with its traceback
and exit status 1.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import NoReturn

__all__ = ["run_then_exit"]


def run_then_exit(main: Callable[[], object]) -> NoReturn:
    """Run `main`, then end the process at once with its status.

    Args:
        main: The command. Its `SystemExit` (argparse's, click's) gives the status; a return
            means 0.
    """
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code
    if code is not None and not isinstance(code, int):  # SystemExit("message"), as Python
        if sys.stderr is not None:
            sys.stderr.write(f"{code}\n")
        code = 1
    # The steps Python's own exit takes before it tears down modules (Py_FinalizeEx):
    # `_shutdown` runs the callbacks of `threading._register_atexit`, then joins non-daemon
    # threads (joining them without those callbacks would wait forever on an executor still
    # referenced); the `atexit` callbacks; a garbage collection, which closes what only
    # cyclic garbage still holds (a SQLAlchemy engine's SQLite connection, say: unclosed, its
    # write-ahead log is left beside the database).
    try:
        threading._shutdown()
    except BaseException:  # as Python's exit: reported, and the exit goes on
        if sys.stderr is not None:
            traceback.print_exc()
    atexit._run_exitfuncs()
    gc.collect()
    for stream in (sys.stdout, sys.stderr):
        if stream is None:  # started with the stream closed
            continue
        try:
            stream.flush()
        except ValueError:  # closed by the program
            pass
        except OSError:  # a broken pipe, a full disk: output was lost, as Python says
            code = code or 120
    os._exit((code or 0) & 0xFF)
