"""The real recipe's export through a team's tracking server, and back, bit for bit.

`kiln stack` runs in a temporary folder (PostgreSQL, moto's S3 server, MLflow with basic-auth
and its artifacts proxied to S3). An export at the real recipe's size is built from
configs/sd2-base.yaml with random seeded weights (the SD2 VAE and text tower of
models/sd2_components.py and the recipe's UNet; `--reduced`, the default: one layer per UNet
block and two text layers, as the reduced real-size run's). Kiln's own `register_model` logs
and registers it through the server with the `kiln` user's login (multipart through the
proxy, as `team.env` sets it); a consumer process with only the tracking URL and the
`viewer` login downloads `models:/kiln-t2i@candidate`; every file of the pipeline is compared
by SHA-256 with the export. Written: sizes, upload and download wall time, and the peak memory
of the client, the consumer and the MLflow server's processes.

    python benchmarks/registry_transfer.py --out benchmarks/results/registry_transfer.json
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

EXPORT = """
import sys, torch, yaml
from pathlib import Path
from diffusers import (AutoencoderKL, DDIMScheduler, StableDiffusionPipeline,
                       UNet2DConditionModel)
from transformers import CLIPTextModel
from models.sd2_components import write_sd2_components
from models.components.factory import build_tokenizer
from kiln_config import TokenizerConfig
out, reduced = Path(sys.argv[1]), sys.argv[2] == "1"
torch.manual_seed(0)
parts = write_sd2_components(out.parent / "sd2", text_layers=2 if reduced else 23)
model = yaml.safe_load(open(sys.argv[3]))["train"]["model"]
unet_cfg = dict(model["unet"], layers_per_block=1) if reduced else model["unet"]
pipe = StableDiffusionPipeline(
    vae=AutoencoderKL.from_pretrained(parts, subfolder="vae"),
    text_encoder=CLIPTextModel.from_pretrained(parts, subfolder="text_encoder"),
    tokenizer=build_tokenizer(TokenizerConfig(builtin="bytes", model_max_length=77)),
    unet=UNet2DConditionModel.from_config(unet_cfg),
    scheduler=DDIMScheduler(**model["noise_scheduler"]),
    safety_checker=None, feature_extractor=None, requires_safety_checker=False)
pipe.save_pretrained(out)
"""

REGISTER = """
import json, resource, sys, time
from mlflow import MlflowClient
from kiln_config import EvaluateConfig
from tasks.registry.tracking import ensure_experiment, register_model
uri, export = sys.argv[1], sys.argv[2]
client = MlflowClient(uri)
run = client.create_run(ensure_experiment(client, "kiln", None), run_name="transfer").info.run_id
client.set_terminated(run)
t = time.perf_counter()
got = register_model.fn(uri, run, export, "kiln-t2i", "candidate", {"run_id": run},
                        evaluate=EvaluateConfig())
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print(json.dumps({"upload_s": round(time.perf_counter() - t, 1), "version": got["version"],
                  "peak_rss_gib": round(peak, 2)}))
