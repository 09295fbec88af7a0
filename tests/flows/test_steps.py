"""The table of steps (flows/steps.py): the `kiln` command and the deployments' entry flows
are two doors to the same steps, and a step refuses the same broken config through either."""

import os
import signal
import subprocess
import sys

import pytest
from click.testing import CliRunner

from flows import entry
from flows.steps import STEPS
from kiln_cli.main import main
from kiln_config import ConfigError
from kiln_config.errors import InputError
from tasks.storage.lock import RootBusy
from tests.content_fixtures import tiny_clip

# The command that runs each step, with the arguments it requires.
CLI = {
    "pipeline": ["run"],
    "ingest": ["ingest"],
    "validate": ["validate"],
    "shard": ["shard"],
    "train": ["train"],
    "evaluate": ["evaluate"],
    "register": ["register"],
    "promote": ["promote"],
    "rollback": ["rollback"],
    "takedown": ["takedown", "add", "--key", "k", "--reason", "gone"],
}
# Steps only a deployment starts: the scheduled or event-triggered retrain, and the human
# evaluation started from the Prefect UI (`kiln compare` creates a comparison and returns).
DEPLOYMENT_ONLY = {"retrain", "human_eval"}
ENTRY_ARGS = {"takedown": {"reason": "gone", "keys": ["k"]}}

# What each step checks before it starts, named by the fields a broken config fails on:
# the source (ingest.source), the topology (launch.accelerate_config) and the tracking store
# (registry.tracking_uri). Validate and takedown read only the root.
NEEDS = {
    "pipeline": {"ingest.source", "launch.accelerate_config", "registry.tracking_uri"},
    "ingest": {"ingest.source"},
    "validate": set(),
    "shard": set(),  # the topology only when it precomputes latents (precompute: false here)
    "train": {"launch.accelerate_config", "registry.tracking_uri"},
    "evaluate": {"launch.accelerate_config"},
    "register": {"registry.tracking_uri"},
    "promote": {"registry.tracking_uri"},
    "rollback": {"registry.tracking_uri"},
    "takedown": set(),
}


def test_every_step_has_its_doors():
    assert set(CLI) | DEPLOYMENT_ONLY == set(STEPS) == set(entry.__all__)
    assert set(NEEDS) == set(CLI)


def _cli_errors(args: list[str]) -> list[str]:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    prefix = "kiln: error: "
    return [line.removeprefix(prefix) for line in result.output.splitlines() if prefix in line]


@pytest.mark.parametrize("step", sorted(s for s in CLI if NEEDS[s]))
def test_both_doors_refuse_a_broken_config_alike(step, tmp_path, make_config):
    """Every input broken at once: each door fails before the step starts, on the inputs its
    step needs and no other, with the same lines."""
    taken = tmp_path / "a-file"
    taken.write_text("not a folder")
    path = make_config(
        tmp_path / "broken.yaml",
        tmp_path / "root",
        tmp_path / "no-such-source",
        **{
            "launch.accelerate_config": str(tmp_path / "no-such-topology.yaml"),
            "registry.tracking_uri": f"sqlite:///{taken}/mlflow.db",
        },
    )
    cli = _cli_errors([*CLI[step], "--config", str(path)])
    with pytest.raises(ConfigError) as deployment:
        getattr(entry, step).fn(config=str(path), **ENTRY_ARGS.get(step, {}))
    assert cli == str(deployment.value).splitlines()
    assert {line.split(":")[0] for line in cli} == NEEDS[step]


HOLD = """
import sys, time
from tasks.storage.lock import root_lock
with root_lock(sys.argv[1], "another training run"):
    print("held", flush=True)
    time.sleep(120)
"""


