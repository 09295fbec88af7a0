"""A newcomer's first commands on a fresh clone, with nothing beside it.

The team's own checkout has `../shared` (the DrawBench copy the Makefile points
KILN_DRAWBENCH_CSV at); a newcomer's has not. This clones the repository's committed HEAD into
an empty folder and runs the clone's own code (PYTHONPATH) with the current interpreter, so a
file the repository needs but does not hold, or a path outside it, fails here first. Each
fail-fast check must end in one `kiln: error:` line, without a traceback and without starting
Prefect.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """`git clone` of the repository's HEAD into a folder with no `shared/` beside it."""
    dest = tmp_path_factory.mktemp("newcomer") / "kiln"
    subprocess.run(["git", "clone", "-q", str(REPO), str(dest)], check=True, timeout=120)
    assert not (dest.parent / "shared").exists()
    return dest


@pytest.fixture
def kiln(clone, tmp_path):
    """kiln(*args): the clone's `python -m flows.cli`, offline, with empty caches."""
    drop = ("KILN_DRAWBENCH_CSV", "PYTHONPATH")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("PREFECT_")}
    env |= {
        "PYTHONPATH": str(clone),
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),  # no cached DrawBench copy
        "HF_HOME": str(tmp_path / "hf"),  # nor one in the Hub's cache
        "HF_HUB_OFFLINE": "1",  # no network, whether or not this machine has one
    }

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=clone, env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    yield run
    assert not (tmp_path / "prefect-home").exists(), "a fail-fast check started Prefect"


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("kiln: error: ")
    return line.removeprefix("kiln: error: ")


def _config(clone: Path, tmp_path: Path, **sections) -> Path:
    """The clone's tiny preset with some sections' keys replaced, written outside the clone."""
    cfg = yaml.safe_load((clone / "configs" / "tiny.yaml").read_text())
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def test_the_clone_runs_its_own_code(clone, kiln, tmp_path):
    proc = kiln("--help")
    assert proc.returncode == 0, proc.stderr
    # From a folder that is neither checkout: PYTHONPATH, not the editable install, wins.
    where = subprocess.run(
        [sys.executable, "-c", "import flows.cli, flows.config; print(flows.config.PROJECT_DIR)"],
        env={**os.environ, "PYTHONPATH": str(clone)}, cwd=tmp_path, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert where.stdout.strip() == str(clone)


def test_run_help(kiln):
    proc = kiln("run", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "--source" in proc.stdout


def test_missing_source(clone, kiln, tmp_path):
    # The preset's source, ../demo-data, is made by `kiln demo-data`; a fresh clone has none.
    line = _one_error_line(kiln("run", "--config", "configs/tiny.yaml", "--root", str(tmp_path)))
    assert line == (
        f"ingest.source: {clone / 'demo-data'} does not exist (pass --source or set ingest.source)"
    )


@pytest.fixture
def demo(kiln, tmp_path) -> Path:
    proc = kiln("demo-data", str(tmp_path / "demo"), "--n", "12")
    assert proc.returncode == 0, proc.stderr
    return tmp_path / "demo"


def test_missing_topology(clone, kiln, tmp_path, demo):
    cfg = _config(clone, tmp_path, launch={"accelerate_config": "configs/accelerate/nope.yaml"})
    line = _one_error_line(kiln("run", "--config", str(cfg), "--source", str(demo)))
    assert line.startswith(
        f"launch.accelerate_config: file not found (received '{tmp_path}/configs/accelerate/"
        "nope.yaml')"
    )


def test_unwritable_tracking_folder(clone, kiln, tmp_path, demo):
    cfg = _config(clone, tmp_path, registry={"tracking_uri": "sqlite:////sys/kiln/mlflow.db"})
    line = _one_error_line(kiln("run", "--config", str(cfg), "--source", str(demo)))
    assert line.startswith("registry.tracking_uri: /sys is not writable")
    assert "set registry.tracking_uri or --root to a writable place" in line


def test_offline_with_no_cached_prompts(clone, kiln, tmp_path, demo):
    args = ("--config", "configs/tiny.yaml", "--source", str(demo), "--root", str(tmp_path / "r"))
    line = _one_error_line(kiln("run", *args))
    assert line.startswith("evaluate.prompts_csv: the DrawBench prompts could not be fetched")
    assert "set evaluate.prompts_csv (or KILN_DRAWBENCH_CSV) to a local CSV" in line
    assert "run once with network access so that the copy is cached" in line
    assert not (tmp_path / "r").exists(), "nothing ran"
