"""Wall time of the demo pipeline (`kiln demo-data` + `kiln run` on configs/tiny.yaml).

Writes JSON with the total, a per-step breakdown (from when each step's output appeared),
and, as the in-run baseline, the fixed cost of one `accelerate launch` that only imports the
training script: the demo makes four such launches (three stages and generation), so
`launch_floor_frac` says how much of the demo is process start-up rather than work.

    python benchmarks/demo_walltime.py --out benchmarks/results/demo_walltime.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _run(cmd: list[str], env: dict, cwd: Path) -> float:
    t = time.perf_counter()
    subprocess.run(
        cmd, check=True, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON output path")
    p.add_argument("--n", type=int, default=400, help="Demo images (as `make demo`)")
    args = p.parse_args()
    kiln = str(Path(sys.executable).parent / "kiln")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        env = {**os.environ, "PREFECT_HOME": str(work / "prefect")}
        env.pop("PREFECT_API_URL", None)
        (work / "noop.py").write_text(
            "import models.train  # imports torch, diffusers, streaming\n"
        )
        floor = _run(
            [
                sys.executable,
                "-m",
                "accelerate.commands.launch",
                "--config_file",
                str(REPO / "configs/accelerate/single.yaml"),
                str(work / "noop.py"),
            ],
            env,
            work,
        )
        t0 = time.time()
        demo_data_s = _run([kiln, "demo-data", str(work / "demo"), "--n", str(args.n)], env, work)
        cfg = REPO / "configs" / "tiny.yaml"
        run_cmd = [kiln, "run", "--config", str(cfg), "--source", str(work / "demo")]
        run_s = _run([*run_cmd, "--root", str(work / "root")], env, REPO)
        root = work / "root"
        marks = {
            "ingest": next(root.glob("catalog/*/summary.json")),
            "validate": next(root.glob("quality/*/summary.json")),
            "shard": next(root.glob("shards/*/shards.json")),
            **{
                f"train_{p.parent.name}": p
                for p in sorted(root.glob("runs/*/stage-*/manifest.json"))
            },
            "evaluate": next(root.glob("eval/*/study.json")),
            "register": root / "mlflow.db",
        }
        steps, last = {}, t0 + demo_data_s
        for name, path in sorted(marks.items(), key=lambda kv: kv[1].stat().st_mtime):
            m = path.stat().st_mtime
            steps[name] = round(m - last, 2)
            last = m
    total = demo_data_s + run_s
    result = {
        "benchmark": "demo_walltime",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "node": platform.machine(),
        },
        "demo_images": args.n,
        "demo_data_s": round(demo_data_s, 2),
        "kiln_run_s": round(run_s, 2),
        "total_s": round(total, 2),
        "steps_s": steps,
        "baseline_launch_floor_s": round(floor, 2),
        "launch_floor_frac": round(4 * floor / run_s, 3),
        "aim_total_s": 300,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
