"""The GPU check: Kiln's training proven and measured on one GPU, in two device calls.

    python benchmarks/gpu_check.py --out DIR            # CUDA: the full check (make gpu-check)
    python benchmarks/gpu_check.py --only train,fsdp,study --out DIR  # one call's half (7.3 min)
    python benchmarks/gpu_check.py --only matmul,unet,loader --out DIR  # the other (6.1 min)
    python benchmarks/gpu_check.py --dry-run --out DIR  # toy sizes on the CPU, in minutes
    python benchmarks/gpu_check.py --only unet,loader --out DIR   # a rerun of some steps

Steps, each in its own process with a time box, so that a failing or hanging step is recorded
(its error text) and the rest still run:

- `wheels`: every line of `benchmarks/gpu_wheels.txt` is `name==version`, and each listed
  package importable here has that version (in the venv: what Kiln is tested with; on the
  device: the carried wheel shadows the machine's own).
- `matmul`: the device's bf16 matmul rate, the ceiling for MFU (`benchmarks/gpu_check_unet.py`).
- `train`: the tiny preset's three stages through `accelerate launch -m models.train` in bf16
  on MDS shards written here; an exact-resume comparison after a SIGKILL; the third stage
  compiled; the exports (`benchmarks/gpu_check_train.py`). `fsdp`: the first stage under
  `configs/accelerate/fsdp.yaml`. `study`: an evaluation study of the last export.
- `unet`: the SD2-base UNet at real size (random weights) at 256 and 512 px: img/s, MFU against
  the measured matmul rate, peak memory, DDP against FSDP SHARD_GRAD_OP, eager against
  torch.compile, channels_last, the attention kernel. `loader`: Kiln's loader at 256 px on
  every core, against the UNet's img/s.

The time boxes are sized from the check's first run on an H100: a launch there spends about
28 s starting (imports; 6 s on a CPU dev machine) before its first step, and compiling takes
minutes. All steps together need more than one device call's 10 minutes, hence the halves.
`--box STEP=SECONDS` sets another box, `--unet-variants` picks the UNet variants.

Writes `gpu_check.json` and `gpu_check.log` (the end of each failed step's output) under
`--out`, and prints a one-screen table last. Without CUDA, or with `--dry-run`, every step runs
at toy size on the CPU (tiny UNet, a few steps), with only the device machine's packages and
the carried wheels importable (`gpu_check_site/`); tests/test_gpu_check.py runs that path.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WHEELS = HERE / "gpu_wheels.txt"
# MosaicML's SD2-base training rate at 256 px on one A100, and the MFU Kiln aims for.
MOSAIC_A100_IMG_PER_S = 137.5
MFU_TARGET = 0.45
# (step, script, time box on a GPU in seconds): train, fsdp and study 435 s together,
# matmul, unet and loader 365 s.
STEPS = [
    ("matmul", "gpu_check_unet.py", 20),
    ("train", "gpu_check_train.py", 330),
    ("fsdp", "gpu_check_train.py", 60),
    ("study", "gpu_check_train.py", 45),
    ("unet", "gpu_check_unet.py", 300),
    ("loader", "gpu_check_unet.py", 45),
]
# On a CPU the boxes only catch hangs: a shared 2-core machine can take minutes per step.
TOY_BOX_S = 420
# UNet variants (resolution:wrapper:layout[:compile]), the compiled one last: it is the
# one most likely to run out of its time box. On the CPU, compile's aot_eager backend fails on
# channels_last ("view size is not compatible with input tensor's size and stride"), so the
# toy run compiles the plain layout; the GPU compiles with Inductor.
UNET_VARIANTS = {
    False: ["256:ddp:plain", "256:ddp:cl", "256:fsdp:cl", "512:ddp:cl", "256:ddp:cl:compile"],
    True: ["256:ddp:plain", "256:ddp:cl", "256:fsdp:cl", "512:ddp:cl", "256:ddp:plain:compile"],
}
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9][A-Za-z0-9.+!_-]*)$")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def check_wheels(path: Path = WHEELS) -> dict:
    """Parse the wheel list and compare each pin with the version importable here.

    Returns:
        `pins` (name -> version), `errors` (a malformed or repeated line, named by its line
        number and text) and `mismatches` (a package importable here at another version);
        a package not installed here is listed in `not_installed`.
    """
    pins, errors, mismatches, missing = {}, [], [], []
    for i, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _PIN.match(line)
        if m is None:
            errors.append(f"{path.name} line {i}: expected name==version, got {raw.strip()!r}")
            continue
        name, version = m.groups()
        if _norm(name) in {_norm(n) for n in pins}:
            errors.append(f"{path.name} line {i}: {name} is listed twice")
            continue
        pins[name] = version
        try:
            installed = md.version(name)
        except md.PackageNotFoundError:
            missing.append(name)
            continue
        if installed != version:
            mismatches.append(f"{name}: pinned {version}, installed {installed}")
    return {"pins": pins, "errors": errors, "mismatches": mismatches, "not_installed": missing}


def _step_cmd(name: str, script: str, work: Path, result: Path, toy: bool, done: dict) -> list:
    cmd = [sys.executable, str(HERE / script), name, "--result", str(result), "--work", str(work)]
    if toy:
        cmd.append("--toy")
    if name == "unet":
        cmd += ["--variants", ",".join(done.get("unet_variants") or UNET_VARIANTS[toy])]
    if name == "study":
        export = done.get("train", {}).get("export")
        if export is None:
            raise RuntimeError("no export to generate from: the train step did not finish")
        cmd += ["--export", export]
    return cmd


def _run_boxed(cmd: list, env: dict, box_s: float) -> tuple[int | None, str]:
    """Run `cmd` in its own process group; at `box_s` seconds kill the whole group (the
    step's `accelerate launch` and its training process too). Returns (exit code, or None
    when stopped, and the output)."""
    with subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    ) as proc:
        try:
            output, _ = proc.communicate(timeout=box_s)
            return proc.returncode, output
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            return None, output


def _site(toy: bool) -> tuple[str, ...]:
    """The toy run's steps import as on the device: `gpu_check_site/sitecustomize.py` hides
    every distribution neither there nor carried."""
    return (str(HERE / "gpu_check_site"),) if toy else ()


def run_step(name: str, script: str, box_s: float, work: Path, toy: bool, done: dict, log) -> dict:
    """Run one step's process within `box_s` seconds; its result, or its error text."""
    result = work / f"{name}.result"
    result.unlink(missing_ok=True)
    t = time.perf_counter()
    try:
        cmd = _step_cmd(name, script, work, result, toy, done)
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(
                p for p in (*_site(toy), str(REPO), os.environ.get("PYTHONPATH")) if p
            ),
        )
        rc, output = _run_boxed(cmd, env, box_s)
        status = "ok" if rc == 0 else "failed"
        error = None if rc == 0 else output.strip()[-1500:]
        if rc is None:
            error = f"stopped at its {box_s:.0f} s time box"
    except Exception as e:  # noqa: BLE001 - recorded, and the other steps still run
        status, error, output = "failed", f"{type(e).__name__}: {e}", ""
    out = {"status": status, "seconds": round(time.perf_counter() - t, 1)}
    if result.is_file():  # a step cut off by its box keeps what it finished
        text = result.read_text()
        try:
            out |= (
                {"variants": [json.loads(x) for x in text.splitlines() if x.strip()]}
                if name == "unet"
                else json.loads(text)
            )
        except json.JSONDecodeError as e:  # a unet line cut off mid-write by the box
            status = out["status"] = "failed"
            error = f"{error or 'exited 0'}; its result file is cut off ({e})"
    failed_variants = [v["variant"] for v in out.get("variants", []) if "error" in v]
    if failed_variants and status == "ok":
        status, out["status"] = "failed", "failed"
        error = f"variants failed: {', '.join(failed_variants)}"
        output = "\n".join(v["error"] for v in out["variants"] if "error" in v)
    if error:
        out["error"] = error
        log.write(f"== {name}: {status}\n{output[-6000:]}\n")
        own = work / f"{name}.log"  # the step's launches write here (gpu_check_train.py)
        if own.is_file():
            log.write(f"== {name}: the end of {own.name}\n{own.read_text()[-6000:]}\n")
    if out.get("skipped"):
        out["status"] = "skipped"
    return out