"""

CONSUMER = """
import json, resource, sys, time
import mlflow
t = time.perf_counter()
path = mlflow.artifacts.download_artifacts("models:/kiln-t2i@candidate", dst_path=sys.argv[1])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print(json.dumps({"download_s": round(time.perf_counter() - t, 1), "path": path,
                  "peak_rss_gib": round(peak, 2)}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env_file(path: Path) -> dict[str, str]:
    lines = [x for x in path.read_text().splitlines() if x and not x.startswith("#")]
    return dict(x.split("=", 1) for x in lines)


def _sha256(folder: Path) -> dict[str, str]:
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h = hashlib.sha256()
            with open(p, "rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
            out[p.relative_to(folder).as_posix()] = h.hexdigest()
    return out


def _run_json(cmd: list[str], env: dict, cwd: Path) -> dict:
    r = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{cmd[:3]} exited {r.returncode}: {r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


class PeakRss(threading.Thread):
    """The largest summed RSS of the processes `pick` selects, sampled every 0.5 s."""

    def __init__(self, pick):
        super().__init__(daemon=True)
        self.pick, self.peak, self.stop = pick, 0, threading.Event()

    def run(self):
        while not self.stop.wait(0.5):
            total = 0
            for p in self.pick():
                with contextlib.suppress(psutil.Error):  # gone since listed
                    total += p.memory_info().rss
            self.peak = max(self.peak, total)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="JSON output path")
    p.add_argument("--full", action="store_true", help="The full UNet and text tower")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kiln-transfer-"))
    os.chmod(work, 0o711)  # PostgreSQL runs as `postgres` under root
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))}
    clean["PYTHONPATH"] = str(REPO)
    res: dict = {"reduced": not args.full}
    stack = None
    try:
        export = work / "export"
        t = time.perf_counter()
        cfg = str(REPO / "configs" / "sd2-base.yaml")
        reduced = "0" if args.full else "1"
        subprocess.run(
            [sys.executable, "-c", EXPORT, str(export), reduced, cfg], env=clean, check=True
        )
        sums = _sha256(export)
        res["export"] = {
            "files": len(sums),
            "gib": round(
                sum(f.stat().st_size for f in export.rglob("*") if f.is_file()) / 2**30, 2
            ),
            "build_s": round(time.perf_counter() - t, 1),
        }
        names = ("postgres", "s3", "prefect", "mlflow", "ratings")
        ports = [a for n in names for a in (f"--{n}-port", str(_free_port()))]
        log = open(work / "stack.out", "w")  # noqa: SIM115
        stack = subprocess.Popen(
            [sys.executable, "-m", "deployments.stack", "--dir", str(work / "stack"), *ports],
            env=clean,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 300
        while "kiln stack is up" not in (work / "stack.out").read_text():
            if stack.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((work / "stack.out").read_text()[-3000:])
            time.sleep(1)
        team = _env_file(work / "stack" / "team.env")
        viewer = _env_file(work / "stack" / "viewer.env")

        def server_procs():
            procs = []
            for child in psutil.Process(stack.pid).children():
                if "mlflow" in " ".join(child.cmdline()):
                    procs += [child, *child.children(recursive=True)]
            return procs

        peak = PeakRss(server_procs)
        peak.start()
        up = _run_json(
            [sys.executable, "-c", REGISTER, team["MLFLOW_TRACKING_URI"], str(export)],
            clean | team,
            REPO,
        )
        consumer = work / "consumer"
        consumer.mkdir()
        bare = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
        down = _run_json(
            [sys.executable, "-c", CONSUMER, str(consumer / "model")], bare | viewer, consumer
        )
        peak.stop.set()
        peak.join()
        got = next(Path(down["path"]).rglob("model_index.json")).parent
        back = _sha256(got)
        res |= {
            "upload_s": up["upload_s"],
            "upload_mib_s": round(res["export"]["gib"] * 1024 / up["upload_s"], 1),
            "client_peak_rss_gib": up["peak_rss_gib"],
            "download_s": down["download_s"],
            "download_mib_s": round(res["export"]["gib"] * 1024 / down["download_s"], 1),
            "consumer_peak_rss_gib": down["peak_rss_gib"],
            "mlflow_server_peak_rss_gib": round(peak.peak / 2**30, 2),
            "bit_identical": back == sums,
            "files_compared": len(back),
            "multipart": team["MLFLOW_ENABLE_PROXY_MULTIPART_UPLOAD"],
        }
    finally:
        if stack is not None and stack.poll() is None:
            os.killpg(stack.pid, signal.SIGTERM)
            stack.wait(timeout=120)
        res["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count()}
        res["largest_child_gib"] = round(
            resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 2
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))
        shutil.rmtree(work, ignore_errors=True)
    sys.stdout.write(json.dumps(res, indent=1) + "\n")
    if not res.get("bit_identical"):
        raise SystemExit("the model did not come back bit-identical")


if __name__ == "__main__":
    main()
