"""Latency of the ways a registered model is used: `kiln generate` and `mlflow models serve`.

The tiny preset's pipeline (its architecture; weights do not change the cost) is registered in
a temporary SQLite registry, then:

* `kiln generate --model models:/kiln-bench@candidate`: wall time of the command (process
  start, imports, download and load included) and its own `seconds_per_image`, for 1 and for
  `--n` images: the difference is the marginal cost of an image;
* `mlflow models serve` of the same alias on loopback: latency of one-prompt REST requests,
  against `predict` on the same model loaded in this process (the baseline, same run), so the
  serving overhead is the difference.

    python benchmarks/serving.py --out benchmarks/results/serving_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
BIN = Path(sys.executable).parent
PROMPT = "a red circle above a small blue square on a grey background"


def _register(root: Path) -> str:
    """A tiny export registered as kiln-bench@candidate; returns the tracking URI."""
    from diffusers import StableDiffusionPipeline
    from mlflow.tracking import MlflowClient

    from kiln_config import load_config
    from models.components.factory import build_components, sampling_scheduler
    from tasks.registry.tracking import ensure_experiment, register_model

    cfg = load_config(REPO / "configs" / "tiny.yaml")
    c = build_components(cfg.train.model, seed=0)
    export = root / "final"
    StableDiffusionPipeline(
        vae=c.vae,
        text_encoder=c.text_encoder,
        tokenizer=c.tokenizer,
        unet=c.unet,
        scheduler=sampling_scheduler(c.noise_scheduler),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    ).save_pretrained(export)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(ensure_experiment(client, "bench", str(root / "art"))).info.run_id
    client.set_terminated(run_id)
    register_model.fn(
        uri,
        run_id,
        str(export),
        "kiln-bench",
        "candidate",
        {"run_id": "bench"},
        evaluate=cfg.evaluate,
    )
    return uri


def _kiln_generate(cfg: Path, out: Path, n: int, steps: int) -> dict:
    t0 = time.perf_counter()
    p = subprocess.run(
        [
            str(BIN / "kiln"),
            "generate",
            "--config",
            str(cfg),
            "--model",
            "models:/kiln-bench@candidate",
            "--prompt",
            PROMPT,
            "--n",
            str(n),
            "--steps",
            str(steps),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    wall = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"kiln generate failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    own = json.loads((out / "generate.json").read_text())
    return {"n": n, "wall_s": round(wall, 3), "seconds_per_image": own["seconds_per_image"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _served(uri: str, steps: int, requests: int, log: Path) -> dict:
    import httpx

    port = _free_port()
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": uri,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    t0 = time.perf_counter()
    server = subprocess.Popen(
        [
            str(BIN / "mlflow"),
            "models",
            "serve",
            "-m",
            "models:/kiln-bench@candidate",
            "--env-manager",
            "local",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        env=env,
        stdout=open(log, "w"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if server.poll() is not None:
                raise SystemExit(f"mlflow models serve exited:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{base}/ping", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > 300:
                raise SystemExit("the scoring server did not come up in 300 s")
            time.sleep(0.5)
        startup = time.perf_counter() - t0
        body = {"dataframe_records": [{"prompt": PROMPT}], "params": {"num_inference_steps": steps}}
        times = []
        for _ in range(requests + 1):  # the first request warms up and is not counted
            t = time.perf_counter()
            r = httpx.post(f"{base}/invocations", json=body, timeout=300)
            r.raise_for_status()
            times.append(time.perf_counter() - t)
        median = round(statistics.median(times[1:]), 3)
        return {
            "startup_s": round(startup, 2),
            "first_request_s": round(times[0], 3),
            "median_s": median,
            "requests": requests,
        }
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def _in_process(uri: str, steps: int, requests: int) -> dict:
    import mlflow
    import pandas as pd

    mlflow.set_registry_uri(uri)
    mlflow.set_tracking_uri(uri)
    model = mlflow.pyfunc.load_model("models:/kiln-bench@candidate")
    frame = pd.DataFrame({"prompt": [PROMPT]})
    times = []
    for _ in range(requests + 1):
        t = time.perf_counter()
        model.predict(frame, params={"num_inference_steps": steps})
        times.append(time.perf_counter() - t)
    return {"median_s": round(statistics.median(times[1:]), 3), "requests": requests}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/serving_cpu.json")
    p.add_argument("--n", type=int, default=8, help="Images of the larger kiln generate call.")
    p.add_argument("--steps", type=int, default=25, help="Denoising steps (the pyfunc default).")
    p.add_argument("--requests", type=int, default=5, help="Timed REST/predict calls.")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-serving-") as d:
        root = Path(d)
        uri = _register(root)
        cfg = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
        cfg["storage"]["root"] = str(root)
        cfg_path = root / "tiny.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg))
        one = _kiln_generate(cfg_path, root / "gen-1", 1, args.steps)
        many = _kiln_generate(cfg_path, root / f"gen-{args.n}", args.n, args.steps)
        served = _served(uri, args.steps, args.requests, root / "serve.log")
        local = _in_process(uri, args.steps, args.requests)
    result = {
        "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version()},
        "steps": args.steps,
        "kiln_generate": {
            "one": one,
            "many": many,
            "marginal_s_per_image": round((many["wall_s"] - one["wall_s"]) / (args.n - 1), 3),
        },
        "served": served,
        "in_process_predict": local,
        "serving_overhead_s": round(served["median_s"] - local["median_s"], 3),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
