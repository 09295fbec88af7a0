"""The real recipe at its real size on this machine: SD2-base (865,910,724 UNet parameters),
its VAE and OpenCLIP-H-sized text encoder with random weights, through the real commands.

`kiln demo-data`, then `kiln ingest`, `validate`, `shard` (images; and again with
`shards.precompute`, which adds latents and text states, unless `--no-precompute`; a run that
trains on latents shards only that way), `train` (three stages of a few steps, 64 ->
128 -> 192 px, batch 1, EMA on; the training process is SIGKILLed mid-stage right after a
checkpoint and the flow's relaunch resumes it), `evaluate` (a study of two prompts) and
`register`; then a fresh process loads the export with diffusers'
`StableDiffusionPipeline.from_pretrained` and generates. With `--reference`, the killed stage
is trained again without interruption from the same stage file, and the two exports are
compared tensor by tensor.

Peak memory per process: every process of each command's tree is sampled with psutil every
0.2 s (RSS; the largest sample per command line kind), and `ru_maxrss` of the waited-for
children (resource.getrusage) gives the largest single process exactly.

    python benchmarks/real_size.py --work /tmp/kiln-real --reference \\
        --out benchmarks/results/real_size.json
    python benchmarks/real_size.py --reduced --train-on latents --reference --work DIR --out F

`--reduced` (the test's variant, tests/test_real_size.py): the same widths, head dimensions,
text width and VAE, with one layer per UNet block and a 2-layer text encoder.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import yaml

REPO = Path(__file__).resolve().parent.parent
KILLED_RES = 128  # the stage killed mid-way: after its next-to-last step's checkpoint


def _label(cmd: list[str]) -> str:
    line = " ".join(cmd)
    if "models.train" in line:
        return "accelerate launch" if "accelerate" in line else "models.train"
    if "kiln_cli" in line:
        return (
            "kiln " + cmd[cmd.index("kiln_cli") + 1]
            if cmd.index("kiln_cli") + 1 < len(cmd)
            else "kiln"
        )
    if "prefect" in line and "server" in line or "uvicorn" in line:
        return "prefect server"
    if "multiprocessing" in line or "joblib" in line:
        return "worker processes"
    if "-c" in cmd:
        return "python -c (the export's consumer)"
    return " ".join(Path(c).name for c in cmd[:3])[:60]


class TreeMonitor(threading.Thread):
    """Samples the RSS of every process under `pid`; optionally SIGKILLs the training process
    once `kill_when()` is true, and calls `tidy()` at every sample."""

    def __init__(self, pid: int, kill_when=None, tidy=None):
        super().__init__(daemon=True)
        self.root, self.kill_when, self.tidy, self.peaks = psutil.Process(pid), kill_when, tidy, {}
        self.tree_peak, self.killed_at, self._done = 0, None, threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.2):
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                return
            total = 0
            for p in procs:
                try:
                    rss, cmd = p.memory_info().rss, p.cmdline()
                except psutil.Error:
                    continue
                total += rss
                label = _label(cmd)
                self.peaks[label] = max(self.peaks.get(label, 0), rss)
                due = self.kill_when and self.killed_at is None and label == "models.train"
                if due and self.kill_when():
                    p.send_signal(signal.SIGKILL)
                    self.killed_at = time.time()
            self.tree_peak = max(self.tree_peak, total)
            if self.tidy:
                self.tidy()

    def stop(self) -> dict:
        self._done.set()
        self.join()
        return {k: round(v / 2**30, 2) for k, v in sorted(self.peaks.items())}


def _run(cmd: list[str], env: dict, log: Path, kill_when=None, tidy=None) -> dict:
    """Run `cmd`; returns its wall time, output and per-process peak RSS (GiB)."""
    t = time.perf_counter()
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        out_path = log.with_suffix(".stdout")
        with open(out_path, "w") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=f, cwd=REPO)
            mon = TreeMonitor(proc.pid, kill_when, tidy)
            mon.start()
            rc = proc.wait()
            peaks = mon.stop()
    stdout = out_path.read_text()
    with open(log, "a") as f:
        f.write(stdout)
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {rc}; see {log}")
    return {
        "wall_s": round(time.perf_counter() - t, 1),
        "peak_rss_gib": peaks,
        "tree_peak_gib": round(mon.tree_peak / 2**30, 2),
        "killed": mon.killed_at is not None,
        "stdout": stdout,
    }


def _result_json(stdout: str) -> dict:
    """The JSON object a `kiln` command prints last."""
    start = stdout.rfind("\n{")
    return json.loads(stdout[start + 1 if start >= 0 else stdout.index("{") :])


def _du_gib(path: Path) -> float:
    return round(sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**30, 3)


def write_config(
    work: Path,
    components: Path,
    *,
    reduced: bool,
    precompute: bool,
    steps: tuple[int, ...],
    val: bool,
    resolutions: tuple[int, ...] = (64, 128, 192),
) -> Path:
    """configs/sd2-base.yaml at its real size on the demo images, with few steps (`steps`: one
    count per stage) and small studies; `reduced`: one layer per UNet block (the widths and
    heads are SD2's)."""
    cfg = yaml.safe_load((REPO / "configs" / "sd2-base.yaml").read_text())
    cfg["storage"]["root"] = str(work / "root")
    cfg["ingest"] |= {"source": str(work / "demo"), "workers": 2}
    # The demo images carry no license or aesthetic columns (a team's own catalog does).
    cfg["ingest"]["metadata_columns"] = []
    cfg["quality"] |= {
        "min_side": 32,
        "max_reject_fraction": 0.25,
        "allowed_licenses": None,
        "min_aesthetic": None,
        # No CLIP weights ship in a package; the offline content rules stay on.
        "clip_model": None,
        "min_clip_score": None,
        "aesthetic_head": None,
        "semantic_duplicate_similarity": None,
    }
    # 40-128 px demo images; 0.3 lets the 192 px stage take (upscaled) images from 58 px.
    cfg["shards"] |= {
        "aspect_buckets": False,
        "min_side_factor": 0.3,
        "val_max": 2,
        "val_fraction": 0.1 if val else 0.0,
        "workers": 2,
        "precompute": precompute,
    }
    stage = {"batch_size": 1, "learning_rate": 1.0e-4, "lr_scheduler": "constant"}
    train = cfg["train"]
    train |= {
        "stages": [
            {"resolution": r, "max_steps": n, **stage}
            for r, n in zip(resolutions, steps, strict=True)
        ],
        # The killed stage's next-to-last step, where it is killed; every stage also writes
        # one at its last step.
        "checkpoint_every": _killed_at(resolutions, steps),
        "keep_checkpoints": 1,
        "log_every": 1,
        "num_workers": 0,
        "eval_every": None,
        "val_timesteps": 1,
        "val_max_samples": 2,
        "sample_prompts": ["a red circle above a small blue square on a white background"],
        "sample_seeds": [0],
        "sample_steps": 2,
        # This machine's 24 GB: docs/benchmarks.md, "Real-size run".
        "ema_dtype": "bfloat16",
    }
    train["model"] |= {
        name: {"pretrained": str(components), "subfolder": name}
        for name in ("vae", "text_encoder", "tokenizer")
    }
    if reduced:
        train["model"]["unet"]["layers_per_block"] = 1
    cfg["evaluate"] |= {
        "prompts_csv": str(REPO / "tests" / "data" / "prompts.csv"),
        "limit": 2,
        "seeds": [0],
        "num_inference_steps": 2,
        "batch_size": 2,
    }
    cfg["launch"] |= {
        "accelerate_config": str(REPO / "configs/accelerate/single.yaml"),
        "max_restarts": 2,
    }
    path = work / ("real-latents.yaml" if precompute else "real.yaml")
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _killed_at(resolutions: tuple[int, ...], steps: tuple[int, ...]) -> int:
    """The step of the killed stage's checkpoint after which its process is killed."""
    return steps[resolutions.index(KILLED_RES)] - 1


def _stage_dir(root: Path, run_id: str, res: int) -> Path:
    return root / "runs" / run_id / f"stage-{res}"


def _killed_checkpoint_ready(root: Path, step: int):
    """True once the killed stage's checkpoint of `step` is complete (renamed into place)."""

    def ready() -> bool:
        pattern = f"runs/*/stage-{KILLED_RES}/checkpoints/step-{step:08d}/kiln_state.json"
        return any(root.glob(pattern))

    return ready


class CompletedCheckpoints:
    """Deletes a stage's checkpoints once the stage is complete (its manifest written: a
    relaunch skips it), recording their sizes first: at real size each is 12 GB."""

    def __init__(self, root: Path):
        self.root, self.sizes = root, {}

    def __call__(self) -> None:
        for manifest in self.root.glob("runs/*/stage-*/manifest.json"):
            ckpts = sorted((manifest.parent / "checkpoints").glob("step-*[0-9]"))
            if not ckpts:
                continue
            files = {f.name: round(f.stat().st_size / 2**30, 3) for f in ckpts[-1].iterdir()}
            self.sizes[manifest.parent.name] = {
                "gib": round(sum(files.values()), 3),
                "files_gib": files,
            }
            shutil.rmtree(manifest.parent / "checkpoints", ignore_errors=True)


def _stage_figures(stage: Path, ckpt: dict) -> dict:
    rows = [json.loads(x) for x in (stage / "metrics.jsonl").read_text().splitlines() if x]
    steps = [r for r in rows if "step_time_s" in r]
    manifest = json.loads((stage / "manifest.json").read_text())
    return {
        "step_time_s": [round(r["step_time_s"], 2) for r in steps],
        "checkpoint_gib": ckpt["gib"],
        "checkpoint_files_gib": ckpt["files_gib"],
        "export_gib": _du_gib(stage / "final"),
        "export_unet_gib": _du_gib(stage / "final" / "unet"),
        "final_step": manifest["final_step"],
        "losses": manifest["losses"],
        "resumed": any(
            json.loads(x).get("event") == "resumed"
            for x in (stage / "metrics.jsonl").read_text().splitlines()
            if x
        ),
    }


def reference_run(stage: Path, out: Path, env: dict, log: Path) -> dict:
    """Train the killed stage again, uninterrupted, from its own stage file, and compare the
    two exports' UNets (EMA and raw) tensor by tensor, and the loss histories."""
    run = yaml.safe_load((stage / "stage.yaml").read_text())
    run |= {"output_dir": str(out), "tracking_uri": None, "mlflow_run_id": None}
    # One checkpoint, the last step's (a stage always writes one): the run is only compared,
    # never resumed, and a second copy of the weights and the optimizer would add several GB
    # of disk at the end of the benchmark, when the exports and the registry's copy are there.
    run["train"]["checkpoint_every"] = run["train"]["stages"][run["stage_index"]]["max_steps"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "stage.yaml").write_text(yaml.safe_dump(run, sort_keys=False))
    from models.training.cpu_threads import cpu_threads_per_process

    # The thread count of the flow's launch (tasks/launch/accelerate.py): another count sums the
    # gradients' partial sums in another order, and the weights differ in the last bits.
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "configs/accelerate/single.yaml"),
        "--num_cpu_threads_per_process",
        str(cpu_threads_per_process(1)),
        "-m",
        "models.train",
        "--config",
        str(out / "stage.yaml"),
    ]
    r = _run(cmd, env, log)
    from safetensors.torch import load_file

    same = {}
    for sub in ("final/unet", "final-raw/unet"):
        a = load_file(stage / sub / "diffusion_pytorch_model.safetensors")
        b = load_file(out / sub / "diffusion_pytorch_model.safetensors")
        same[sub] = a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
        del a, b
    losses = [json.loads((d / "manifest.json").read_text())["losses"] for d in (stage, out)]
    return {
        "wall_s": r["wall_s"],
        "peak_rss_gib": r["peak_rss_gib"],
        "bit_exact": same,
        "losses_equal": losses[0] == losses[1],
        "losses": losses,
    }


