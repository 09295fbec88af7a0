import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from kiln_cli.main import main
from kiln_cli.options import registry_refusal

COMMANDS = [
    "demo-data",
    "run",
    "ingest",
    "validate",
    "shard",
    "train",
    "evaluate",
    "register",
    "ui",
    "mlflow-ui",
    "plan",
    "compare",
    "rate",
    "rate serve",
    "rate invite",
    "rate report",
    "lineage",
    "lineage image",
    "lineage model",
    "takedown",
    "takedown add",
    "takedown list",
    "catalog",
    "catalog show",
    "catalog sql",
    "catalog export",
    "catalog compact",
    "catalog migrate",
]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command):
    result = CliRunner().invoke(main, [*command.split(), "--help"])
    assert result.exit_code == 0, result.output
    cmd = main
    for name in command.split():
        cmd = cmd.commands[name]
    for param in cmd.params:
        if isinstance(param, click.Option):
            assert param.help, f"{command} {param.opts[-1]} has no help text"
            assert param.opts[-1] in result.output
    assert cmd.help.split("\n")[0][:30] in result.output


def test_bad_config_is_one_clear_line(tmp_path):
    (tmp_path / "bad.yaml").write_text("train: {stages: []}\nevaluate: {prompts_csv: x}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "kiln_cli", "ingest", "--config", str(tmp_path / "bad.yaml")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "train.model: Field required" in proc.stderr
    assert "train.stages: List should have at least 1 item" in proc.stderr


def test_step_without_its_input_says_what_to_run_first(tmp_path, tiny_config):
    result = CliRunner().invoke(
        main, ["shard", "--config", str(tiny_config), "--root", str(tmp_path / "empty")]
    )
    assert result.exit_code == 1
    assert "run `kiln ingest` first" in result.output


def test_demo_data_command(tmp_path):
    result = CliRunner().invoke(
        main, ["demo-data", str(tmp_path / "d"), "--n", "12", "--seed", "1"]
    )
    assert result.exit_code == 0, result.output
    assert len(list((tmp_path / "d").glob("*.*"))) == 13  # 12 files + metadata.jsonl


def test_run_fails_before_any_work_when_prompts_are_missing(tmp_path, demo_src, make_config):
    cfg = make_config(
        tmp_path / "c.yaml",
        tmp_path / "root",
        demo_src,
        **{"evaluate.prompts_csv": str(tmp_path / "nope.csv")},
    )
    result = CliRunner().invoke(main, ["run", "--config", str(cfg)])
    assert result.exit_code == 1
    assert "evaluate.prompts_csv: file not found" in result.output
    assert not (tmp_path / "root" / "catalog").exists(), "nothing ran"


@pytest.mark.integration
def test_plan_for_tiny_from_a_given_rate_and_from_a_measurement(tmp_path, tiny_config):
    import json

    runner = CliRunner()
    root = tmp_path / "root"
    given = runner.invoke(
        main, ["plan", "--config", str(tiny_config), "--root", str(root), "--img-per-s", "100"]
    )
    assert given.exit_code == 0, given.output
    lines = given.output.splitlines()
    assert lines[0].split()[:4] == ["stage", "procs", "steps", "samples"]
    rows = {ln.split()[0]: ln.split() for ln in lines if ln.strip().endswith(tuple("0123456789"))}
    assert set(rows) >= {"32px", "48px", "64px", "total"}
    assert rows["32px"][1:4] == ["1", "12", "96"] and rows["64px"][1:4] == ["1", "8", "64"]
    assert float(rows["32px"][4]) == 100.0 and float(rows["64px"][4]) < 100.0, "FLOPs-scaled"
    plan = json.loads((root / "runs" / "plan.json").read_text())
    assert plan["total"]["samples"] == 96 + 64 + 64
    assert [s["processes"] for s in plan["stages"]] == [1, 1, 1]

    measured = runner.invoke(
        main, ["plan", "--config", str(tiny_config), "--root", str(root), "--measure-steps", "4"]
    )
    assert measured.exit_code == 0, measured.output
    assert "measured on cpu (" in measured.output, "with the threads a launch gets"
    plan = json.loads((root / "runs" / "plan.json").read_text())
    assert all(s["img_per_s"] > 0 and s["wall_hours"] > 0 for s in plan["stages"])
    assert all(s["val_forward_s"] > 0 for s in plan["stages"]), "a validation pass measured"

    both = runner.invoke(
        main, ["plan", "--config", str(tiny_config), "--img-per-s", "1", "--measure-steps", "4"]
    )
    assert both.exit_code != 0 and "exactly one of" in both.output


@pytest.mark.integration
def test_train_throughput_benchmark_writes_its_fields(tmp_path):
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    out = tmp_path / "tt.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(repo / "benchmarks" / "train_throughput.py"),
            "--out",
            str(out),
            "--steps",
            "6",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    res = json.loads(out.read_text())
    for k in ("img_per_s", "mfu", "data_wait_frac", "peak_mem_gb"):
        assert res[k] > 0 or k == "data_wait_frac", k
    assert res["baseline"]["img_per_s"] > 0 and res["speedup_vs_baseline"] > 0


def test_plan_with_a_missing_topology_names_the_field(tmp_path, demo_src, make_config):
    missing = tmp_path / "no-such-topology.yaml"
    cfg = make_config(
        tmp_path / "c.yaml",
        tmp_path / "root",
        demo_src,
        **{"launch.accelerate_config": str(missing)},
    )
    proc = subprocess.run(
        [sys.executable, "-m", "kiln_cli", "plan", "--config", str(cfg), "--img-per-s", "10"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert f"launch.accelerate_config: file not found (received '{missing}')" in proc.stderr


SECRET_URI = "postgresql://kiln:s3cret-pw@db.internal:5432/mlflow"


def test_mlflow_ui_gets_the_tracking_uri_through_the_environment(
    tmp_path, demo_src, make_config, monkeypatch
):
    cfg = make_config(
        tmp_path / "c.yaml", tmp_path / "root", demo_src, **{"registry.tracking_uri": SECRET_URI}
    )
    calls = []

    def fake_call(argv, env, start_new_session):  # stands in for the `mlflow ui` process
        calls.append((argv, env))
        assert start_new_session, "its own process group, stopped as one"
        return 0

    monkeypatch.setattr(subprocess, "call", fake_call)
    result = CliRunner().invoke(main, ["mlflow-ui", "--config", str(cfg), "--port", "5055"])
    assert result.exit_code == 0, result.output
    ((argv, env),) = calls
    assert "s3cret-pw" not in " ".join(argv) and "--backend-store-uri" not in argv
    assert argv[1:] == ["ui", "--host", "127.0.0.1", "--port", "5055"]
    assert env["MLFLOW_BACKEND_STORE_URI"] == SECRET_URI
    assert "s3cret-pw" not in result.output and "kiln:***@db.internal" in result.output


def test_run_summary_and_register_artifact_redact_the_tracking_uri(
    tmp_path, demo_src, make_config, capsys
):
    from kiln_cli.main import _where
    from kiln_config import load_config
    from tasks.reports import registered_report

    cfg = load_config(
        make_config(
            tmp_path / "c.yaml",
            tmp_path / "root",
            demo_src,
            **{"registry.tracking_uri": SECRET_URI},
        )
    )
    model = {
        "name": "kiln-t2i",
        "version": "1",
        "alias": "candidate",
        "uri_by_alias": "models:/kiln-t2i@candidate",
    }
    result = {
        "ingest": {"ingest_id": "i"},
        "shards": {"dataset_version": "d"},
        "run": {"run_id": "r", "export": "e"},
        "study": {"path": "s", "images": 1, "prompts": "tiny.csv"},
        "model": model,
    }
    _where(cfg, "c.yaml", result)
    out = capsys.readouterr()
    assert "s3cret-pw" not in out.out + out.err and "kiln:***@db.internal" in out.out
    assert "(1 images of the tiny.csv prompts)" in out.out
    markdown = registered_report(model, {"run_id": "r"}, cfg.tracking_uri)
    assert "s3cret-pw" not in markdown and "kiln:***@db.internal" in markdown


def _kiln(*args, env=None, timeout=120):
    """`python -m kiln_cli ARGS` as a user runs it: (process, seconds it took)."""
    import os
    import time

    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "kiln_cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    return proc, time.monotonic() - t0


def test_missing_source_fails_fast_without_prefect(tmp_path):
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    home = tmp_path / "prefect-home"
    proc, took = _kiln(
        "run",
        "--source",
        str(tmp_path / "nonexistent"),
        "--config",
        str(repo / "configs/tiny.yaml"),
        "--root",
        str(tmp_path / "root"),
        env={"PREFECT_HOME": str(home)},
    )
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"kiln: error: ingest.source: {tmp_path / 'nonexistent'} does not exist "
        "(pass --source or set ingest.source)"
    ]
    assert "Starting temporary server" not in proc.stdout + proc.stderr
    assert not home.exists(), "no Prefect server, database or flow run was made"
    assert not (tmp_path / "root").exists()
    assert took < 10, f"took {took:.1f} s"


def test_debug_flag_shows_the_traceback(tmp_path):
    proc, _ = _kiln("--debug", "demo-data", "/sys/kiln-demo")
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr
    assert "PermissionError" in proc.stderr


def test_what_the_system_refuses_is_one_line_naming_the_path():
    proc, _ = _kiln("demo-data", "/sys/kiln-demo")  # read-only: the user picks another folder
    assert proc.returncode == 1
    (line,) = proc.stderr.splitlines()
    assert line.startswith("kiln: error: PermissionError: ") and "'/sys/kiln-demo'" in line


def _studies(tmp_path, make_config, study: dict | None):
    """(config, folder A, folder B): two study folders holding `study` as their study.json."""
    import json

    cfg = make_config(tmp_path / "c.yaml", tmp_path / "root", tmp_path)
    folders = [tmp_path / "a", tmp_path / "b"]
    for folder in folders if study is not None else ():
        folder.mkdir()
        (folder / "study.json").write_text(json.dumps({"study_id": folder.name, **study}))
    return str(cfg), *map(str, folders)


def test_a_bug_in_kiln_prints_its_traceback_and_says_it_is_a_bug(tmp_path, make_config):
    # A study.json without its settings: reading it, Kiln's own code raises a KeyError that
    # no check expects. It must not read as the user's mistake.
    cfg, a, b = _studies(tmp_path, make_config, {"items": []})
    proc, _ = _kiln("compare", "--config", cfg, "--a", a, "--b", b)
    assert proc.returncode == 70, proc.stderr
    err = proc.stderr
    assert "Traceback (most recent call last):" in err and "in load_study" in err
    assert "KeyError: 'settings'" in err
    last = err.splitlines()[-1]
    assert last.startswith("kiln: bug: KeyError: 'settings' is a bug in Kiln, not a mistake")
    assert "report it" in last and "with the traceback above" in last
    assert err.index("Traceback") < err.index("kiln: bug:")
    assert "kiln: error:" not in err


def test_a_user_error_is_one_line_naming_the_fix(tmp_path, make_config):
    cfg, a, b = _studies(tmp_path, make_config, None)  # no study in either folder
    proc, _ = _kiln("compare", "--config", cfg, "--a", a, "--b", b)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"kiln: error: no study {a!r}: {tmp_path / 'root' / 'eval' / a}/study.json does not "
        "exist; run `kiln evaluate` to create it"
    ]


def test_every_error_kiln_expects_derives_from_one_base():
    from data_quality.verdict import QualityGateError
    from kiln_config import ConfigError, InputError, KilnError, MissingInput, NotFound
    from tasks.launch.common import LaunchError, StageDiverged
    from tasks.registry.promotion import PromotionRefused
    from tasks.registry.tracking import ModelVersionNotFound

    for kind in (
        ConfigError,
        InputError,
        MissingInput,
        NotFound,
        LaunchError,
        StageDiverged,
        QualityGateError,
        PromotionRefused,
        ModelVersionNotFound,
    ):
        assert issubclass(kind, KilnError), kind
    # Each keeps the builtin kind its callers catch.
    assert issubclass(ConfigError, ValueError) and issubclass(MissingInput, FileNotFoundError)
    assert issubclass(NotFound, KeyError) and str(NotFound("no comparison 'x'")) == (
        "no comparison 'x'"
    ), "a KeyError's text, not quoted"


def test_run_checks_the_tracking_folder_before_any_work(tmp_path, demo_src, make_config):
    (tmp_path / "afile").write_text("")
    uri = f"sqlite:///{tmp_path}/afile/mlflow.db"
    cfg = make_config(
        tmp_path / "c.yaml", tmp_path / "root", demo_src, **{"registry.tracking_uri": uri}
    )
    result = CliRunner().invoke(main, ["run", "--config", str(cfg)])
    assert result.exit_code == 1
    assert result.stderr.startswith("kiln: error: registry.tracking_uri: ")
    assert "is a file, not a folder" in result.stderr
    assert not (tmp_path / "root").exists(), "nothing ran"


def test_offline_without_cached_prompts_names_both_fixes(tmp_path, demo_src):
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    env = {
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "1",
        "KILN_DRAWBENCH_CSV": "",
    }
    # A recipe that evaluates on DrawBench: the tiny preset without its own prompts.
    cfg = tmp_path / "drawbench.yaml"
    cfg.write_text(f"base: {repo / 'configs/tiny.yaml'}\nevaluate: {{prompts_csv: null}}\n")
    proc, _ = _kiln("evaluate", "--config", str(cfg), "--root", str(tmp_path / "root"), env=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("kiln: error: evaluate.prompts_csv: the DrawBench prompts could not")
    assert "evaluate.prompts_csv (or KILN_DRAWBENCH_CSV) to a local CSV" in line
    assert "run once with network access" in line


def test_ui_env_points_the_ui_at_its_own_port():
    from kiln_cli.main import _ui_env

    assert _ui_env(4301, {}) == {"PREFECT_SERVER_UI_API_URL": "http://127.0.0.1:4301/api"}
    assert _ui_env(4301, {"PREFECT_API_URL": "http://127.0.0.1:4200/api"}) == {
        "PREFECT_SERVER_UI_API_URL": "http://127.0.0.1:4301/api"
    }, "a client API URL for another server does not steer this UI"
    assert _ui_env(4301, {"PREFECT_UI_API_URL": "https://proxy/api"}) == {}, "explicit kept"


@pytest.mark.integration
def test_kiln_ui_on_another_port_calls_its_own_api(tmp_path):
    import json
    import os
    import signal
    import socket
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env |= {"PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    log = open(tmp_path / "ui.log", "w")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln_cli", "ui", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "ui.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no /api/health within 180 s"
            try:
                with urllib.request.urlopen(f"{base}/api/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        with urllib.request.urlopen(f"{base}/ui-settings", timeout=10) as r:
            settings = json.load(r)
        assert settings["api_url"] == f"{base}/api"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()


def test_evaluate_takes_a_model_or_a_run_not_both():
    result = CliRunner().invoke(
        main,
        [
            "evaluate",
            "--config",
            "configs/tiny.yaml",
            "--model",
            "models:/kiln-t2i@champion",
            "--run-id",
            "run-1",
        ],
    )
    assert result.exit_code != 0 and "--model and --run-id exclude each other" in result.output


def test_an_option_is_checked_like_its_config_field():
    result = CliRunner().invoke(
        main,
        [
            "generate",
            "--config",
            "configs/tiny.yaml",
            "--model",
            "models:/kiln-t2i@champion",
            "--prompt",
            "a red circle",
            "--steps",
            "0",
        ],
    )
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        "kiln: error: --steps (evaluate.num_inference_steps): Input should be greater than 0 "
        "(received 0)"
    ]


def test_a_rate_command_error_is_one_kiln_error_line(tmp_path, make_config):
    """The rate group fails like every other command: `kiln: error:` on stderr, exit 1."""
    cfg = make_config(tmp_path / "tiny.yaml", tmp_path / "root", tmp_path)
    result = CliRunner().invoke(
        main, ["rate", "report", "--config", str(cfg), "--comparison", "nope"]
    )
    assert result.exit_code == 1
    (line,) = result.stderr.splitlines()
    assert line.startswith("kiln: error: ") and "no comparison 'nope'" in line


def test_defaults_in_help_come_from_the_schema():
    from kiln_config import EvaluateConfig, HumanEvalConfig

    serve = CliRunner().invoke(main, ["rate", "serve", "--help"]).output
    assert f"human_eval.port, {HumanEvalConfig().port}]" in serve
    generate = CliRunner().invoke(main, ["generate", "--help"]).output
    assert f"evaluate.guidance_scale, {EvaluateConfig().guidance_scale}]" in generate


def test_a_tracking_servers_refusals_are_one_line_naming_it_and_what_to_do(monkeypatch):
    """MLflow's own exceptions, as its REST client raises them for a server's answer: the
    HTTP status in the message (a basic-auth server's 401 and 403), or the REST error code.
    The server is named with its password masked. (The real server's refusals go through
    this in tests/test_stack.py.)"""
    from mlflow.exceptions import MlflowException, RestException

    server = "https://kiln:pw@mlflow.internal"
    call = "API request to endpoint /api/2.0/mlflow/registered-models/alias failed with "
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "viewer")
    forbidden = MlflowException(call + "error code 403 != 200. Response body: 'Permission denied'")
    assert registry_refusal(forbidden, server) == (
        "registry https://kiln:***@mlflow.internal: permission denied to the login 'viewer': "
        "ask the server's admin for EDIT on the registered model, or use a login that has it"
    )
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME")
    anonymous = MlflowException(call + "error code 401 != 200. Response body: 'You are not'")
    assert registry_refusal(anonymous, None) == (
        "registry: not logged in, or a wrong login: set MLFLOW_TRACKING_USERNAME and "
        "MLFLOW_TRACKING_PASSWORD to a login the server has"
    )
    gone = RestException({"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "no kiln-t2i"})
    assert registry_refusal(gone, "http://h:5000") == (
        "registry http://h:5000: not found: RESOURCE_DOES_NOT_EXIST: no kiln-t2i"
    )
    other = RestException({"error_code": "INTERNAL_ERROR", "message": "disk full"})
    assert (
        registry_refusal(other, "http://h:5000")
        == "registry http://h:5000: INTERNAL_ERROR: disk full"
    )
