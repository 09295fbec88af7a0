"""`tasks.planning.budget.make_plan` with `measure_stage` replaced by a recorder: which
validation split the plan asks the measurement for, and how it multiplies the measured cost
out."""

from pathlib import Path

import pytest

from kiln_config import load_config
from tasks.planning import budget as plan_module

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def recorded(monkeypatch):
    calls = []

    def fake_measure(train, i, *, steps, local_processes, val_samples=None):
        calls.append({"stage": i, "val_samples": val_samples, "local": local_processes})
        return {"img_per_s": 100.0, "val_forward_s": 0.001, "device": "cpu", "cpu_threads": 1}

    monkeypatch.setattr(plan_module, "measure_stage", fake_measure)
    return calls


def test_the_measurement_evaluates_one_process_share_of_the_real_split(recorded):
    train = load_config(REPO / "configs" / "tiny.yaml").train
    train.val_max_samples = 100
    out = plan_module.make_plan(
        train, 2, 0.0, measure_steps=4, val_samples=[37, 500, 0], processes_per_machine=2
    )
    # 37 images over 2 processes: 19 each; 500 is capped at val_max_samples first; an empty
    # split is measured at the default size.
    assert [c["val_samples"] for c in recorded] == [19, 50, None]
    s0 = out["stages"][0]
    evals = 2 + (train.stages[0].max_steps - 1) // train.eval_every
    expected = evals * 4 * train.val_timesteps * 37 * 0.001 / 2 / 3600
    assert s0["eval_hours"] == pytest.approx(expected)


def test_without_split_sizes_the_measurement_picks_its_own(recorded):
    train = load_config(REPO / "configs" / "tiny.yaml").train
    plan_module.make_plan(train, 1, 0.0, measure_steps=4)
    assert [c["val_samples"] for c in recorded] == [None] * len(train.stages)


def test_each_stage_is_planned_on_its_own_node_count():
    """256 px on 1 node, the next stages on 2 and 4 (2 processes each): each stage's samples
    and cost follow its own world size, and the table shows it."""
    from kiln_config import LaunchConfig, SlurmConfig
    from tasks.planning.topology import stage_processes

    train = load_config(REPO / "configs" / "tiny.yaml").train
    train.stages = [
        s.model_copy(update={"num_machines": n})
        for s, n in zip(train.stages, (1, 2, 4), strict=True)
    ]
    launch = LaunchConfig(backend="slurm", slurm=SlurmConfig(gpus_per_node=2))
    procs = stage_processes(launch, train)
    assert procs == [2, 4, 8]
    out = plan_module.make_plan(train, procs, 2.0, img_per_s=10.0)
    for s, p, n in zip(train.stages, out["stages"], procs, strict=True):
        assert p["processes"] == n
        assert p["samples"] == s.max_steps * s.batch_size * s.gradient_accumulation_steps * n
        assert p["gpu_hours"] == pytest.approx(p["wall_hours"] * n)
        assert p["cost_usd"] == pytest.approx(p["gpu_hours"] * 2.0)
    table = plan_module.format_plan(out).splitlines()
    assert [row.split()[1] for row in table[2:5]] == ["2", "4", "8"]
    # Locally every stage runs the topology's processes.
    assert stage_processes(LaunchConfig(num_processes=3), train) == [3, 3, 3]


def test_kiln_plan_prints_memory_and_scaling_for_the_real_recipe(tmp_path):
    """The real CLI on configs/sd2-base.yaml: memory per GPU by component (every stage fits
    80 GB), and both scaling tables; plan.json holds the same."""
    import json
    import os
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kiln_cli",
            "plan",
            "--config",
            "configs/sd2-base.yaml",
            "--root",
            str(tmp_path / "root"),
            "--img-per-s",
            "40",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ},
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "memory per GPU (GB; 80 GB per GPU)" in text
    assert "256px    ddp   128" in text and "512px    ddp    32" in text
    assert text.count("  fits\n") == 3 and "DOES NOT FIT" not in text
    assert "efficiency" in text
    # At the global batch as written (1024 at 256 px on 8 GPUs): 8 per GPU on 16 nodes.
    assert "  256px   1024    16   128       8       8 x 1" in text
    plan = json.loads((tmp_path / "root" / "runs" / "plan.json").read_text())
    s0 = plan["stages"][0]
    n = 865_910_724
    assert s0["memory"]["configured"]["parameters"] == n * 4 + n * 2  # fp32 + bf16 copies
    assert s0["memory"]["configured"]["optimizer"] == n * 8
    assert [r["nodes"] for r in s0["scaling"]] == [1, 2, 4, 8, 16]
    assert [r["per_device"] for r in s0["scaling_global"]] == [128, 64, 32, 16, 8]
    assert all(0 < r["efficiency"] <= 1 for r in s0["scaling"])


def test_scaling_counts_ring_traffic_and_hides_it_under_the_backward_pass():
    from tasks.planning.scale_model import BUCKET_BYTES, stage_scaling

    n = 100_000_000  # 400 MB of fp32 gradients, 16 buckets
    fast = stage_scaling(n, 100.0, 10, 1, [2], 8, inter_node_gbps=10)[0]
    ring = 2 * 15 / 16 * n * 4  # 16 processes
    assert fast["traffic_gb"] == pytest.approx(ring / 1e9, abs=1e-3)
    comm = ring * 8 / 10e9
    assert fast["comm_s"] == pytest.approx(comm, abs=1e-4)
    # 0.1 s of compute, a 0.067 s backward: the traffic beyond it shows (the last bucket's
    # share is never hidden, and is part of what shows here).
    exposed = comm - 0.1 * 2 / 3
    assert fast["exposed_s"] == pytest.approx(exposed, abs=1e-4)
    assert fast["efficiency"] == pytest.approx(0.1 / (0.1 + exposed), abs=1e-3)
    # At 400 Gbit/s and ten times the compute per step: only the last bucket stays exposed.
    last = ring * 8 / 400e9 * BUCKET_BYTES / (n * 4)
    slow = stage_scaling(n, 10.0, 10, 1, [1, 2], 8, inter_node_gbps=400)
    assert slow[0]["efficiency"] == 1.0 and slow[0]["traffic_gb"] == 0.0
    assert slow[1]["exposed_s"] == pytest.approx(last, abs=1e-4)
    # SHARD_GRAD_OP in bf16: a reduce-scatter and an all-gather of 2-byte elements.
    fsdp = stage_scaling(n, 10.0, 10, 1, [2], 8, strategy="fsdp")[0]
    assert fsdp["traffic_gb"] == pytest.approx(2 * 15 / 16 * n * 2 / 1e9, abs=1e-3)
