"""A stage through SLURM on two nodes against a local launch, on a two-node SLURM cluster that
this script starts on loopback (tests/slurm_cluster.py: munged, slurmctld, two slurmd; needs
root and Debian's `slurmd slurmctld slurm-client munge`).

Each run is the real stage task (`tasks.launch.accelerate.launch_stage`) on the tiny preset's first
stage:
2 nodes x 1 process through `sbatch`/`srun`, and 1 node x 2 processes as a local `accelerate
launch`, alternated `--repeats` times. It writes JSON with, per engine, the median time from
the call to the first optimizer step (submission, scheduling, process start, model build and
the first batch) and the median step time after it, and their ratios SLURM / local.

    python benchmarks/multinode.py --out benchmarks/results/multinode.json

It also fits the scale model's per-collective latency (`tasks.planning.scale_model.fit_loopback`)
to the
two step times and writes it, with the model's prediction beside the measurement, under
`scale_model`; `--fit-only` adds that to an existing result without running anything.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def _cluster_module():
    spec = importlib.util.spec_from_file_location(
        "slurm_cluster", REPO / "tests" / "slurm_cluster.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _shards(base: Path) -> tuple[Path, Path, str]:
    """The demo set (60 images), validated and sharded for the tiny stages."""
    from kiln_config import load_config
    from kiln_demo.data import write_demo_dataset
    from tasks.ingest.run import ingest_source
    from tasks.quality.validate import validate_catalog
    from tasks.shards.write import write_shards

    write_demo_dataset(base / "src", n=60, seed=0)
    cfg = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    cfg["storage"]["root"], cfg["ingest"]["source"] = str(base / "root"), str(base / "src")
    cfg["evaluate"]["prompts_csv"] = str(REPO / "configs" / "prompts" / "tiny.csv")
    (base / "tiny.yaml").write_text(yaml.safe_dump(cfg))
    pipeline = load_config(base / "tiny.yaml")
    root = pipeline.storage.root
    ing = ingest_source(pipeline.ingest, root)
    validate_catalog.fn(root, ing.ingest_id, pipeline.quality)
    res = write_shards.fn(
        pipeline.shards,
        root,
        ing.ingest_id,
        [32],
        tokenizer=pipeline.train.model.tokenizer.model_dump(),
    )
    return base / "tiny.yaml", Path(root), res.dataset_version


def _run(cfg_path: Path, shards: Path, out: Path, steps: int, nodes: int, launch) -> dict:
    from kiln_config import StageRun, load_config
    from tasks.launch.accelerate import launch_stage

    train = load_config(cfg_path).train
    stage = train.stages[0].model_copy(
        update={"max_steps": steps, "batch_size": 4, "num_machines": nodes}
    )
    train = train.model_copy(
        update={
            "stages": [stage],
            "checkpoint_every": 10 * steps,
            "eval_every": None,
            "log_every": 1,
        }
    )
    run = StageRun(train=train, stage_index=0, shards=str(shards), output_dir=str(out))
    called = time.time()
    launch_stage.fn(run, launch)
    times = [
        json.loads(line)["time"]
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if "step" in json.loads(line)
    ]
    gaps = [b - a for a, b in zip(times[1:], times[2:], strict=False)]  # after the first step
    return {
        "to_first_step_s": round(times[0] - called, 2),
        "step_s": round(statistics.median(gaps), 4),
    }


def _with_fit(result: dict) -> dict:
    """`result` with the scale model's overheads fitted to its median step times."""
    from kiln_config import load_config
    from tasks.planning.activation_trace import unet_parameter_count
    from tasks.planning.scale_model import fit_loopback

    n = unet_parameter_count(load_config(REPO / "configs" / "tiny.yaml").train.model.unet)
    result["scale_model"] = {"unet_parameters": n, **fit_loopback(result["median"], n)}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON output path")
    p.add_argument("--steps", type=int, default=30, help="Optimizer steps per run")
    p.add_argument("--repeats", type=int, default=3, help="Runs of each engine, alternated")
    p.add_argument("--fit-only", action="store_true", help="Only refit the result at --out")
    args = p.parse_args()
    if args.fit_only:
        result = json.loads(Path(args.out).read_text())
        Path(args.out).write_text(json.dumps(_with_fit(result), indent=2) + "\n")
        print(json.dumps(result["scale_model"]))
        return
    # Prefect's temporary server for the task calls: no telemetry, no warnings per log line.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")

    from kiln_config import LaunchConfig, SlurmConfig

    mod = _cluster_module()
    why = mod.slurm_available()
    if why:
        raise SystemExit(f"multinode: no SLURM cluster can start here: {why}")
    single = str(REPO / "configs" / "accelerate" / "single.yaml")
    ddp = str(REPO / "configs" / "accelerate" / "cpu-ddp-2.yaml")
    engines = {
        "local_1x2": (1, LaunchConfig(accelerate_config=ddp, gpu_limit=None)),
        "slurm_2x1": (
            2,
            LaunchConfig(
                accelerate_config=single,
                backend="slurm",
                gpu_limit=None,
                slurm=SlurmConfig(poll_s=0.2),
            ),
        ),
    }
    runs: dict[str, list[dict]] = {k: [] for k in engines}
    with tempfile.TemporaryDirectory(prefix="kiln-multinode-") as tmp:
        base = Path(tmp)
        cfg_path, root, version = _shards(base)
        shards = root / "shards" / version / "32"
        with mod.SlurmCluster(base / "slurm") as cluster:
            os.environ |= {"SLURM_CONF": str(cluster.conf), "GLOO_SOCKET_IFNAME": "lo"}
            for i in range(args.repeats):
                for name, (nodes, launch) in engines.items():
                    out = base / f"{name}-{i}"
                    runs[name].append(_run(cfg_path, shards, out, args.steps, nodes, launch))
                    print(name, runs[name][-1], flush=True)
    med = {
        name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()
    }
    result = {
        "benchmark": "multinode",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "stage": {
            "resolution": 32,
            "batch_size_per_process": 4,
            "steps": args.steps,
            "processes": 2,
        },
        "runs": runs,
        "median": med,
        "slurm_vs_local": {
            "to_first_step": round(
                med["slurm_2x1"]["to_first_step_s"] / med["local_1x2"]["to_first_step_s"], 3
            ),
            "step": round(med["slurm_2x1"]["step_s"] / med["local_1x2"]["step_s"], 3),
        },
    }
    result = _with_fit(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["median"]), json.dumps(result["slurm_vs_local"]))


if __name__ == "__main__":
    main()
