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

import contextlib
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
import psutil
import pytest
import yaml

from deployments.stack import read_env_file
from human_eval.store import RatingStore
from tasks.storage.lock import root_busy
from tests.servers import BIN, free_port, model_server, prefect_client, wait_for

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent
FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")


def _cmd(p) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def _gone(p) -> bool:
    """Exited, or a zombie (dead, its reaper not yet come by): never a process that runs."""
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


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
    ports = {n: free_port() for n in ("postgres", "s3", "prefect", "mlflow", "ratings")}
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
    services: list = []
    try:
        wait_for("kiln stack to come up", lambda: "kiln stack is up" in said(), 300, [proc])
        yield {
            "dir": folder,
            "team": read_env_file(folder / "team.env"),
            "viewer": read_env_file(folder / "viewer.env"),
            "secrets": read_env_file(folder / "secrets.env"),
            "out": said,
            "proc": proc,
            "ports": ports,
        }
    finally:
        # Every service's process, PostgreSQL's included (its children run as `postgres`).
        services = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
        services += [p for p in psutil.process_iter() if str(folder) in " ".join(_cmd(p))]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            rc = None
        _, alive = psutil.wait_procs(services, timeout=30)
        for p in alive:  # a failed stop: nothing may outlive the test
            with contextlib.suppress(psutil.Error):
                p.kill()
        out.close()
        text = said()
        shutil.rmtree(base, ignore_errors=True)
        assert rc == 0, f"kiln stack exited {rc} on SIGTERM:\n{text[-3000:]}"
        assert not alive, f"services outlived the stack: {[_cmd(p)[:3] for p in alive]}"


