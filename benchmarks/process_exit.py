"""A launched process's exit: Python's interpreter teardown against `models.process_exit`.

Every `accelerate launch` rank (train, generate, precompute, validation, health check) and
every `kiln` command imports torch, diffusers, transformers, streaming and MLflow, and then
ends. This measures, in one run, alternating the two so that the machine's speed moves both
alike:

* baseline: a process that imports the module and returns from `main` (Python's normal exit:
  its teardown clears every imported module);
* run_then_exit: the same process ending through `models.process_exit.run_then_exit`
  (threads joined, atexit callbacks run, streams flushed, then `os._exit`).

Each measurement is the child's wall time from start to exit and its CPU time (user + system,
from `os.wait4`). The import is the same in both, so the difference is the exit.

    python benchmarks/process_exit.py --out benchmarks/results/process_exit.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PROGRAMS = {
    "baseline": "import {module}\ndef main():\n    pass\nmain()\n",
    "run_then_exit": (
        "import {module}\nfrom models.process_exit import run_then_exit\n"
        "def main():\n    pass\nrun_then_exit(main)\n"
    ),
}


def _measure(code: str) -> tuple[float, float]:
    """Wall and CPU seconds of one `python -c code` child, start to exit."""
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"the child failed (exit {proc.returncode}): {code!r}")
    return wall, usage.ru_utime + usage.ru_stime


def run(modules: list[str], repeats: int) -> dict:
    result: dict = {"benchmark": "process_exit", "repeats": repeats, "modules": {}}
    for module in modules:
        samples: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": []} for k in PROGRAMS}
        for _ in range(repeats):  # alternating: the machine's speed moves both alike
            for name, template in PROGRAMS.items():
                wall, cpu = _measure(template.format(module=module))
                samples[name]["wall"].append(wall)
                samples[name]["cpu"].append(cpu)
        med = {n: {k: round(statistics.median(v), 3) for k, v in s.items()}
               for n, s in samples.items()}  # fmt: skip
        result["modules"][module] = {
            "median": med,
            "saved_wall_s": round(med["baseline"]["wall"] - med["run_then_exit"]["wall"], 3),
            "saved_cpu_s": round(med["baseline"]["cpu"] - med["run_then_exit"]["cpu"], 3),
            "samples": {
                n: {k: [round(x, 3) for x in v] for k, v in s.items()} for n, s in samples.items()
            },  # fmt: skip
        }
        print(module, json.dumps(result["modules"][module]["median"]),
              "saved", result["modules"][module]["saved_wall_s"], "s wall,",
              result["modules"][module]["saved_cpu_s"], "s CPU", flush=True)  # fmt: skip
    result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                         "platform": platform.platform()}  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modules", nargs="+",
                        default=["models.train", "models.generate", "flows.cli, flows.pipeline"],
                        help="What each child imports (the launched scripts' and a kiln "
                             "command's imports)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", required=True, help="JSON result file")
    args = parser.parse_args(argv)
    result = run(args.modules, args.repeats)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
