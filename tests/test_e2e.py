"""`kiln run` on the demo set, then checks from a consumer's side, each in a fresh process."""

import csv
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import yaml

from kiln_config import load_config
from tests.servers import model_server

pytestmark = pytest.mark.e2e


def _py(code: str, env: dict, cwd: Path | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


# Distinctive fake secrets in the pipeline's environment: none may appear in any output.
SECRETS = {
    "AWS_ACCESS_KEY_ID": "AKIAKILNFAKE7QX2ZT9W",
    "AWS_SECRET_ACCESS_KEY": "kiln-fake-aws-secret-Xyzzy-31415926",
    "MLFLOW_TRACKING_TOKEN": "kiln-fake-mlflow-token-Plugh-27182818",
    "KILN_TEST_SERVICE_TOKEN": "kiln-fake-service-token-Zork-1414213",
    "HF_TOKEN": "hf_kilnFakeHubToken0Frobozz1618033",
}


# `kiln run` in a fresh interpreter with counting wrappers around the config's loading and
# input checks, installed before any flow module imports them.
COUNT_PARSES = """
import collections, json, sys

import kiln_config as kc
import tasks.inputs as ti

counts = collections.Counter()
validate = kc.PipelineConfig.model_validate.__func__


def counted_validate(cls, *args, **kwargs):
    counts["parse"] += 1
    return validate(cls, *args, **kwargs)


kc.PipelineConfig.model_validate = classmethod(counted_validate)
check_inputs = ti.check_inputs


def counted_check(*args, **kwargs):
    counts["check_inputs"] += 1
    return check_inputs(*args, **kwargs)


ti.check_inputs = counted_check
from kiln_cli.main import main

if __name__ == "__main__":  # ingest's worker processes import this file too
    try:
        main(sys.argv[2:], standalone_mode=False)
    finally:
        open(sys.argv[1], "w").write(json.dumps(counts))
"""


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory, demo_src, make_config, s3_endpoint, slurm):
    """`kiln run` of the demo set from an S3 bucket (moto's server on 127.0.0.1), as a
    subprocess whose environment holds fake credentials and tokens, training on the test's
    two-node SLURM cluster: stage 1 on one node, the next two on two (`launch.backend:
    slurm`; every other check here is of outputs a local run has too)."""
    import boto3

    base = tmp_path_factory.mktemp("e2e")
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    s3.create_bucket(Bucket="kiln-e2e")
    for p in sorted(demo_src.rglob("*")):
        if p.is_file():
            s3.upload_file(str(p), "kiln-e2e", f"raw/{p.relative_to(demo_src).as_posix()}")
    overrides = {
        "evaluate.seeds": [0, 1],
        "storage.endpoint_url": s3_endpoint,
        "launch.backend": "slurm",
        "launch.slurm": {"poll_s": 0.5},
    }
    cfg = make_config(base / "tiny.yaml", base / "root", "s3://kiln-e2e/raw", **overrides)
    data = yaml.safe_load(cfg.read_text())
    for stage, nodes in zip(data["train"]["stages"], (1, 2, 2), strict=True):
        stage["num_machines"] = nodes
    cfg.write_text(yaml.safe_dump(data, sort_keys=False))
    # No PREFECT_API_URL: the CLI runs against Prefect's local embedded server, as `make demo`.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["PREFECT_HOME"] = str(base / "prefect-home")
    env |= {"SLURM_CONF": str(slurm.conf), "GLOO_SOCKET_IFNAME": "lo"}
    (base / "count_parses.py").write_text(COUNT_PARSES)
    proc = subprocess.run(
        [
            sys.executable,
            str(base / "count_parses.py"),
            str(base / "counts.json"),
            "run",
            "--config",
            str(cfg),
        ],
        capture_output=True,
        text=True,
        env={**env, **SECRETS},
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    (base / "run.stdout").write_text(proc.stdout)
    (base / "run.stderr").write_text(proc.stderr)
    out = proc.stdout
    result = json.loads(out[: out.index("\nKiln pipeline finished")])
    return base / "root", result, env, out


def test_training_ran_on_slurm_from_one_node_to_two(pipeline_run, slurm):
    """The pre-flight all-reduce spans both nodes; each stage is one SLURM job on its own
    node count, starting from the previous stage's export; no job is left behind."""
    root, result, _, _ = pipeline_run
    run_dir = root / "runs" / result["run"]["run_id"]
    run = json.loads((run_dir / "run.json").read_text())
    assert run["health"]["world_size"] == 2
    assert {r: m["num_processes"] for r, m in run["stages"].items()} == {"32": 1, "48": 2, "64": 2}
    for res, nodes in (("32", 1), ("48", 2), ("64", 2)):
        log = (run_dir / f"stage-{res}" / f"slurm-stage-{res}px.log").read_text()
        assert f"node {nodes - 1} of {nodes}" in log and f"node {nodes} of" not in log
    assert slurm.jobs() == []


def test_no_secret_reaches_any_output(pipeline_run):
    """Every file the run wrote (root, MLflow database and artifacts, Prefect's database and
    logs, the run's stdout/stderr), read as bytes, holds none of the secrets."""
    root, _, _, _ = pipeline_run
    base = root.parent
    files = [p for p in base.rglob("*") if p.is_file()]
    assert any(p.name == "mlflow.db" for p in files) and any(
        p.suffix == ".db" and "prefect-home" in str(p) for p in files
    ), "the MLflow and Prefect databases are among the files searched"
    leaks = []
    for p in files:
        data = p.read_bytes()
        leaks += [f"{name} in {p}" for name, v in SECRETS.items() if v.encode() in data]
    assert not leaks, leaks


def test_the_run_loaded_its_config_once_and_checked_its_inputs_once(pipeline_run):
    root, _, _, _ = pipeline_run
    counts = json.loads((root.parent / "counts.json").read_text())
    assert counts == {"parse": 1, "check_inputs": 1}
    snapshots = list(root.rglob("config.yaml"))
    assert len(snapshots) == 1 and snapshots[0].parent.parent.name == "runs", snapshots
    assert not (root / "configs").exists(), "one snapshot: the run's"


def test_pipeline_result_and_quality_gate(pipeline_run):
    root, result, _, out = pipeline_run
    assert "kiln mlflow-ui" in out and "127.0.0.1:4200" in out
    ing, q = result["ingest"], result["quality"]
    assert ing["listed"] == 60 and ing["accepted"] + ing["quarantined"] == 60
    assert q["clean"] + q["rejected_ingest"] + q["rejected_validate"] == 60
    quarantine = pd.read_parquet(root / "quality" / ing["ingest_id"] / "quarantine.parquet")
    assert (root / "quality" / ing["ingest_id"] / "index.html").is_file(), "Data Docs built"
    reasons = dict(zip(quarantine["key"], quarantine["reason"], strict=True))
    assert {
        k: reasons[k]
        for k in (
            "bad-truncated.jpg",
            "bad-empty.jpg",
            "bad-text.jpg",
            "bad-no-caption.jpg",
            "bad-duplicate.jpg",
        )
    } == {
        "bad-truncated.jpg": "decode_error",
        "bad-empty.jpg": "empty_file",
        "bad-text.jpg": "not_an_image",
        "bad-no-caption.jpg": "caption_blank",
        "bad-duplicate.jpg": "duplicate_sha256",
    }
    run = json.loads((root / "runs" / result["run"]["run_id"] / "run.json").read_text())
    assert list(run["stages"]) == ["32", "48", "64"]
    for res, m in run["stages"].items():
        assert m["final_step"] == {"32": 12, "48": 8, "64": 8}[res]
    assert result["model"]["lineage"]["dataset_version"] == result["shards"]["dataset_version"]


def test_registry_alias_loads_and_generates(pipeline_run, tmp_path):
    """Loaded by a consumer whose own `models` package comes first on sys.path: the model
    ships only `kiln_pyfunc`, so neither shadows the other."""
    root, result, env, _ = pipeline_run
    consumer = tmp_path / "consumer"
    (consumer / "models").mkdir(parents=True)
    (consumer / "models" / "__init__.py").write_text("OWNER = 'consumer'\n")
    env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    out = _py(
        f"""
        import io, json, mlflow, pandas as pd
        import models
        from mlflow import MlflowClient
        from PIL import Image
        uri = "sqlite:///{root / "mlflow.db"}"
        mlflow.set_tracking_uri(uri)
        model = mlflow.pyfunc.load_model("models:/kiln-t2i@candidate")
        prompts = ["a red circle above a blue square"] * 4 + ["a green triangle"]
        df = model.predict(pd.DataFrame({{"prompt": prompts}}),
                           params={{"num_inference_steps": 2, "batch_size": 2}})
        one = model.predict(pd.DataFrame({{"prompt": prompts[:1]}}),
                            params={{"num_inference_steps": 2, "batch_size": 1}})
        img = Image.open(io.BytesIO(df["image"][0]))
        import numpy as np
        px = lambda b: np.asarray(Image.open(io.BytesIO(b)), dtype=np.float32)
        import kiln_pyfunc
        v = MlflowClient(uri).get_model_version_by_alias("kiln-t2i", "candidate")
        defaults = {{p.name: p.default for p in model.metadata.signature.params}}
        print(json.dumps({{"size": img.size, "tags": v.tags, "rows": len(df), "defaults": defaults,
                          "diff": float(np.abs(px(df["image"][0]) - px(one["image"][0])).max()),
                          "owner": models.OWNER,
                          "shipped": kiln_pyfunc.__file__}}))
        """,
        env,
        cwd=consumer,  # the consumer's project: its `models` package is first on sys.path
    )
    got = json.loads(out.strip().splitlines()[-1])
    assert got["size"] == [64, 64] and got["rows"] == 5
    ev = load_config(root / "runs" / result["run"]["run_id"] / "config.yaml").evaluate
    assert (got["defaults"]["num_inference_steps"], got["defaults"]["guidance_scale"]) == (
        ev.num_inference_steps,
        ev.guidance_scale,
    ), "the steps and guidance it was evaluated with"
    # Its seed fixes an image; batching changes only float rounding in the batched kernels.
    assert got["diff"] <= 3, "an image depends on its seed, not on the batching"
    assert got["owner"] == "consumer", "the consumer's own `models` package is untouched"
    assert "/code/kiln_pyfunc.py" in got["shipped"], "loaded from the model's shipped code"
    assert got["tags"]["run_id"] == result["run"]["run_id"]
    assert got["tags"]["study_id"] == result["study"]["study_id"]


def test_plain_streaming_dataset_reads_shards(pipeline_run):
    root, result, env, _ = pipeline_run
    shards = root / "shards" / result["shards"]["dataset_version"]
    out = _py(
        f"""
        import io
        from PIL import Image
        from streaming import StreamingDataset
        for res in (32, 48, 64):
            ds = StreamingDataset(local="{shards}/" + str(res), batch_size=1)
            s = ds[0]
            assert Image.open(io.BytesIO(s["image"])).size == (res, res)
            assert all(ds[i]["caption"].strip() for i in range(len(ds)))
            print(res, len(ds))
        """,
        env,
    )
    counts = dict(line.split() for line in out.strip().splitlines())
    assert int(counts["32"]) == result["shards"]["stages"]["32"]["samples"] > 0


def test_export_loads_with_diffusers(pipeline_run):
    _, result, env, _ = pipeline_run
    out = _py(
        f"""
        import torch
        from diffusers import StableDiffusionPipeline
        pipe = StableDiffusionPipeline.from_pretrained("{result["run"]["export"]}")
        img = pipe("a green square", num_inference_steps=2,
                   generator=torch.Generator().manual_seed(0)).images[0]
        print(img.size)
        """,
        env,
    )
    assert out.strip().splitlines()[-1] == "(64, 64)"


def test_study_has_one_image_per_prompt_and_seed(pipeline_run, drawbench_csv):
    _, result, env, run_out = pipeline_run
    study_dir = Path(result["study"]["path"])
    # Named by the configured prompts file, which is not DrawBench.
    assert result["study"]["prompts"] == drawbench_csv.name
    assert f"images of the {drawbench_csv.name} prompts)" in run_out
    out = _py(
        f"""
        import csv, json
        from pathlib import Path
        from PIL import Image
        study = json.loads(Path("{study_dir}/study.json").read_text())
        prompts = list(csv.DictReader(open("{drawbench_csv}", newline="")))
        pairs = {{(it["prompt"], it["seed"]) for it in study["items"]}}
        assert len(study["items"]) == len(pairs) == 2 * len(prompts)
        for it in study["items"]:
            assert Image.open(Path("{study_dir}") / it["path"]).size == (64, 64)
        print(len(study["items"]), len({{it["category"] for it in study["items"]}}))
        """,
        env,
    )
    n, cats = map(int, out.split())
    with open(drawbench_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    assert n == 2 * len(rows) and cats == len({r["Category"] for r in rows})


def test_served_model_answers_a_rest_request_with_a_png(pipeline_run, tmp_path):
    """`mlflow models serve` of the registered alias, as the README shows, on loopback."""
    import base64
    import time

    import httpx
    from PIL import Image

    root, _, env, _ = pipeline_run
    env = {
        **env,
        "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",
        "MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT": "300",
    }
    with model_server(
        "models:/kiln-t2i@candidate", env, tmp_path / "serve.log", timeout=180
    ) as base:
        t0 = time.monotonic()
        r = httpx.post(
            f"{base}/invocations",
            json={
                "dataframe_split": {"columns": ["prompt"], "data": [["a red circle"]]},
                "params": {"num_inference_steps": 2, "seed": 0},
            },
            timeout=300,
        )
        latency = time.monotonic() - t0
        assert r.status_code == 200, r.text[:2000]
        row = r.json()["predictions"][0]
        assert row["prompt"] == "a red circle"
        # The reply base64-encodes bytes with a newline every 76 characters; b64decode skips them.
        img = Image.open(io.BytesIO(base64.b64decode(row["image"])))
        assert img.format == "PNG" and img.size == (row["width"], row["height"]) == (64, 64)
        print(f"served model: one prompt, 2 steps, {latency:.2f}s")
        # One client cannot take the GPU: a request past the limits is refused, and says why.
        for params, why in (
            ({"height": 4096}, "params.height must be in [0, 2048], got 4096"),
            ({"width": 100}, "params.width must be 0 (the model's own size) or a multiple of 8"),
            ({"num_inference_steps": 1000}, "params.num_inference_steps must be in [1, 200]"),
        ):
            r = httpx.post(
                f"{base}/invocations",
                json={
                    "dataframe_split": {"columns": ["prompt"], "data": [["x"]]},
                    "params": params,
                },
                timeout=60,
            )
            assert r.status_code == 400 and why in r.json()["message"], r.text[:2000]
        rows = [["x"]] * 65
        r = httpx.post(
            f"{base}/invocations",
            json={"dataframe_split": {"columns": ["prompt"], "data": rows}},
            timeout=60,
        )
        assert r.status_code == 400 and "1 to 64 prompts, got 65" in r.json()["message"]


def test_kiln_generate_writes_pngs_from_a_registered_alias(pipeline_run, tmp_path):
    """`kiln generate` from another root: the version is downloaded from the registry."""
    import yaml
    from PIL import Image

    root, _, env, _ = pipeline_run
    cfg = yaml.safe_load((root.parent / "tiny.yaml").read_text())
    cfg["registry"]["tracking_uri"] = f"sqlite:///{root / 'mlflow.db'}"
    cfg["storage"]["root"] = str(tmp_path / "consumer-root")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    kiln = [sys.executable, "-m", "kiln_cli", "generate", "--config", str(tmp_path / "c.yaml")]
    proc = subprocess.run(
        [
            *kiln,
            "--model",
            "models:/kiln-t2i@candidate",
            "--prompt",
            "a red circle",
            "--n",
            "3",
            "--seed",
            "5",
            "--steps",
            "2",
            "--out",
            str(tmp_path / "png"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    assert [Path(p).name for p in got["images"]] == ["00-s5.png", "01-s6.png", "02-s7.png"]
    assert all(Image.open(p).size == (64, 64) for p in got["images"])
    assert got["seconds_per_image"] > 0
    assert (tmp_path / "consumer-root" / "models" / "kiln-t2i-v1").is_dir(), "downloaded"
    print(f"kiln generate: {got['seconds_per_image']:.3f} s per image (2 steps, CPU)")
    bad = subprocess.run(
        [*kiln, "--model", "models:/kiln-t2i@nope", "--prompt", "x"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert bad.returncode == 1 and "kiln: error: models:/kiln-t2i@nope" in bad.stderr
