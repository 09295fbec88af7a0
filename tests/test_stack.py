"""A team's stack (`kiln stack`) as its three users meet it.

The stack runs as a real process: PostgreSQL (Debian's, password authentication on loopback),
moto's S3 server, the Prefect server on PostgreSQL with an auth string and a process worker,
the MLflow tracking server on PostgreSQL with basic-auth and its artifacts proxied to S3, and
the rating app on PostgreSQL. The pipeline is deployed with `prefect deploy` and run by the
worker from S3; a consumer with only the tracking URL and a read-only login loads the model;
`kiln promote` is refused to that login and works for the team's; no secret shows in any log,
the MLflow run, the Prefect run or `ps`. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml

from deployments.stack import read_env_file

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(what: str, check, timeout: float, procs=()):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{p.args[:3]} exited ({p.returncode}) waiting for {what}")
        got = check()
        if got:
            return got
        time.sleep(1)  # a poll interval of a bounded wait
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def _clean_env() -> dict[str, str]:
    """This process's environment without any Prefect, MLflow or AWS setting: each command
    gets only what a user of the stack would export."""
    drop = ("PREFECT_", "MLFLOW_", "AWS_", "KILN_")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


@pytest.fixture(scope="module")
def stack():
    """`kiln stack` in a folder the `postgres` user can reach (the server runs as that user
    when the tests run as root); stopped with SIGTERM, which must stop every service."""
    base = Path(tempfile.mkdtemp(prefix="kiln-stack-"))
    os.chmod(base, 0o711)
    folder = base / "stack"
    ports = {n: _free_port() for n in ("postgres", "s3", "prefect", "mlflow", "ratings")}
    args = [a for n, p in ports.items() for a in (f"--{n}-port", str(p))]
    out = open(base / "stack.out", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [str(BIN / "kiln"), "stack", "--dir", str(folder), *args],
        env=_clean_env(),
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    said = lambda: (base / "stack.out").read_text()  # noqa: E731
    try:
        _wait("kiln stack to come up", lambda: "kiln stack is up" in said(), 300, [proc])
        yield {
            "dir": folder,
            "team": read_env_file(folder / "team.env"),
            "viewer": read_env_file(folder / "viewer.env"),
            "secrets": read_env_file(folder / "secrets.env"),
            "out": said,
            "proc": proc,
        }
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = None
        out.close()
        left = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        shutil.rmtree(base, ignore_errors=True)
        assert rc == 0, f"kiln stack exited {rc} on SIGTERM:\n{said()[-3000:]}"
        assert str(folder) not in left, "a service outlived the stack"


def _prefect(team: dict, home: Path, *args: str, timeout: float = 120) -> str:
    env = _clean_env() | team | {"PREFECT_HOME": str(home)}
    p = subprocess.run(
        [str(BIN / "prefect"), *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert p.returncode == 0, f"prefect {' '.join(args)}:\n{p.stdout}\n{p.stderr}"
    return p.stdout


def _api(team: dict):
    user, _, password = team["PREFECT_API_AUTH_STRING"].partition(":")
    return httpx.Client(base_url=team["PREFECT_API_URL"], auth=(user, password), timeout=10)


def _kiln(env: dict, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "kiln"), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=300
    )


CONSUMER = """
import io, json, mlflow, pandas as pd
from PIL import Image
model = mlflow.pyfunc.load_model("models:/kiln-t2i@candidate")
df = model.predict(pd.DataFrame({"prompt": ["a red circle above a blue square"]}),
                   params={"num_inference_steps": 2, "batch_size": 1})
