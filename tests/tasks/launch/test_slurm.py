"""Stages on a real two-node SLURM cluster (the `slurm` fixture: munged, slurmctld and two
slurmd on loopback), with real `sbatch`/`srun` and `accelerate launch` ranks over gloo."""

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration  # a SLURM cluster, accelerate launches

REPO = Path(__file__).resolve().parents[3]
SINGLE = str(REPO / "configs" / "accelerate" / "single.yaml")
DDP = str(REPO / "configs" / "accelerate" / "cpu-ddp-2.yaml")


@pytest.fixture(scope="module")
def on_cluster(slurm):
    """This process's SLURM commands reach the test cluster; gloo stays on loopback."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLURM_CONF", str(slurm.conf))
        mp.setenv("GLOO_SOCKET_IFNAME", "lo")
        yield slurm


def _stage_run(tiny_shards, out, nodes=1, steps=6, faults=None):
    from kiln_config import StageRun, load_config

    cfg_path, root, version = tiny_shards
    train = load_config(cfg_path).train
    stage = train.stages[0].model_copy(
        update={"max_steps": steps, "batch_size": 4, "num_machines": nodes}
    )
    train = train.model_copy(
        update={"stages": [stage], "checkpoint_every": 2, "log_every": 1, "log_sample_keys": True}
    )
    return StageRun(
        train=train,
        stage_index=0,
        shards=str(root / "shards" / version / "32"),
        output_dir=str(out),
        faults=faults or {},
    )


@pytest.fixture(scope="module")
def two_node_stage(tiny_shards, on_cluster, tmp_path_factory):
    """One uninterrupted 6-step stage on 2 nodes x 1 process through SLURM."""
    from tasks.launch.accelerate import launch_stage

    out = tmp_path_factory.mktemp("slurm-stage") / "two-nodes"
    manifest = launch_stage.fn(_stage_run(tiny_shards, out, nodes=2), _slurm_launch())
    return out, manifest


def _unet(stage_dir):
    from safetensors.torch import load_file

    return load_file(stage_dir / "final" / "unet" / "diffusion_pytorch_model.safetensors")


def _slurm_launch(**slurm):
    from kiln_config import LaunchConfig, SlurmConfig

    return LaunchConfig(
        accelerate_config=SINGLE,
        backend="slurm",
        gpu_limit=None,
        slurm=SlurmConfig(poll_s=0.5, **slurm),
    )


def _per_step(path, field):
    out = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "step" in rec and field in rec:
            out[rec["step"]] = rec[field]
    return out


def test_each_node_of_a_slurm_step_gets_its_rank_and_the_first_nodes_address(on_cluster):
    probe = (
        "import json, os; from models.node_launch import from_slurm; "
        "r = from_slurm(dict(os.environ), 29500, 1); "
        "print(json.dumps([r.num_machines, r.machine_rank, r.main_process_ip]))"
    )
    out = subprocess.run(
        ["srun", "-N2", "--ntasks-per-node=1", sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    roles = sorted(json.loads(line) for line in out.stdout.splitlines())
    assert roles == [[2, 0, "127.0.0.1"], [2, 1, "127.0.0.1"]], "NodeAddr, not the node name"


def test_a_stage_on_two_nodes_trains_like_one_node_with_two_processes(
    tmp_path, tiny_shards, two_node_stage
):
    """2 nodes x 1 process through SLURM and 1 node x 2 processes locally: the same samples on
    each rank, the same losses, the same weights; and the pre-flight all-reduce spans both
    nodes."""
    import torch

    from kiln_config import LaunchConfig
    from tasks.launch.accelerate import launch_stage
    from tasks.launch.preflight import check_collective

    (two_nodes, manifest), one_node = two_node_stage, tmp_path / "one-node"
    health = check_collective(_slurm_launch(), tmp_path / "health", 120, nodes=2)
    assert health["world_size"] == 2
    assert manifest["final_step"] == 6 and manifest["num_processes"] == 2
    log = (two_nodes / "slurm-stage-32px.log").read_text()
    assert "node 0 of 2" in log and "node 1 of 2" in log, log[-2000:]
    assert (two_nodes / "final" / "unet" / "config.json").is_file(), "exported once, by rank 0"
    launch_stage.fn(
        _stage_run(tiny_shards, one_node), LaunchConfig(accelerate_config=DDP, gpu_limit=None)
    )
    assert _per_step(two_nodes / "metrics.jsonl", "loss") == _per_step(
        one_node / "metrics.jsonl", "loss"
    )
    for rank in (0, 1):
        name = f"samples-rank{rank}.jsonl"
        assert _per_step(two_nodes / name, "keys") == _per_step(one_node / name, "keys")
    a, b = _unet(two_nodes), _unet(one_node)
    assert all(torch.equal(a[k], b[k]) for k in a), "the same weights, bit for bit"


def test_a_lost_rank_fails_the_job_and_the_retry_resumes_to_the_same_weights(
    tmp_path, tiny_shards, two_node_stage
):
    """A rank killed after step 3 fails the job (srun stops the other node's rank); the
    stage task's Prefect retry submits a new job, which resumes from step 2's checkpoint and
    ends bit-identical to the uninterrupted run."""
    import torch
    from prefect import flow

    from tasks.launch.accelerate import launch_stage

    out = tmp_path / "killed"
    run = _stage_run(tiny_shards, out, nodes=2, faults={"kill_at_steps": [3]})

    @flow
    def one_stage():
        return launch_stage.with_options(retries=1, retry_delay_seconds=0)(run, _slurm_launch())

    manifest = one_stage()
    log = (out / "slurm-stage-32px.log").read_text()
    assert "fault injection at step 3" in log
    assert log.count("node 1 of 2") == 2, "a second job, on both nodes"
    assert "resumed from" in log, log[-3000:]
    assert manifest["final_step"] == 6
    full, resumed = _unet(two_node_stage[0]), _unet(out)
    assert all(torch.equal(full[k], resumed[k]) for k in full), "the resume is exact"


def test_the_cluster_refusing_a_job_is_one_clear_error_before_any_work(on_cluster, tmp_path):
    from kiln_config import SlurmConfig
    from tasks.launch.accelerate import ClusterJob, _retry_unless_diverged
    from tasks.launch.slurm import SlurmRejected, check_slurm, run_slurm_job

    with pytest.raises(SlurmRejected, match="(?i)invalid partition.*") as bad:
        check_slurm(SlurmConfig(partition="gpu-a100"), 1)
    assert str(bad.value).startswith("launch.slurm: the cluster refuses a 1-node job (")
    with pytest.raises(SlurmRejected, match="refuses a 3-node job") as big:
        check_slurm(SlurmConfig(), 3)
    assert "node" in str(big.value).split("(", 1)[1].lower()
    check_slurm(SlurmConfig(), 2)  # what the cluster has passes
    # Submitted anyway, the job is refused by sbatch or, on a cluster that accepts it and
    # leaves it pending for ever (no EnforcePartLimits, like this one), cancelled at once.
    with pytest.raises(SlurmRejected, match="sbatch refused the job|can never start") as e:
        job = ClusterJob(["-m", "x"], 3, 1, "big", logging.getLogger())
        run_slurm_job(job, SlurmConfig(), tmp_path)
    state = type("S", (), {"data": e.value})()
    assert not _retry_unless_diverged(None, None, state), "a refused job is not resubmitted"
    assert on_cluster.jobs() == []


def test_sigterm_to_kiln_train_cancels_the_running_stage_job(tmp_path, tiny_shards, on_cluster):
    """`kiln train` stopped with SIGTERM (a Prefect worker cancelling the flow run, systemd,
    Docker) while a stage's job runs: the job is scancel'ed and no rank keeps running on any
    node."""
    from prefect.settings import PREFECT_API_URL

    cfg_path, root, version = tiny_shards
    data = yaml.safe_load(cfg_path.read_text())
    data["launch"] |= {"backend": "slurm", "slurm": {"poll_s": 0.5}, "health_check": False}
    data["storage"]["root"] = str(tmp_path / "root")
    data["train"]["stages"] = [
        {**data["train"]["stages"][0], "max_steps": 100_000, "num_machines": 2}
    ]
    cfg = tmp_path / "slurm.yaml"
    cfg.write_text(yaml.safe_dump(data, sort_keys=False))
    # The shards where `kiln train` looks for them, and the session's Prefect server.
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "shards").symlink_to(root / "shards")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["PREFECT_API_URL"] = PREFECT_API_URL.value()
    kiln = Path(sys.executable).parent / "kiln"
    proc = subprocess.Popen(
        [
            str(kiln),
            "train",
            "--config",
            str(cfg),
            "--dataset-version",
            version,
            "--run-id",
            "sigterm",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    stage = tmp_path / "root" / "runs" / "sigterm" / "stage-32"
    deadline = time.monotonic() + 300
    while not (stage / "heartbeat").exists() and time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    assert (stage / "heartbeat").exists(), proc.communicate(timeout=30)[0][-3000:]
    assert len(on_cluster.jobs()) == 1, "the stage's job is running"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode != 0
    assert "cancelled SLURM job" in out, out[-3000:]
    assert on_cluster.jobs() == [], "no job left in the queue"
    ranks = subprocess.run(
        ["pgrep", "-f", str(stage / "stage.yaml")], capture_output=True, text=True
    ).stdout.split()
    assert ranks == [], "no rank left on any node"
