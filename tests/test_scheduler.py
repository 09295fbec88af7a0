"""Scheduled deployments against a real Prefect server process, run by a real worker.

The server is `prefect server start` on loopback with its own PREFECT_HOME, so its scheduler
service is the one users run. The deployment comes from deployments/prefect.yaml (its schedule
made due at once for the test) and separately from deployments/serve.py. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from flows.ingest import ingest_flow
from flows.shard import shard_flow
from flows.train import train_flow
from flows.validate import validate_flow
from kiln_config import load_config
from tests.servers import BIN, free_port, http_ok, wait_for

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent


def _runs(api: str, deployment_id: str) -> list[dict]:
    r = httpx.post(
        f"{api}/flow_runs/filter",
        json={"flow_runs": {"deployment_id": {"any_": [deployment_id]}}},
        timeout=10,
    )
    r.raise_for_status()
    return r.json()


def _deployment_id(api: str, flow: str, name: str) -> str | None:
    r = httpx.get(f"{api}/deployments/name/{flow}/{name}", timeout=10)
    return r.json()["id"] if r.status_code == 200 else None


def _cli(args: list[str], env: dict, cwd: Path, timeout: float = 120) -> str:
    p = subprocess.run(
        [str(BIN / "prefect"), *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert p.returncode == 0, f"prefect {' '.join(args)} failed:\n{p.stdout}\n{p.stderr}"
    return p.stdout


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    """A real `prefect server start` on 127.0.0.1, scheduler loop every 2 s (the env is also
    the worker's). One server for the module's tests (each starts in 10-15 s): they create
    different deployments, and each filters runs by its own deployment's id."""
    tmp_path = tmp_path_factory.mktemp("prefect-server")
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "2",
        # The worker polls every 2 s, not 10: the same behaviour, less idle time.
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        "PREFECT_LOGGING_LEVEL": "INFO",
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    env.pop("PREFECT_API_KEY", None)
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115
    server = subprocess.Popen(
        [
            str(BIN / "prefect"),
            "server",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--no-ui",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_for("the Prefect server's health", lambda: http_ok(f"{api}/health"), 120, [server])
        yield api, env
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
        text = (tmp_path / "server.log").read_text()
        assert "Can't evaluate bulk DML" not in text, "the scheduler service failed"


def _states(api: str, dep_id: str, manual_only: bool = True) -> list[dict]:
    """Runs of a deployment (without the cron's future ones), oldest first."""
    runs = [r for r in _runs(api, dep_id) if not (manual_only and r["auto_scheduled"])]
    return sorted(runs, key=lambda r: r["created"])


def _worker(env: dict, cwd: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [str(BIN / "prefect"), "worker", "start", "--pool", "kiln-process", "--type", "process"],
        env=env,
        cwd=cwd,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,  # noqa: SIM115
        start_new_session=True,
    )


FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")


def _logged(api: str, run_id: str) -> str:
    r = httpx.post(
        f"{api}/logs/filter", json={"logs": {"flow_run_id": {"any_": [run_id]}}}, timeout=10
    )
    r.raise_for_status()
    return "\n".join(entry["message"] for entry in r.json())


def test_the_schedule_and_new_data_start_the_shipped_deployments_on_a_real_worker(
    prefect_server, tmp_path, landing_src, make_config
):
    """The shipped deployments on a real server and worker: the server's scheduler creates
    the nightly ingest, which a worker started outside the checkout runs; new data landing
    after a finished training makes the ingest's event trigger `weekly-retrain`, given the
    ingest's root; a takedown's event triggers it the same way.

    The retrain deployed here trains another root, so each triggered run stops at the root
    check and trains nothing. A retrain that trains on a worker (warm-started from the
    champion, a candidate, the comparison, a second run waiting for the first and then finding
    nothing new) is tests/test_stack.py's, on the team's stack."""
    api, env = prefect_server
    src, land = landing_src
    root = tmp_path / "root"
    small = {
        "train.stages": [
            {"resolution": 32, "batch_size": 4, "learning_rate": 1e-3, "max_steps": 2}
        ],
        "launch.health_check": False,
        "launch.max_restarts": 0,
        "retrain.min_new_images": 10,
    }
    cfg = make_config(tmp_path / "tiny.yaml", root, src, **small)
    warm = {**small, "train.init_from_model": "models:/kiln-t2i@champion"}
    elsewhere_root = tmp_path / "the-retrains-root"
    retrain = make_config(tmp_path / "retrain.yaml", elsewhere_root, src, **warm)

    # The shipped nightly-ingest and weekly-retrain deployments, pointed at the test configs.
    # The ingest's schedule is made due once, 30 s from now (after the deploy, before the
    # first training ends); the retrain keeps its cron (next Sunday: never due here) and its
    # triggers.
    spec = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    deps = {d["name"]: d for d in spec["deployments"]}
    ingest, weekly = deps["nightly-ingest"], deps["weekly-retrain"]
    ingest["parameters"]["config"] = str(cfg)
    soon = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 30))
    ingest["schedules"] = [{"interval": 86400, "anchor_date": soon}]
    weekly["parameters"]["config"] = str(retrain)
    assert weekly["triggers"][0]["expect"] == ["kiln.ingest.completed", "kiln.takedown.added"]
    assert weekly["concurrency_limit"] == {"limit": 1, "collision_strategy": "ENQUEUE"}
    spec["deployments"] = [ingest, weekly]
    pfile = tmp_path / "prefect.yaml"
    pfile.write_text(yaml.safe_dump(spec, sort_keys=False))
    _cli(["work-pool", "create", "kiln-process", "--type", "process"], env, REPO)
    _cli(["--no-prompt", "deploy", "--prefect-file", str(pfile), "--all"], env, REPO)
    ingest_id = _deployment_id(api, "kiln-ingest", "nightly-ingest")
    weekly_id = _deployment_id(api, "kiln-retrain", "weekly-retrain")
    assert ingest_id and weekly_id, "prefect deploy created the deployments"

    # 1. The server's scheduler service creates the scheduled ingest by itself.
    wait_for("the scheduled ingest run", lambda: _states(api, ingest_id, manual_only=False), 90)

    # Meanwhile a first model is trained in this process: new data counts from the newest
    # finished training. No worker runs yet, so the scheduled ingest (due during this training
    # on a loaded machine, or soon after it) waits for one: the training, not the test, fills
    # the time until the schedule comes due.
    loaded = load_config(cfg)
    gate = {"ingest_id": ingest_flow(loaded, standalone=False)["ingest_id"]}
    validate_flow(loaded, **gate)
    train_flow(loaded, dataset_version=shard_flow(loaded, **gate)["dataset_version"])
    assert not [
        r
        for r in _states(api, ingest_id, manual_only=False)
        if r["state_type"] not in ("SCHEDULED", "PENDING")
    ], "nothing ran yet"

    # 2. A real worker, started outside the project folder, runs it (the pull step moves the
    # run into the checkout). Nothing new since the training: its event starts no retrain.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    worker = _worker(env, elsewhere, tmp_path / "worker.log")
    wlog = lambda: (tmp_path / "worker.log").read_text()[-6000:]  # noqa: E731
    try:
        done = wait_for(
            "the scheduled ingest, run by the worker",
            lambda: [
                r for r in _states(api, ingest_id, manual_only=False) if r["state_type"] in FINAL
            ],
            300,
            [worker],
        )
        assert done[0]["state_type"] == "COMPLETED", wlog()

        # 3. New data lands; the nightly ingest started by hand catalogs it, and its event
        # (15 new images >= retrain.min_new_images 10) makes the trigger start weekly-retrain
        # with the ingest's root, which is not the one the retrain trains: it stops there.
        assert land() == 15
        t0 = time.monotonic()
        assert "Created flow run" in _cli(
            ["deployment", "run", "kiln-ingest/nightly-ingest"], env, REPO
        )
        manual = wait_for(
            "the ingest started by hand",
            lambda: [r for r in _states(api, ingest_id) if r["state_type"] in FINAL],
            300,
            [worker],
        )
        ingest_s = time.monotonic() - t0
        assert manual[0]["state_type"] == "COMPLETED", wlog()
        (triggered,) = wait_for(
            "the retrain the new-data trigger starts, run by the worker",
            lambda: [r for r in _states(api, weekly_id) if r["state_type"] in FINAL],
            300,
            [worker],
        )
        assert triggered["state_type"] == "COMPLETED", wlog()
        assert triggered["parameters"]["event_root"] == str(root), "the trigger names its root"
        said = f"the new-data event came from root {root}"
        wait_for("the retrain's log line", lambda: said in _logged(api, triggered["id"]), 30)
        assert not (elsewhere_root / "runs").exists(), "nothing trained"

        # 4. A takedown's event (`kiln takedown add`, labelled due when the newest training saw
        # a taken-down image) starts the retrain the same way; another root's, here.
        down = {
            "prefect.resource.id": "kiln.root.0123456789abcdef",
            "prefect.resource.name": str(tmp_path / "someone-elses-takedown"),
            "kiln.retrain-due": "true",
        }
        _cli(["events", "emit", "kiln.takedown.added", "--resource", json.dumps(down)], env, REPO)
        wait_for(
            "the run the takedown event triggers",
            lambda: [
                r
                for r in _states(api, weekly_id)
                if r["parameters"].get("event_root") == down["prefect.resource.name"]
                and r["state_type"] == "COMPLETED"
            ],
            300,
            [worker],
        )
        runs = _states(api, weekly_id)
        assert len(runs) == 2, "one run per due event: the ingest with new data, the takedown"

        (tmp_path / "timing.json").write_text(
            json.dumps({"deployment_run_to_ingest_completed_s": ingest_s})
        )
        print(f"prefect deployment run -> ingest completed: {ingest_s:.1f}s")
    finally:
        worker.terminate()
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()


def test_serve_cron_schedule_creates_runs(prefect_server, tmp_path, demo_src, make_config):
    api, env = prefect_server
    cfg = make_config(tmp_path / "tiny.yaml", tmp_path / "root", demo_src)
    slog = open(tmp_path / "serve.log", "w")  # noqa: SIM115
    serve = subprocess.Popen(
        [sys.executable, "deployments/serve.py", "--config", str(cfg), "--cron", "* * * * *"],
        env={**env, "PYTHONPATH": str(REPO)},
        cwd=REPO,
        stdout=slog,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        dep_id = wait_for(
            "serve.py's retrain deployment",
            lambda: _deployment_id(api, "kiln-pipeline", "retrain"),
            120,
            [serve],
        )
        scheduled = wait_for(
            "runs scheduled from serve.py's cron",
            lambda: [r for r in _runs(api, dep_id) if r["auto_scheduled"]],
            90,
            [serve],
        )
        assert scheduled[0]["parameters"] == {"config": str(cfg)}
    finally:
        serve.terminate()  # before the minute comes round: the pipeline itself is tested elsewhere
        try:
            serve.wait(timeout=30)
        except subprocess.TimeoutExpired:
            serve.kill()
        slog.close()