def summarize(steps: dict, toy: bool) -> dict:
    """MFU of each UNet variant against the measured matmul rate, and whether the loader
    keeps up with the fastest variant at 256 px."""
    rate = steps.get("matmul", {}).get("tflops")
    best = None
    for v in steps.get("unet", {}).get("variants", []):
        if "error" in v:
            continue
        v["tflops"] = float(f"{v['img_per_s'] * v['flops_per_sample'] / 1e12:.4g}")
        v["mfu"] = float(f"{v['tflops'] / rate:.4g}") if rate else None
        if v["preset_resolution"] == 256 and (best is None or v["img_per_s"] > best["img_per_s"]):
            best = v
    out = {"mfu_target": MFU_TARGET, "mosaic_a100_img_per_s_256": MOSAIC_A100_IMG_PER_S, "toy": toy}
    if best is not None:
        out |= {
            "best_256": {
                k: best[k] for k in ("wrapper", "channels_last", "compile", "img_per_s", "mfu")
            },
            "meets_mfu_target": bool(best["mfu"] and best["mfu"] >= MFU_TARGET),
        }
    sps = steps.get("loader", {}).get("samples_per_s")
    if best is not None and sps:
        out["loader_over_unet_256"] = round(sps / best["img_per_s"], 2)
        out["loader_keeps_up"] = sps >= best["img_per_s"]
    return out