def _prefect(team: dict, home: Path, *args: str, timeout: float = 120) -> str:
    env = _clean_env() | team | {"PREFECT_HOME": str(home)}
    p = subprocess.run(
        [str(BIN / "prefect"), *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert p.returncode == 0, f"prefect {' '.join(args)}:\n{p.stdout}\n{p.stderr}"
    return p.stdout


def _api(team: dict):
    return prefect_client(team["PREFECT_API_URL"], team["PREFECT_API_AUTH_STRING"])


def _kiln(env: dict, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "kiln"), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=300
    )


def _deploy(
    team: dict, tmp_path: Path, max_steps: int, entry: str = "pipeline", **extra
) -> tuple[Path, Path]:
    """`prefect deploy` of the shipped team-pipeline (or the same for another entry of
    flows/entry.py, as `team-<entry>`), given a config of the shipped team.yaml with the
    test's small stage. Returns (config, the CLI's PREFECT_HOME)."""
    cfg = tmp_path / f"team-{entry}.yaml"
    stage = {"resolution": 32, "batch_size": 4, "learning_rate": 1e-3, "max_steps": max_steps}
    data = {
        "base": str(REPO / "configs" / "team.yaml"),
        "train": {"stages": [stage], "model": FIT_FEW, **extra.pop("train", {})},
        "launch": {"health_check": False, "max_restarts": 0, **extra.pop("launch", {})},
        "evaluate": {"limit": 2, "num_inference_steps": 1, "batch_size": 2, "seeds": [0]},
    }
    cfg.write_text(yaml.safe_dump(data))
    spec = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    (dep,) = [d for d in spec["deployments"] if d["name"] == "team-pipeline"]
    dep["parameters"]["config"] = str(cfg)
    if entry != "pipeline":
        dep |= {"name": f"team-{entry}", "entrypoint": f"flows/entry.py:{entry}"}
    spec["deployments"] = [dep]
    pfile = tmp_path / "prefect.yaml"
    pfile.write_text(yaml.safe_dump(spec, sort_keys=False))
    home = tmp_path / "prefect-home"
    _prefect(team, home, "--no-prompt", "deploy", "--prefect-file", str(pfile), "--all")
    return cfg, home


def _upload(team: dict, folder: Path):
    """The images land in the team's bucket; returns the S3 client."""
    import boto3

    s3 = boto3.client(
        "s3",
        endpoint_url=team["KILN_S3_ENDPOINT_URL"],
        aws_access_key_id=team["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=team["AWS_SECRET_ACCESS_KEY"],
        region_name="us-east-1",
    )
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            s3.upload_file(str(p), "kiln", f"images/{p.relative_to(folder).as_posix()}")
    return s3


# The VAE fit in 30 steps, not the preset's 800 (as tests/conftest.py's configs): a working
# VAE; no test here judges what the model draws. Every config here shares it, so the one fit
# of the pipeline's dataset version is reused by the other runs.
FIT_FEW = {"vae": {"fit": {"steps": 30}}}

CONSUMER = """
import io, json, mlflow, pandas as pd
from PIL import Image
model = mlflow.pyfunc.load_model("models:/kiln-t2i@candidate")
df = model.predict(pd.DataFrame({"prompt": ["a red circle above a blue square"]}),
                   params={"num_inference_steps": 2, "batch_size": 1})
print(json.dumps({"size": Image.open(io.BytesIO(df["image"][0])).size}))
"""


@pytest.fixture(scope="module")
def pipeline_run(stack, tmp_path_factory, demo_src):
    """The shipped team-pipeline deployed with `prefect deploy` and run by the stack's worker
    (the UI's Quick run), from the images in the team's bucket. `ps` is read while it runs."""
    team, tmp_path = stack["team"], tmp_path_factory.mktemp("team-pipeline")
    s3 = _upload(team, demo_src)
    cfg, home = _deploy(team, tmp_path, max_steps=2)
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
    run = wait_for("the pipeline run by the worker", finished, 600, [stack["proc"]])
    assert run["state_type"] == "COMPLETED", worker_log.read_text()[-5000:]
    return {"cfg": cfg, "run": run, "ps": procs_seen, "s3": s3}


def test_a_team_runs_trains_and_consumes_through_the_stack(
    stack, pipeline_run, tmp_path, monkeypatch
):
    import mlflow
    from mlflow import MlflowClient

    team, secrets = stack["team"], stack["secrets"]
    cfg, run, s3 = pipeline_run["cfg"], pipeline_run["run"], pipeline_run["s3"]
    # Who refuses what: the Prefect server without its auth string, MLflow without a login.
    anon = httpx.post(f"{team['PREFECT_API_URL']}/flow_runs/filter", json={}, timeout=10)
    assert anon.status_code == 401
    anon = httpx.get(f"{team['MLFLOW_TRACKING_URI']}/api/2.0/mlflow/experiments/search", timeout=10)
    assert anon.status_code == 401

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

    # Each service reaches its database as the database's owner role, none a superuser.
    import psycopg

    pg = dict(host="127.0.0.1", port=stack["ports"]["postgres"], dbname="postgres")
    with psycopg.connect(user="kiln", password=secrets["POSTGRES_PASSWORD"], **pg) as c:
        supers = dict(c.execute("SELECT rolname, rolsuper FROM pg_roles").fetchall())
        owners = dict(c.execute("SELECT datname, pg_get_userbyid(datdba) FROM pg_database"))
        sessions = c.execute(
            "SELECT DISTINCT datname, usename FROM pg_stat_activity WHERE datname IN "
            "('prefect', 'mlflow', 'mlflow_auth', 'ratings')"
        ).fetchall()
    assert [supers[r] for r in ("prefect", "mlflow", "ratings")] == [False, False, False]
    assert {d: owners[d] for d in ("prefect", "mlflow", "mlflow_auth", "ratings")} == {
        "prefect": "prefect",
        "mlflow": "mlflow",
        "mlflow_auth": "mlflow",
        "ratings": "ratings",
    }
    assert sessions and all(owners[db] == user for db, user in sessions), sessions

    # The object store checks keys: no anonymous request, no wrong secret, no control API,
    # and a member's key cannot touch the registry's artifacts (the server's key alone can).
    import boto3
    from botocore.exceptions import ClientError

    endpoint = team["KILN_S3_ENDPOINT_URL"]
    assert endpoint.startswith("http://127.0.0.1:")
    keys = [o["Key"] for o in listed["Contents"]]
    pkl = next((k for k in keys if k.endswith("python_model.pkl")), keys[0])
    assert httpx.get(f"{endpoint}/kiln/{pkl}", timeout=10).status_code == 403
    assert httpx.put(f"{endpoint}/kiln/{pkl}", content=b"x", timeout=10).status_code == 403
    assert httpx.post(f"{endpoint}/moto-api/reset", timeout=10).status_code == 403
    wrong = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=team["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key="not-the-secret",
        region_name="us-east-1",
    )
    for client_, call, code in [
        (wrong, lambda c: c.list_objects_v2(Bucket="kiln"), "SignatureDoesNotMatch"),
        (s3, lambda c: c.put_object(Bucket="kiln", Key=pkl, Body=b"evil"), "AccessDenied"),
        (s3, lambda c: c.delete_object(Bucket="kiln", Key=pkl), "AccessDenied"),
        (s3, lambda c: c.get_object(Bucket="kiln", Key=pkl), "AccessDenied"),
    ]:
        with pytest.raises(ClientError) as refused_s3:
            call(client_)
        assert refused_s3.value.response["Error"]["Code"] == code

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
    # `mlflow models serve` of the same URI, with the same login, answers.
    served = bare | stack["viewer"]
    with model_server(
        "models:/kiln-t2i@candidate", served, tmp_path / "serve.log", consumer
    ) as base:
        body = {
            "dataframe_split": {"columns": ["prompt"], "data": [["a red circle"]]},
            "params": {"num_inference_steps": 2, "seed": 0},
        }
        answer = httpx.post(f"{base}/invocations", json=body, timeout=300)
        assert answer.status_code == 200, answer.text[:2000]
        assert answer.json()["predictions"][0]["prompt"] == "a red circle"

    # Promotion: refused to the viewer's read-only login, done with the team's.
    viewer_env = _clean_env() | team | stack["viewer"]
    # Each refusal is one line naming the server and what to do, exit 1, no traceback.
    refused = _kiln(viewer_env, "promote", "--config", str(cfg), "--first")
    back = _kiln(viewer_env, "rollback", "--config", str(cfg))
    said = f"kiln: error: registry {team['MLFLOW_TRACKING_URI']}: permission denied to the login"
    lines = []
    for out in (refused, back):
        errors = [x for x in out.stderr.splitlines() if x.startswith("kiln: error:")]
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
        assert len(errors) == 1, out.stderr[-3000:]
        lines += errors
    assert lines[0].startswith(f"{said} 'viewer': ask the server's admin for EDIT"), lines
    assert (
        lines[1]
        == "kiln: error: kiln-t2i has no previous-champion to roll back to (champion: none)"
    )
    assert "champion" not in client.get_registered_model("kiln-t2i").aliases, "nothing moved"
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
        *pipeline_run["ps"],
        json.dumps(mlrun.data.params),
        json.dumps(mlrun.data.tags),
        json.dumps(version.tags),
        json.dumps(run["parameters"]),
        json.dumps(_api(team).post("/artifacts/filter", json={}).json()),
        refused.stderr,
        back.stderr,
        done.stderr + done.stdout,
    ]
    for name, value in secrets.items():
        if name.endswith(("PASSWORD", "SECRET", "SECRET_KEY", "SECRET_ACCESS_KEY")):
            leaks = [i for i, text in enumerate(shown) if value in text]
            assert not leaks, f"{name} shows in {leaks}"
            assert value.encode() not in artifacts, f"{name} shows in the run's artifacts"


def team_port(stack) -> str:
    return stack["out"]().split("Rating app    http://127.0.0.1:")[1].split()[0]


def test_a_worker_killed_mid_training_gives_everything_back_and_the_run_resumes(
    stack, pipeline_run, tmp_path
):
    """SIGKILL to the worker and its flow-run process while a stage trains (a train deployment
    on the pipeline's shards): the launch dies with them (no orphan training), the crash
    automation marks the run Crashed, the GPU limit's slot and the root's training lock come
    back, the stack starts another worker, and the deployment's next run resumes the stage
    from its checkpoint."""
    team = stack["team"]
    # Killed at its first checkpoint (step 10), the stage needs only enough steps after it to
    # be still training when the kill lands (the checkpoint is polled every 0.2 s; 90 steps
    # are several seconds even on a quiet machine), and the resumed run trains only those.
    _, home = _deploy(
        team,
        tmp_path,
        max_steps=100,
        entry="train",
        train={"checkpoint_every": 10, "keep_checkpoints": 1, "eval_every": 1000},
        launch={"gpu_limit": {"lease_s": 60}},
    )
    root = Path(team["KILN_ROOT"])
    earlier = set(root.glob("runs/*"))
    out = _prefect(team, home, "deployment", "run", "kiln-train/team-train")
    run_id = out.split("/runs/flow-run/")[1].split()[0]

    def checkpointed():
        done = root.glob("runs/*/stage-32/checkpoints/step-*[0-9]/kiln_state.json")
        runs = [p.parents[3] for p in done if p.parents[3] not in earlier]
        return runs[0] if runs else None

    run_dir = wait_for(
        "the stage's first checkpoint", checkpointed, 600, [stack["proc"]], interval=0.2
    )
    stack_proc = psutil.Process(stack["proc"].pid)
    (worker,) = [p for p in stack_proc.children() if "worker" in " ".join(p.cmdline())]
    tree = [worker, *worker.children(recursive=True)]
    ranks = [p for p in tree if "models.train" in " ".join(p.cmdline())]
    assert ranks, "the stage trains under the worker"
    flow_procs = [p for p in worker.children() if p.pid not in {r.pid for r in ranks}]
    killed_at = time.monotonic()
    for p in (worker, *flow_procs):  # the worker and its flow-run process, nothing else
        p.kill()
    wait_for("the training to die with its flow run", lambda: all(map(_gone, ranks)), 30)

    with _api(team) as api:
        state = lambda rid: api.get(f"/flow_runs/{rid}").json()["state_type"]  # noqa: E731
        wait_for("the dead run marked Crashed", lambda: state(run_id) == "CRASHED", 300)
        crashed_s = time.monotonic() - killed_at
        assert not root_busy(root), "the root's training lock is free"
        limits = lambda: {  # noqa: E731
            c["name"]: c["active_slots"]
            for c in api.post("/v2/concurrency_limits/filter", json={}).json()
        }
        assert "gpu" in limits(), "the launch held a slot of the GPU limit"
        wait_for("the GPU limit's slot back", lambda: limits()["gpu"] == 0, 240)
        slot_s = time.monotonic() - killed_at
        assert "starting another" in stack["out"](), "the stack started a new worker"

        # The deployment's next run, given the interrupted run, resumes from its checkpoint.
        out = _prefect(
            team,
            home,
            "deployment",
            "run",
            "kiln-train/team-train",
            "--param",
            f"run_id={run_dir.name}",
        )
        again = out.split("/runs/flow-run/")[1].split()[0]
        wait_for("the resumed run", lambda: state(again) in FINAL, 600, [stack["proc"]])
        worker_log = (stack["dir"] / "logs" / "prefect-worker.log").read_text()
        assert state(again) == "COMPLETED", worker_log[-5000:]
    assert f"resumed from {run_dir}/stage-32/checkpoints/step-" in worker_log
    manifest = json.loads((run_dir / "stage-32" / "manifest.json").read_text())
    assert manifest["final_step"] == 100
    print(f"worker SIGKILL -> run Crashed: {crashed_s:.0f}s; GPU slot back: {slot_s:.0f}s")


def test_a_takedown_makes_the_retrain_due_and_the_worker_runs_it(
    stack, pipeline_run, tmp_path, monkeypatch
):
    """The shipped weekly-retrain deployment on the stack: a member's real `kiln takedown add`
    (of images the newest training saw) emits the event its trigger waits for; the worker runs
    the retrain, which warm-starts from the champion, registers a candidate and opens the
    blind comparison in the ratings database on PostgreSQL. A second run started meanwhile
    waits for the first (the deployment's ENQUEUE limit), then finds nothing new or taken
    down since that training and trains nothing."""
    from mlflow import MlflowClient

    team = stack["team"]
    member = _clean_env() | team
    for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(k, team[k])
    client = MlflowClient(team["MLFLOW_TRACKING_URI"])
    if "champion" not in client.get_registered_model("kiln-t2i").aliases:
        first = _kiln(member, "promote", "--config", str(pipeline_run["cfg"]), "--first")
        assert first.returncode == 0, first.stderr[-3000:]
    champion = client.get_model_version_by_alias("kiln-t2i", "champion").version
    versions = len(client.search_model_versions("name='kiln-t2i'"))

    cfg = tmp_path / "retrain.yaml"
    stage = {"resolution": 32, "batch_size": 4, "learning_rate": 1e-3, "max_steps": 2}
    cfg.write_text(
        yaml.safe_dump(
            {
                "base": str(REPO / "configs" / "team.yaml"),
                "train": {
                    "stages": [stage],
                    "model": FIT_FEW,
                    "init_from_model": "models:/kiln-t2i@champion",
                },
                "launch": {"health_check": False, "max_restarts": 0},
                "evaluate": {"limit": 2, "num_inference_steps": 1, "batch_size": 2, "seeds": [0]},
                "human_eval": {"gold_per_rater": 1},  # 2 prompts: room for one gold pair
            }
        )
    )
    spec = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    (weekly,) = [d for d in spec["deployments"] if d["name"] == "weekly-retrain"]
    weekly["parameters"]["config"] = str(cfg)
    weekly.pop("schedules")  # the trigger alone
    spec["deployments"] = [weekly]
    pfile = tmp_path / "prefect.yaml"
    pfile.write_text(yaml.safe_dump(spec, sort_keys=False))
    home = tmp_path / "prefect-home"
    _prefect(team, home, "--no-prompt", "deploy", "--prefect-file", str(pfile), "--all")

    down = _kiln(
        member,
        "takedown",
        "add",
        "--contributor",
        "cy-shoots",
        "--reason",
        "withdrawn",
        "--config",
        str(cfg),
    )
    assert down.returncode == 0, down.stderr[-3000:]
    with _api(team) as api:
        dep = api.get("/deployments/name/kiln-retrain/weekly-retrain").json()["id"]

        def runs(*states: str) -> list[dict]:
            found = api.post(
                "/flow_runs/filter", json={"flow_runs": {"deployment_id": {"any_": [dep]}}}
            ).json()
            return [r for r in found if r["state_type"] in states or r["state_name"] in states]

        (first,) = wait_for(
            "the retrain the takedown made due",
            lambda: runs("RUNNING", *FINAL),
            300,
            [stack["proc"]],
        )
        worker_log = stack["dir"] / "logs" / "prefect-worker.log"
        assert first["state_type"] == "RUNNING", worker_log.read_text()[-5000:]
        t0 = time.monotonic()
        _prefect(team, home, "deployment", "run", "kiln-retrain/weekly-retrain")

        def waiting():
            now = runs("RUNNING", "AwaitingConcurrencySlot", *FINAL)  # one snapshot
            second = [r for r in now if r["state_name"] == "AwaitingConcurrencySlot"]
            return (second[0], {r["id"]: r for r in now}[first["id"]]) if second else None

        second, first_then = wait_for(
            "a second retrain, waiting for the first", waiting, 120, [stack["proc"]]
        )
        assert first_then["state_type"] == "RUNNING", "the second waits while the first runs"

        def ended(run_id: str):
            return [r for r in runs(*FINAL) if r["id"] == run_id]

        (run,) = wait_for(
            "the first retrain to end", lambda: ended(first["id"]), 600, [stack["proc"]]
        )
        retrain_s = time.monotonic() - t0
        assert run["state_type"] == "COMPLETED", worker_log.read_text()[-5000:]
        assert run["parameters"]["event_root"] == team["KILN_ROOT"]
        new = client.get_model_version_by_alias("kiln-t2i", "candidate")
        assert len(client.search_model_versions("name='kiln-t2i'")) == versions + 1
        assert new.tags["parent_version"] == str(champion), "warm-started from the champion"
        with RatingStore.open(Path(team["KILN_ROOT"]), team["KILN_RATINGS_DATABASE_URL"]) as store:
            assert [c.model_b for c in store.comparisons()], "the comparison is in PostgreSQL"

        (after,) = wait_for(
            "the second retrain to end", lambda: ended(second["id"]), 300, [stack["proc"]]
        )
        assert after["state_type"] == "COMPLETED", worker_log.read_text()[-5000:]
        assert len(client.search_model_versions("name='kiln-t2i'")) == versions + 1, "no retrain"
    print(f"the takedown's retrain, running to completed: {retrain_s:.0f}s")
