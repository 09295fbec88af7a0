"""The GPU check's CPU path (`benchmarks/gpu_check.py --dry-run`) and its wheel list.

The dry run is the same script a device session runs, at toy size: real `accelerate launch`
subprocesses, MDS shards, a SIGKILL and resume, a study, the UNet step under DDP, FSDP and
torch.compile, and the loader. It keeps the script from rotting between device sessions.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_wheel_list_pins_what_kiln_is_tested_with():
    """Every line parses, and each pin is the version installed in Kiln's venv."""
    result = _gpu_check().check_wheels()
    assert result["errors"] == []
    assert result["mismatches"] == []
    assert result["not_installed"] == []
    for name in ("transformers", "huggingface-hub", "diffusers", "mosaicml-streaming"):
        assert name in result["pins"]
    assert result["pins"]["transformers"].startswith("4.")
    assert not result["pins"]["huggingface-hub"].startswith("1.")
    assert "torch" not in result["pins"] and "accelerate" not in result["pins"]


def test_wheel_list_errors_name_the_line_and_value(tmp_path):
    bad = tmp_path / "gpu_wheels.txt"
    bad.write_text("# comment\ndiffusers>=0.38\nnumpy==2.1.3\nNumPy==2.1.3\nnot-installed-x==1.0\n")
    result = _gpu_check().check_wheels(bad)
    assert result["errors"] == [
        "gpu_wheels.txt line 2: expected name==version, got 'diffusers>=0.38'",
        "gpu_wheels.txt line 4: NumPy is listed twice",
    ]
    assert result["not_installed"] == ["not-installed-x"]


def test_box_option_names_the_steps_on_a_bad_value():
    """`--box` takes STEP=SECONDS; a typo is refused before any step runs."""
    for bad in ("trian=300", "train=0", "train=soon"):
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), "--dry-run", "--box", bad],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2
        assert f"--box {bad!r}: expected STEP=SECONDS with STEP one of" in proc.stderr
        assert "'train'" in proc.stderr


def test_dry_run_imports_only_what_the_device_machine_has_or_is_carried():
    """The dry run's steps start with gpu_check_site/ first on PYTHONPATH: Kiln's venv less
    every distribution neither on the device machine nor in the wheel list."""
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'benchmarks' / 'gpu_check_site'}:{REPO}")
    code = (
        "import importlib.util as u; import diffusers, streaming, models.train, kiln_pyfunc; "
        "print(u.find_spec('prefect'), u.find_spec('boto3'))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["None", "None"]  # installed here, hidden as there


def _finite_positive(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


@pytest.mark.e2e
@pytest.mark.integration
def test_dry_run_runs_every_step_and_reports_real_numbers(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), "--work", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    steps = report["steps"]
    assert report["device"] is None and report["summary"]["toy"] is True
    assert report["simulated_device_imports"] is True
    assert set(steps) == {"wheels", "matmul", "train", "fsdp", "study", "unet", "loader"}
    assert {n: s["status"] for n, s in steps.items()} == {
        "wheels": "ok",
        "matmul": "ok",
        "train": "ok",
        "fsdp": "skipped",
        "study": "ok",
        "unet": "ok",
        "loader": "ok",
    }
    assert "needs an accelerator" in steps["fsdp"]["skipped"]
    assert _finite_positive(steps["matmul"]["tflops"])

    resume = steps["train"]["resume"]
    assert resume["killed_exit_code"] != 0
    assert resume["same_batches"] and resume["same_losses"] and resume["same_weights"]
    for stage in (resume["straight"], steps["train"]["stage1"]):
        assert stage["final_step"] > 0
        assert math.isfinite(stage["last_loss"]) and _finite_positive(stage["samples_per_s"])
        assert (Path(stage["export"]) / "model_index.json").is_file()
    assert steps["study"]["images"] == 2

    variants = steps["unet"]["variants"]
    assert [
        (v["preset_resolution"], v["wrapper"], v["channels_last"], v["compile"]) for v in variants
    ] == [
        (256, "ddp", False, False),
        (256, "ddp", True, False),
        (256, "fsdp", True, False),
        (512, "ddp", True, False),
        (256, "ddp", False, True),
    ]
    for v in variants:
        for key in ("img_per_s", "flops_per_sample", "tflops", "mfu", "peak_mem_gb"):
            assert _finite_positive(v[key]), (key, v)
        assert any("scaled_dot_product" in k for k in v["attention_kernels"]), v

    assert _finite_positive(steps["loader"]["samples_per_s"])
    summary = report["summary"]
    assert _finite_positive(summary["loader_over_unet_256"])
    assert summary["best_256"]["img_per_s"] == max(
        v["img_per_s"] for v in variants if v["preset_resolution"] == 256
    )
    # The one-screen table is the last thing printed.
    last = proc.stdout.strip().splitlines()
    assert last[-1].startswith("best 256 px MFU") and len(last) < 40