CONSUMER = """
import json, sys, time, torch
from diffusers import StableDiffusionPipeline
pipe = StableDiffusionPipeline.from_pretrained(sys.argv[1])
n = sum(p.numel() for p in pipe.unet.parameters())
t = time.perf_counter()
img = pipe("a red circle above a small blue square", num_inference_steps=2,
           generator=torch.Generator().manual_seed(0)).images[0]
img.save(sys.argv[2])
print(json.dumps({"unet_parameters": n, "size": list(img.size),
                  "generate_s": round(time.perf_counter() - t, 1),
                  "scaling_factor": pipe.vae.config.scaling_factor,
                  "text_width": pipe.text_encoder.config.hidden_size,
                  "text_layers": pipe.text_encoder.config.num_hidden_layers}))
"""


def _registered(root: Path, name: str, alias: str) -> dict:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    v = client.get_model_version_by_alias(name, alias)
    return {"name": name, "version": v.version, "alias": alias, "source": v.source}


def run_all(args, env: dict, res: dict) -> None:
    """Every step, in order, filling `res` with the figures as they come."""
    work, log = args.work, args.work / "commands.log"
    work.mkdir(parents=True, exist_ok=True)
    kiln = [sys.executable, "-m", "kiln_cli"]
    res |= {
        "reduced": args.reduced,
        "train_on": args.train_on,
        "steps_per_stage": args.steps,
        "validation": not args.no_val,
        "steps": {},
    }
    steps = res["steps"]
    steps["demo-data"] = _run([*kiln, "demo-data", str(work / "demo"), "--n", "24"], env, log)
    components = work / "sd2-random"
    steps["components"] = _run(
        [
            sys.executable,
            "-m",
            "models.sd2_components",
            "--out",
            str(components),
            "--text-layers",
            "2" if args.reduced else "23",
        ],
        env,
        log,
    )
    opts = {
        "reduced": args.reduced,
        "steps": args.steps,
        "val": not args.no_val,
        "resolutions": args.resolutions,
    }
    plain = write_config(work, components, precompute=False, **opts)
    latents = write_config(work, components, precompute=True, **opts)
    for step in ("ingest", "validate"):
        steps[step] = _run([*kiln, step, "--config", str(plain)], env, log)
    # The precomputed version holds the stage images as well: training on it needs no other.
    if args.train_on == "images":
        steps["shard"] = _run([*kiln, "shard", "--config", str(plain)], env, log)
    if args.train_on == "latents" or not args.no_precompute:
        steps["shard-precompute"] = _run([*kiln, "shard", "--config", str(latents)], env, log)
    versions = {
        k: _result_json(steps[k]["stdout"])["dataset_version"]
        for k in ("shard", "shard-precompute")
        if k in steps
    }
    cfg = latents if args.train_on == "latents" else plain
    version = versions["shard-precompute" if args.train_on == "latents" else "shard"]
    root = work / "root"
    kill_when = _killed_checkpoint_ready(root, _killed_at(args.resolutions, args.steps))
    tidy = CompletedCheckpoints(root)
    steps["train"] = _run(
        [*kiln, "train", "--config", str(cfg), "--dataset-version", version],
        env,
        log,
        kill_when=kill_when,
        tidy=tidy,
    )
    tidy()
    run_id = _result_json(steps["train"]["stdout"])["run_id"]
    res["run_id"], res["dataset_versions"] = run_id, versions
    res["stages"] = {
        r: _stage_figures(_stage_dir(root, run_id, r), tidy.sizes[f"stage-{r}"])
        for r in args.resolutions
    }
    steps["evaluate"] = _run(
        [*kiln, "evaluate", "--config", str(cfg), "--run-id", run_id], env, log
    )
    study = _result_json(steps["evaluate"]["stdout"])
    res["study"] = {k: v for k, v in study.items() if not isinstance(v, (dict, list))}
    record = json.loads((Path(study["path"]) / "study.json").read_text())
    res["study"] |= {
        "generated_s": record.get("generated_s"),
        "settings": record["settings"],
        "prompts": sorted({i["prompt"] for i in record["items"]}),
    }
    steps["register"] = _run(
        [*kiln, "register", "--config", str(cfg), "--run-id", run_id], env, log
    )
    res["registered"] = _registered(root, "kiln-t2i", "candidate")
    export = _stage_dir(root, run_id, args.resolutions[-1]) / "final"
    steps["consumer"] = _run(
        [sys.executable, "-c", CONSUMER, str(export), str(work / "generated.png")], env, log
    )
    res["consumer"] = _result_json(steps["consumer"]["stdout"])
    if args.reference:
        res["reference"] = reference_run(
            _stage_dir(root, run_id, KILLED_RES), work / f"reference-{KILLED_RES}", env, log
        )
    for s in steps.values():
        s.pop("stdout", None)


