import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from flows.cli import main

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
]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command):
    result = CliRunner().invoke(main, [command, "--help"])
    assert result.exit_code == 0, result.output
    cmd = main.commands[command]
    for param in cmd.params:
        if isinstance(param, click.Option):
            assert param.help, f"{command} {param.opts[-1]} has no help text"
            assert param.opts[-1] in result.output
    assert cmd.help.split("\n")[0][:30] in result.output


def test_bad_config_is_one_clear_line(tmp_path):
    (tmp_path / "bad.yaml").write_text("train: {stages: []}\nevaluate: {prompts_csv: x}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "ingest", "--config", str(tmp_path / "bad.yaml")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
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