print(json.dumps({"size": Image.open(io.BytesIO(df["image"][0])).size}))
"""


def test_a_team_runs_trains_and_consumes_through_the_stack(stack, tmp_path, demo_src, monkeypatch):
    import boto3
    import mlflow
    from mlflow import MlflowClient

    team, secrets = stack["team"], stack["secrets"]
    # Who refuses what: the Prefect server without its auth string, MLflow without a login.
    anon = httpx.post(f"{team['PREFECT_API_URL']}/flow_runs/filter", json={}, timeout=10)
    assert anon.status_code == 401
    anon = httpx.get(f"{team['MLFLOW_TRACKING_URI']}/api/2.0/mlflow/experiments/search", timeout=10)
    assert anon.status_code == 401

    # The images land in the team's bucket.
    s3 = boto3.client(
        "s3",
        endpoint_url=team["KILN_S3_ENDPOINT_URL"],
        aws_access_key_id=team["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=team["AWS_SECRET_ACCESS_KEY"],
        region_name="us-east-1",
    )
    for p in sorted(demo_src.rglob("*")):
        if p.is_file():
            s3.upload_file(str(p), "kiln", f"images/{p.relative_to(demo_src).as_posix()}")

    # The team's config: the shipped one, with the test's small stages.
    cfg = tmp_path / "team-small.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "base": str(REPO / "configs" / "team.yaml"),
                "train": {
                    "stages": [
                        {"resolution": 32, "batch_size": 4, "learning_rate": 1e-3, "max_steps": 2}
                    ]
                },
                "launch": {"health_check": False, "max_restarts": 0},
                "evaluate": {"limit": 2, "num_inference_steps": 1, "batch_size": 2, "seeds": [0]},
            }
        )
    )
    spec = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    (dep,) = [d for d in spec["deployments"] if d["name"] == "team-pipeline"]
    dep["parameters"]["config"] = str(cfg)
    spec["deployments"] = [dep]
    pfile = tmp_path / "prefect.yaml"
    pfile.write_text(yaml.safe_dump(spec, sort_keys=False))
    home = tmp_path / "prefect-home"
    _prefect(team, home, "--no-prompt", "deploy", "--prefect-file", str(pfile), "--all")

    # The UI's Quick run: the worker runs it.
    out = _prefect(team, home, "deployment", "run", "kiln-pipeline/team-pipeline")
    run_id = out.split("/runs/flow-run/")[1].split()[0]
    procs_seen = []

    def finished():
        procs_seen.append(
            subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        )
        with _api(team) as api:
            run = api.get(f"/flow_runs/{run_id}").json()
        return run if run["state_type"] in FINAL else None

    worker_log = stack["dir"] / "logs" / "prefect-worker.log"
    run = _wait("the pipeline run by the worker", finished, 600, [stack["proc"]])
    assert run["state_type"] == "COMPLETED", worker_log.read_text()[-5000:]

    # Registered through the authenticated server; the files went to the bucket.
    for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(k, team[k])
    client = MlflowClient(team["MLFLOW_TRACKING_URI"])
    version = client.get_model_version_by_alias("kiln-t2i", "candidate")
    mlrun = client.get_run(version.run_id)
    files = Path(
        mlflow.artifacts.download_artifacts(
            run_id=version.run_id,
            dst_path=str(tmp_path / "artifacts"),
            tracking_uri=team["MLFLOW_TRACKING_URI"],
        )
    )
    artifacts = b"".join(p.read_bytes() for p in files.rglob("*") if p.is_file())
    listed = s3.list_objects_v2(Bucket="kiln", Prefix="mlflow/")
    assert listed.get("KeyCount", 0) > 0, "the artifacts are in the object store"

    # A consumer elsewhere with the URL and a read-only login, nothing else.
    consumer = tmp_path / "consumer"
    consumer.mkdir()
    bare = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
    got = subprocess.run(
        [sys.executable, "-c", CONSUMER],
        env=bare | stack["viewer"],
        cwd=consumer,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert got.returncode == 0, got.stderr[-3000:]
    assert json.loads(got.stdout.strip().splitlines()[-1])["size"] == [32, 32]

    # Promotion: refused to the viewer's read-only login, done with the team's.
    viewer_env = _clean_env() | team | stack["viewer"]
    refused = _kiln(viewer_env, "promote", "--config", str(cfg), "--first")
    assert refused.returncode != 0
    assert "PERMISSION_DENIED" in refused.stderr or "permission" in refused.stderr.lower()
    team_env = _clean_env() | team
    done = _kiln(team_env, "promote", "--config", str(cfg), "--first")
    assert done.returncode == 0, done.stderr[-3000:]

    # The rating app stores in PostgreSQL: its admin link, made from the team's config.
    link = _kiln(
        team_env,
        "rate",
        "admin-link",
        "--config",
        str(cfg),
        "--port",
        team_port(stack),
    )
    assert link.returncode == 0, link.stderr
    assert httpx.get(link.stdout.strip(), timeout=10).status_code == 200

    # No secret anywhere a user or a log reader sees.
    shown = [
        stack["out"](),
        *[p.read_text(errors="replace") for p in (stack["dir"] / "logs").glob("*.log")],
        *procs_seen,
        json.dumps(mlrun.data.params),
        json.dumps(mlrun.data.tags),
        json.dumps(version.tags),
        json.dumps(run["parameters"]),
        refused.stderr,
        done.stderr + done.stdout,
    ]
    for name, value in secrets.items():
        if name.endswith(("PASSWORD", "SECRET_KEY", "SECRET_ACCESS_KEY")):
            leaks = [i for i, text in enumerate(shown) if value in text]
            assert not leaks, f"{name} shows in {leaks}"
            assert value.encode() not in artifacts, f"{name} shows in the run's artifacts"


def team_port(stack) -> str:
    return stack["out"]().split("Rating app    http://127.0.0.1:")[1].split()[0]