def environment() -> dict:
    versions = {}
    for name in (
        "torch",
        "accelerate",
        "transformers",
        "huggingface-hub",
        "diffusers",
        "mosaicml-streaming",
        "numpy",
        "pydantic",
        "mlflow-skinny",
    ):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "versions": versions,
    }


def _cuda_device() -> str | None:
    code = "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return proc.stdout.strip() or None


def table(report: dict) -> str:
    """The one-screen summary printed last."""
    s, rows = report["steps"], []
    rows.append(
        f"GPU check on {report['device'] or 'CPU (toy sizes)'}; {report['seconds']:.0f} s in all"
    )
    for name, st in s.items():
        note = st.get("error", st.get("skipped", "")).splitlines()
        rows.append(
            f"  {name:<8} {st['status']:<8} {st.get('seconds', 0):>6.1f} s  "
            f"{(note[-1] if note else '')[:60]}"
        )
    if "tflops" in s.get("matmul", {}):
        rows.append(f"matmul bf16: {s['matmul']['tflops']} TFLOP/s")
    tr = s.get("train", {})
    if "resume" in tr:
        r = tr["resume"]
        rows.append(
            f"resume after SIGKILL at step {r['kill_after_step']}: batches "
            f"{'same' if r['same_batches'] else 'DIFFER'}, losses "
            f"{'same' if r['same_losses'] else 'differ'} (max rel "
            f"{r['max_loss_rel_diff']:.2g}), weights "
            f"{'same' if r['same_weights'] else 'differ'}"
        )
    for key in ("stage1", "stage2"):
        if key in tr:
            st = tr[key]
            rows.append(
                f"{key}: {st['final_step']} steps, loss {st['last_loss']:.4g}, "
                f"{st['samples_per_s'] or 0:.1f} img/s, compile {st['compile']}"
            )
    if s.get("study", {}).get("images"):
        rows.append(f"study: {s['study']['images']} images in {s['study']['generated_s']} s")
    rows.append("UNet  res wrap cl  compile  img/s   MFU    peak GB  attention")
    for v in s.get("unet", {}).get("variants", []):
        if "error" in v:
            rows.append(f"      {v['variant']}: {v['error'].splitlines()[0][:60]}")
            continue
        kern = ",".join(
            k.replace("aten::_scaled_dot_product_", "")
            for k in v["attention_kernels"]
            if k.startswith("aten::_")
        )
        rows.append(
            f"      {v['resolution']:<4}{v['wrapper']:<5}{v['channels_last']!s:<6}"
            f"{v['compile']!s:<7}{v['img_per_s']:>7.1f} {v['mfu'] or 0:>6.1%} "
            f"{v['peak_mem_gb'] or 0:>8.1f}  {kern}"
        )
    sm = report["summary"]
    if "loader_over_unet_256" in sm:
        rows.append(
            f"loader 256 px: {s['loader']['samples_per_s']} samples/s on "
            f"{s['loader']['workers']} workers = {sm['loader_over_unet_256']}x the "
            f"UNet's best img/s (keeps up: {sm['loader_keeps_up']})"
        )
    if "best_256" in sm:
        rows.append(
            f"best 256 px MFU {sm['best_256']['mfu'] or 0:.1%} (target "
            f"{MFU_TARGET:.0%}; MosaicML A100: {MOSAIC_A100_IMG_PER_S} img/s)"
        )
    return "\n".join(rows)