def _resolutions(text: str) -> tuple[int, ...]:
    try:
        res = tuple(int(r) for r in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected resolutions like 64,128 (got {text!r})"
        ) from None
    if KILLED_RES not in res or len(res) < 2 or list(res) != sorted(set(res)):
        raise argparse.ArgumentTypeError(
            f"expected at least two increasing resolutions including {KILLED_RES} (got {text!r})"
        )
    return res


def _steps(text: str) -> tuple[int, ...]:
    try:
        steps = tuple(int(n) for n in text.split(","))
    except ValueError:
        steps = ()
    if not steps or min(steps) < 1:
        raise argparse.ArgumentTypeError(
            f"expected a step count, or one per stage like 1,2 (got {text!r})"
        )
    return steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="JSON output path")
    p.add_argument("--work", required=True, type=Path, help="Working folder (a fresh one)")
    p.add_argument("--reduced", action="store_true", help="One layer per block (the test's)")
    p.add_argument(
        "--train-on",
        choices=("images", "latents"),
        default="images",
        help="Train on the image shards or the precomputed ones",
    )
    p.add_argument("--reference", action="store_true", help="Rerun the killed stage whole")
    p.add_argument(
        "--steps",
        type=_steps,
        default=(3,),
        help=f"Optimizer steps per stage: one count for all, or one per stage (1,2); at least "
        f"2 for the killed {KILLED_RES} px stage (default: 3)",
    )
    p.add_argument("--no-val", action="store_true", help="No validation split (faster)")
    p.add_argument(
        "--resolutions",
        type=_resolutions,
        default=(64, 128, 192),
        help=f"The stages' resolutions, comma-separated; {KILLED_RES} (the killed stage) among "
        "them (default: 64,128,192)",
    )
    p.add_argument(
        "--no-precompute",
        action="store_true",
        help="Skip the precomputed shards (with --train-on images)",
    )
    args = p.parse_args()
    if len(args.steps) == 1:
        args.steps *= len(args.resolutions)
    if len(args.steps) != len(args.resolutions):
        p.error(f"--steps: {len(args.steps)} counts for {len(args.resolutions)} stages")
    if _killed_at(args.resolutions, args.steps) < 1:
        p.error(f"--steps: the killed {KILLED_RES} px stage needs at least 2")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    env.setdefault("PREFECT_HOME", str(args.work / "prefect"))
    t, res = time.perf_counter(), {}
    try:
        run_all(args, env, res)
    except Exception as e:  # the figures so far are written with the error
        res["error"] = repr(e)
        raise
    finally:
        for s in res.get("steps", {}).values():
            s.pop("stdout", None)
        res["largest_process_gib"] = round(
            resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 2
        )
        res["total_wall_s"] = round(time.perf_counter() - t, 1)
        res["machine"] = {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "mem_gib": round(psutil.virtual_memory().total / 2**30, 1),
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))
    for d in args.work.glob("reference-*"):  # its checkpoints (each stage's went at its end)
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