@pytest.fixture
def training_elsewhere(tmp_path):
    """The root of `tiny_config` held by another process, as a running training holds it."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path / "root")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        yield
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)


@pytest.mark.parametrize("step", sorted(s for s in CLI if STEPS[s].exclusive))
def test_both_doors_refuse_a_training_step_while_the_root_trains(
    step, tiny_config, training_elsewhere
):
    cli = _cli_errors([*CLI[step], "--config", str(tiny_config)])
    with pytest.raises(RootBusy) as deployment:
        getattr(entry, step).fn(config=str(tiny_config))
    assert cli == str(deployment.value).splitlines()
    assert "another training run" in cli[0]
    assert sorted(s for s in STEPS if STEPS[s].exclusive) == ["pipeline", "train"]


def test_both_doors_refuse_an_id_that_would_leave_the_root(tiny_config, tmp_path):
    """`--run-id ../../escape` is one line naming the id, before anything runs, and nothing is
    written outside the root (a deployment's `run_id` parameter the same)."""
    outside = tmp_path / "escape"
    cli = _cli_errors(["train", "--config", str(tiny_config), "--run-id", "../../escape"])
    assert cli == [
        "--run-id: an id is letters, digits, '.', '_' and '-', 128 at most, not starting "
        "with '.' (received '../../escape')"
    ]
    with pytest.raises(InputError, match=r"^run_id: an id is .*'\.\./\.\./escape'"):
        entry.train.fn(config=str(tiny_config), run_id="../../escape")
    with pytest.raises(InputError, match=r"^ingest_id: "):
        entry.validate.fn(config=str(tiny_config), ingest_id="..")
    assert not outside.exists() and not (tmp_path / "root").exists()


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory):
    """A small random CLIP saved like a hub folder (16-d embeddings)."""
    return tiny_clip(tmp_path_factory.mktemp("clip") / "clip")


def _missing_content(tmp_path, clip_folder) -> dict[str, tuple[dict, str]]:
    """Each content model or setting a validate can lack: (the config's fields, its line)."""
    import torch
    from safetensors.torch import save_file

    narrow = tmp_path / "head-8d.safetensors"
    save_file({"weight": torch.zeros(1, 8), "bias": torch.zeros(1)}, narrow)
    clip = {"quality.clip_model": str(clip_folder), "quality.min_aesthetic": 4.0}
    return {
        "clip folder": (
            {"quality.clip_model": str(tmp_path / "no-clip"), "quality.min_clip_score": 0.28},
            f"quality.clip_model: no CLIP folder at {tmp_path / 'no-clip'} (config.json,",
        ),
        "aesthetic head": (
            clip | {"quality.aesthetic_head": str(tmp_path / "no-head.pth")},
            f"quality.aesthetic_head: no file at {tmp_path / 'no-head.pth'}; stage LAION's",
        ),
        "head of another width": (
            clip | {"quality.aesthetic_head": str(narrow)},
            "quality.aesthetic_head expects 8-d embeddings; quality.clip_model gives 16-d: use",
        ),
        "language": (
            {"quality.allowed_languages": ["en", "xx"]},
            "quality.allowed_languages: Lingua has no language ['xx']",
        ),
    }


@pytest.mark.parametrize(
    "missing", ["clip folder", "aesthetic head", "head of another width", "language"]
)
@pytest.mark.parametrize("step", ["validate", "pipeline"])
def test_both_doors_refuse_a_missing_content_model_before_anything_runs(
    step, missing, tmp_path, demo_src, make_config, clip_folder
):
    """`kiln validate`, `kiln run` and their entry flows: one line naming the field, before
    Prefect starts a flow run (the check runs on the loaded config, before the step's flow is
    imported) and before anything is written under the root."""
    fields, line = _missing_content(tmp_path, clip_folder)[missing]
    root = tmp_path / "root"
    path = make_config(tmp_path / "c.yaml", root, demo_src, **fields)
    cli = _cli_errors([*CLI[step], "--config", str(path)])
    with pytest.raises(ConfigError) as deployment:
        getattr(entry, step).fn(config=str(path))
    assert cli == str(deployment.value).splitlines()
    assert len(cli) == 1 and cli[0].startswith(line), cli
    assert not root.exists(), "nothing under the root"
