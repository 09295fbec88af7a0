import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.launch.accelerate import LaunchError, accelerate_command, run_launch
from tests.flows.artifacts import run_artifacts

pytestmark = pytest.mark.integration  # accelerate launches / Prefect flow runs


def test_output_streams_and_failure_carries_the_tail(caplog):
    cmd = [sys.executable, "-c", "print('hello from child'); import sys; sys.exit(3)"]
    with caplog.at_level("INFO"), pytest.raises(LaunchError, match="exit code 3") as e:
        run_launch(cmd)
    assert "hello from child" in str(e.value)
    assert any("hello from child" in r.getMessage() for r in caplog.records)


def test_hung_launch_is_killed_with_its_whole_process_group(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    # The child starts a grandchild, then both hang without ever writing a heartbeat.
    script = (
        "import subprocess, sys, time;"
        f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
        f"open({str(pidfile)!r}, 'w').write(str(p.pid));"
        "time.sleep(600)"
    )
    start = time.monotonic()
    with pytest.raises(LaunchError, match="hung"):
        run_launch(
            [sys.executable, "-c", script], heartbeat=tmp_path / "heartbeat", hang_timeout_s=3
        )
    assert time.monotonic() - start < 60
    pid = int(pidfile.read_text())
    # The grandchild was in the launch's process group, so it is gone too (or a zombie). A
    # SIGKILLed process on a loaded machine can take a moment to die: a bounded wait.
    deadline, state = time.monotonic() + 10, "R"
    while state != "Z" and time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().split()[2]
        except (ProcessLookupError, FileNotFoundError):
            state = "Z"  # gone
        else:
            time.sleep(0.1)
    assert state == "Z", f"the grandchild {pid} survived the kill (state {state})"


def test_accelerate_command_checks_the_topology(tmp_path):
    with pytest.raises(FileNotFoundError, match="accelerate_config"):
        accelerate_command(str(tmp_path / "missing.yaml"), "models.train", [])
    (tmp_path / "t.yaml").write_text("distributed_type: 'NO'\n")
    cmd = accelerate_command(str(tmp_path / "t.yaml"), "models.train", ["--config", "x"], 2)
    assert cmd[-4:] == ["-m", "models.train", "--config", "x"]
    assert cmd[cmd.index("--num_processes") + 1] == "2"


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="the thread count is for CPU launches"
)
def test_a_cpu_launch_gets_the_threads_the_planner_measures_with(tmp_path, monkeypatch, caplog):
    """accelerate gives a CPU process 1 thread unless the config says `use_cpu`; Kiln passes
    the count `kiln plan` measures with, and the launched process really runs with it."""
    from models.training.cpu_threads import _cores, cpu_threads_per_process

    one = tmp_path / "one.yaml"
    one.write_text("distributed_type: 'NO'\nnum_processes: 1\n")
    two_nodes = tmp_path / "two-nodes.yaml"
    two_nodes.write_text("distributed_type: MULTI_GPU\nnum_processes: 4\nnum_machines: 2\n")

    def threads(cmd):
        return int(cmd[cmd.index("--num_cpu_threads_per_process") + 1])

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = _cores()
    assert threads(accelerate_command(str(one), "m", [])) == cores == cpu_threads_per_process(1)
    assert threads(accelerate_command(str(two_nodes), "m", [])) == max(1, cores // 2)
    assert threads(accelerate_command(str(one), "m", [], num_processes=2)) == max(1, cores // 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # an operator's choice wins
    assert threads(accelerate_command(str(one), "m", [])) == 3 == cpu_threads_per_process(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "4,2")  # OpenMP's nested form: divide the cores
    assert threads(accelerate_command(str(one), "m", [])) == cores

    # The real launch: a module that reports the threads torch got.
    (tmp_path / "kiln_threads_probe.py").write_text(
        "import json, os, torch\n"
        "print('PROBE', json.dumps([torch.get_num_threads(), os.environ['OMP_NUM_THREADS']]))\n"
    )
    # Unset, accelerate alone would give this one-process launch 1 thread; Kiln's count wins.
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with caplog.at_level("INFO"):
        run_launch(accelerate_command(str(one), "kiln_threads_probe", []))
    probe = next(r.getMessage() for r in caplog.records if "PROBE" in r.getMessage())
    # torch's count for that setting, from the same module run directly: MKL builds cap it at
    # the physical cores, so on a machine with hyperthreads it can be lower than the setting.
    env = {**os.environ, "OMP_NUM_THREADS": str(cores)}
    direct = subprocess.run(
        [sys.executable, "-m", "kiln_threads_probe"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    launched = json.loads(probe.split("PROBE", 1)[1])
    assert launched == json.loads(direct.stdout.split("PROBE", 1)[1])
    assert launched[1] == str(cores)


def _stage_run(tiny_shards, out, **faults):
    from kiln_config import FaultInjection, StageRun, load_config

    cfg_path, root, version = tiny_shards
    train = load_config(cfg_path).train
    stage = train.stages[0].model_copy(update={"max_steps": 6, "batch_size": 4})
    train = train.model_copy(
        update={"stages": [stage], "checkpoint_every": 2, "log_every": 1, "log_sample_keys": True}
    )
    return StageRun(
        train=train,
        stage_index=0,
        shards=str(root / "shards" / version / "32"),
        output_dir=str(out),
        faults=FaultInjection(**faults),
    )


def _per_step(path, field):
    """The last record of each step (a step redone after a crash is logged again)."""
    out = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "step" in rec and field in rec:
            out[rec["step"]] = rec[field]
    return out


def _same_draws(clean, crashed):
    """The contributors' exposure (tasks/catalog/dataset_lineage.py) of the resumed stage counts
    every sample the final weights trained on once, as the uninterrupted stage's does, on every
    rank."""
    from tasks.catalog.dataset_lineage import stage_draws

    logs = sorted(p.name for p in clean.glob("samples-rank*.jsonl"))
    lines = sum(len((crashed / n).read_text().splitlines()) for n in logs)
    assert lines > sum(len((clean / n).read_text().splitlines()) for n in logs), "steps redone"
    drawn = stage_draws(clean)
    assert stage_draws(crashed) == drawn
    assert sum(drawn.values()) == sum(
        len(k) for n in logs for k in _per_step(clean / n, "keys").values()
    )


def _same_weights(a, b):
    import torch
    from safetensors.torch import load_file

    for sub in ("final/unet", "final-raw/unet"):
        wa = load_file(a / sub / "diffusion_pytorch_model.safetensors")
        wb = load_file(b / sub / "diffusion_pytorch_model.safetensors")
        assert all(torch.equal(wa[k], wb[k]) for k in wa), f"{sub} differs"


def _launch_in_flow(run, retries, hang_timeout_s=None, topology=None):
    """Launch with retries inside a flow run, as flows/train.py does."""
    from prefect import flow

    from tasks.launch.accelerate import launch_stage

    @flow(name="test-launch")
    def one_stage():
        task = launch_stage.with_options(retries=retries, retry_delay_seconds=0)
        return task(run, _launch(topology or SINGLE, hang_timeout_s))

    return one_stage(return_state=True)


SINGLE = str(Path(__file__).resolve().parents[3] / "configs" / "accelerate" / "single.yaml")


def _launch(topology: str, hang_timeout_s: float | None = None):
    """Launch settings on `topology`, with no GPU limit."""
    from kiln_config import LaunchConfig

    hang = {"hang_timeout_s": hang_timeout_s} if hang_timeout_s else {}
    return LaunchConfig(accelerate_config=topology, gpu_limit=None, **hang)


def test_sigkills_and_a_stall_resume_bit_exactly_through_task_retries(tmp_path, tiny_shards):
    """SIGKILLed at step 3, stalled at step 4 (no heartbeat: the watchdog kills the launch),
    SIGKILLed at step 5: each task retry resumes from the newest checkpoint, and the run ends
    with the uninterrupted run's losses, batches and weights."""
    from tasks.launch.accelerate import launch_stage

    clean, crashed = tmp_path / "clean", tmp_path / "crashed"
    launch_stage.fn(_stage_run(tiny_shards, clean), _launch(SINGLE))
    state = _launch_in_flow(
        _stage_run(tiny_shards, crashed, kill_at_steps=[3, 5], stall_at_step=4),
        retries=3,
        hang_timeout_s=20,
    )
    manifest = state.result()
    assert manifest["final_step"] == 6
    for step in (3, 4, 5):
        assert (crashed / f".fault-fired-{step}").exists(), f"the fault at step {step} fired"
    resumed = [
        r["step"]
        for r in map(json.loads, (crashed / "metrics.jsonl").read_text().splitlines())
        if r.get("event") == "resumed"
    ]
    assert resumed == [2, 4, 4], "each retry resumed from the newest checkpoint"
    assert _per_step(crashed / "metrics.jsonl", "loss") == _per_step(
        clean / "metrics.jsonl", "loss"
    )
    assert _per_step(crashed / "samples-rank0.jsonl", "keys") == _per_step(
        clean / "samples-rank0.jsonl", "keys"
    )
    _same_weights(clean, crashed)
    _same_draws(clean, crashed)
    # One progress artifact per attempt of this flow run's task; the last one reached 100%.
    progress = [a.data for a in run_artifacts("train-32px-progress", state)]
    assert 100.0 in progress, "this run's progress hit 100%"


def test_sigkill_of_a_ddp_rank_resumes_bit_exactly(tmp_path, tiny_shards):
    """Two CPU processes over gloo: one rank is SIGKILLed at step 3 (the fault fires on the
    first rank to reach it); torchrun tears the other down; the retry resumes both ranks."""
    from tasks.launch.accelerate import launch_stage

    ddp = SINGLE.replace("single.yaml", "cpu-ddp-2.yaml")
    clean, crashed = tmp_path / "clean", tmp_path / "crashed"
    launch_stage.fn(_stage_run(tiny_shards, clean), _launch(ddp))
    manifest = _launch_in_flow(
        _stage_run(tiny_shards, crashed, kill_at_steps=[3]), retries=1, topology=ddp
    ).result()
    assert manifest["final_step"] == 6 and manifest["num_processes"] == 2
    assert (crashed / "metrics.jsonl").read_text().count('"event": "resumed"') == 1
    assert _per_step(crashed / "metrics.jsonl", "loss") == _per_step(
        clean / "metrics.jsonl", "loss"
    )
    for rank in (0, 1):
        name = f"samples-rank{rank}.jsonl"
        assert _per_step(crashed / name, "keys") == _per_step(clean / name, "keys")
    _same_weights(clean, crashed)
    _same_draws(clean, crashed)


def test_a_diverged_stage_is_not_retried_and_not_relaunched(tmp_path, tiny_shards):
    """NaN loss at step 3 with 2 retries allowed: one launch, StageDiverged naming the step,
    no retry (a relaunch would fail the same way, 15 s a launch); calling the task again for
    the marked stage fails at once without launching anything."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from tasks.launch.accelerate import StageDiverged, launch_stage

    out = tmp_path / "nan"
    run = _stage_run(tiny_shards, out, nan_at_step=3)
    state = _launch_in_flow(run, retries=2)
    with pytest.raises(StageDiverged, match="training diverged at step 3"):
        state.result()

    async def task_runs():
        async with get_client() as client:
            return await client.read_task_runs(
                flow_run_filter=FlowRunFilter(
                    id=FlowRunFilterId(any_=[state.state_details.flow_run_id])
                )
            )

    (task_run,) = asyncio.run(task_runs())
    assert task_run.run_count == 1, "a diverged stage was retried"
    assert '"event": "resumed"' not in (out / "metrics.jsonl").read_text()
    (out / "stage.yaml").unlink()  # written before every launch
    with pytest.raises(StageDiverged, match="training diverged at step 3"):
        launch_stage.fn(run, _launch(SINGLE))
    assert not (out / "stage.yaml").exists(), "a marked stage was prepared for a launch again"