def _boxes(items: list[str], p: argparse.ArgumentParser) -> dict[str, float]:
    """`--box STEP=SECONDS` options as {step: seconds}; a clear error for a bad one."""
    names, out = {n for n, _, _ in STEPS}, {}
    for item in items:
        name, _, secs = item.partition("=")
        try:
            value = float(secs)
        except ValueError:
            value = -1.0
        if name not in names or not 0 < value < math.inf:
            p.error(
                f"--box {item!r}: expected STEP=SECONDS with STEP one of {sorted(names)} "
                "and SECONDS above 0"
            )
        out[name] = value
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out",
        default=os.environ.get("OUT") or str(REPO / "benchmarks" / "results"),
        help="Folder for gpu_check.json and gpu_check.log (default: $OUT)",
    )
    p.add_argument("--work", default="/tmp/kiln-gpu-check", help="Scratch folder")
    p.add_argument("--dry-run", action="store_true", help="Toy sizes on the CPU")
    p.add_argument(
        "--only",
        default="",
        help="Comma-separated steps to run (a rerun of the "
        "failed ones); study needs train in the same run",
    )
    p.add_argument(
        "--box",
        action="append",
        default=[],
        metavar="STEP=SECONDS",
        help="Another time box for a step, e.g. --box train=400",
    )
    p.add_argument(
        "--unet-variants",
        default="",
        help="The unet step's variants instead of "
        "the default list, e.g. 256:fsdp:cl,256:ddp:cl:compile",
    )
    a = p.parse_args(argv)
    boxes = _boxes(a.box, p)
    t0 = time.perf_counter()
    device = None if a.dry_run else _cuda_device()
    toy = device is None
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    wheels = check_wheels()
    steps = {
        "wheels": {
            "status": "ok" if not (wheels["errors"] or wheels["mismatches"]) else "failed",
            **wheels,
        }
    }
    with open(out / "gpu_check.log", "w") as log:
        only = set(filter(None, a.only.split(",")))
        if only - {n for n, _, _ in STEPS}:
            p.error(f"--only: unknown steps {sorted(only - {n for n, _, _ in STEPS})}")
        done = {"unet_variants": [v for v in a.unet_variants.split(",") if v]}
        for name, script, box in STEPS:
            if only and name not in only:
                continue
            box = boxes.get(name, TOY_BOX_S if toy else box)
            steps[name] = done[name] = run_step(name, script, box, work, toy, done, log)
            print(f"{name}: {steps[name]['status']} ({steps[name]['seconds']} s)", flush=True)
    report = {
        "benchmark": "gpu_check",
        "device": device,
        "environment": environment(),
        "simulated_device_imports": toy,
        "steps": steps,
        "summary": summarize(steps, toy),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    return 0 if all(s["status"] != "failed" for s in steps.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
