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

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(what: str, check, timeout: float, procs=()):
    """Poll `check` until it returns something truthy; fail naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{p.args[:4]} exited ({p.returncode}) waiting for {what}")
        got = check()
        if got:
            return got
        time.sleep(1)  # a poll interval of a bounded wait, not a race dodge
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


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
        [str(BIN / "prefect"), *args], env=env, cwd=cwd, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert p.returncode == 0, f"prefect {' '.join(args)} failed:\n{p.stdout}\n{p.stderr}"
    return p.stdout


@pytest.fixture
def prefect_server(tmp_path):
    """A real `prefect server start` on 127.0.0.1, scheduler loop every 2 s."""
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "2",
        "PREFECT_LOGGING_LEVEL": "INFO",
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    env.pop("PREFECT_API_KEY", None)
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115
    server = subprocess.Popen(
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port),
         "--no-ui"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip

    def healthy():
        try:
            return httpx.get(f"{api}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        _wait("the Prefect server's health endpoint", healthy, 120, [server])
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


def test_scheduled_runs_fire_and_a_worker_runs_them(
    prefect_server, tmp_path, demo_src, make_config
):
    api, env = prefect_server
    cfg = make_config(tmp_path / "tiny.yaml", tmp_path / "root", demo_src)
    # The shipped nightly-ingest deployment, made due now: an interval schedule of 20 s.
    spec = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    dep = next(d for d in spec["deployments"] if d["name"] == "nightly-ingest")
    dep["parameters"]["config_path"] = str(cfg)
    dep["schedules"] = [{"interval": 20, "anchor_date": "2020-01-01T00:00:00Z"}]
    spec["deployments"] = [dep]
    pfile = tmp_path / "prefect.yaml"
    pfile.write_text(yaml.safe_dump(spec, sort_keys=False))
    _cli(["work-pool", "create", "kiln-process", "--type", "process"], env, REPO)
    _cli(["--no-prompt", "deploy", "--prefect-file", str(pfile), "--name", "nightly-ingest"],
         env, REPO)  # fmt: skip
    dep_id = _deployment_id(api, "kiln-ingest", "nightly-ingest")
    assert dep_id, "prefect deploy created no kiln-ingest/nightly-ingest deployment"

    # 1. The server's scheduler service creates the upcoming runs by itself.
    scheduled = _wait(
        "scheduled runs from the server's scheduler",
        lambda: [r for r in _runs(api, dep_id) if r["auto_scheduled"]],
        90,
    )
    assert all(r["state_type"] == "SCHEDULED" for r in scheduled)

    # 2. A real worker, started outside the project folder, runs one to completion (the pull
    # step moves the run into the checkout).
    worker_dir = tmp_path / "elsewhere"
    worker_dir.mkdir()
    wlog = open(tmp_path / "worker.log", "w")  # noqa: SIM115
    worker = subprocess.Popen(
        [str(BIN / "prefect"), "worker", "start", "--pool", "kiln-process", "--type", "process"],
        env=env, cwd=worker_dir, stdout=wlog, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        done = _wait(
            "a scheduled run completed by the worker",
            lambda: [r for r in _runs(api, dep_id)
                     if r["auto_scheduled"] and r["state_type"] in ("COMPLETED", "FAILED",
                                                                    "CRASHED")],
            300,
            [worker],
        )  # fmt: skip
        assert done[0]["state_type"] == "COMPLETED", (tmp_path / "worker.log").read_text()[-4000:]
        assert (tmp_path / "root" / "catalog").is_dir()

        # 3. The figure the docs quote: `prefect deployment run` to a completed run.
        t0 = time.monotonic()
        out = _cli(["deployment", "run", "kiln-ingest/nightly-ingest"], env, REPO)
        assert "Created flow run" in out
        manual = _wait(
            "the manually started run",
            lambda: [r for r in _runs(api, dep_id)
                     if not r["auto_scheduled"] and r["state_type"] == "COMPLETED"],
            300,
            [worker],
        )  # fmt: skip
        seconds = time.monotonic() - t0
        timing = {"deployment_run_to_completed_s": seconds}
        (tmp_path / "timing.json").write_text(json.dumps(timing))
        print(f"prefect deployment run -> completed: {seconds:.1f}s ({manual[0]['name']})")
    finally:
        worker.terminate()
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
        wlog.close()


def test_serve_cron_schedule_creates_runs(prefect_server, tmp_path, demo_src, make_config):
    api, env = prefect_server
    cfg = make_config(tmp_path / "tiny.yaml", tmp_path / "root", demo_src)
    slog = open(tmp_path / "serve.log", "w")  # noqa: SIM115
    serve = subprocess.Popen(
        [sys.executable, "deployments/serve.py", "--config", str(cfg), "--cron", "* * * * *"],
        env={**env, "PYTHONPATH": str(REPO)}, cwd=REPO, stdout=slog, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        dep_id = _wait(
            "serve.py's retrain deployment",
            lambda: _deployment_id(api, "kiln-pipeline", "retrain"),
            120,
            [serve],
        )
        scheduled = _wait(
            "runs scheduled from serve.py's cron",
            lambda: [r for r in _runs(api, dep_id) if r["auto_scheduled"]],
            90,
            [serve],
        )
        assert scheduled[0]["parameters"] == {"config_path": str(cfg)}
    finally:
        serve.terminate()  # before the minute comes round: the pipeline itself is tested elsewhere
        try:
            serve.wait(timeout=30)
        except subprocess.TimeoutExpired:
            serve.kill()
        slog.close()
