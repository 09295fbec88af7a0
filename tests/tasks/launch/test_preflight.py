"""The pre-flight health check's failures, each with the message a user would act on."""

import socket
from pathlib import Path

import pytest
import yaml

from kiln_config import load_config
from tasks.launch.preflight import (
    HealthCheckError,
    check_collective,
    check_disk,
    check_gpus,
    check_storage,
    checkpoint_bytes,
)

REPO = Path(__file__).resolve().parents[3]
TOPO = REPO / "configs" / "accelerate"


def test_gpu_count_must_match_the_topology():
    with pytest.raises(HealthCheckError, match=r"starts 8 processes per machine.*sees 0 GPU"):
        check_gpus(str(TOPO / "multi-gpu.yaml"), None, visible=0)
    with pytest.raises(HealthCheckError, match="starts 8 processes"):
        check_gpus(str(TOPO / "fsdp.yaml"), None, visible=4)
    check_gpus(str(TOPO / "multi-gpu.yaml"), 2, visible=2)  # launch.num_processes override
    check_gpus(str(TOPO / "multi-node.yaml"), None, visible=8)  # 16 over 2 machines
    for cpu_ok in ("single.yaml", "cpu-ddp-2.yaml"):
        check_gpus(str(TOPO / cpu_ok), None, visible=0)
    with pytest.raises(HealthCheckError, match="this machine sees"):  # the real count here
        check_gpus(str(TOPO / "multi-gpu.yaml"), 64)


def test_unreachable_or_unwritable_storage(tmp_path, tiny_shards):
    _, root, version = tiny_shards
    good = str(root / "shards" / version / "32")
    check_storage(tmp_path / "run", [good])
    with pytest.raises(HealthCheckError, match="cannot read the dataset index"):
        check_storage(tmp_path / "run", [good, str(tmp_path / "nowhere" / "64")])
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(HealthCheckError, match="not writable"):
        check_storage(blocker / "run", [good])


def test_disk_estimate_against_free_space(tmp_path):
    cfg = load_config(REPO / "configs" / "tiny.yaml").train
    check_disk(tmp_path, cfg)
    tiny = checkpoint_bytes(cfg)
    # A UNet whose checkpoints cannot fit on this disk (counted on a meta copy: no memory).
    huge_unet = {
        **cfg.model.unet,
        "block_out_channels": [8192, 16384],
        "norm_num_groups": 32,
        "cross_attention_dim": 32,
        "attention_head_dim": [64, 128],
    }
    huge = cfg.model_copy(update={"model": cfg.model.model_copy(update={"unet": huge_unet})})
    assert checkpoint_bytes(huge) > 1000 * tiny
    # A bfloat16 EMA is half of a float32 one: checkpoints of 14 bytes a parameter, not 16.
    bf16 = checkpoint_bytes(cfg.model_copy(update={"ema_dtype": "bfloat16"}))
    n = (tiny - bf16) // 4  # parameters: 2 bytes saved in each of keep_checkpoints (2)
    assert n > 0 and tiny == n * 16 * 2 + n * 8
    with pytest.raises(HealthCheckError, match=r"GB free under .* need about"):
        check_disk(tmp_path, huge.model_copy(update={"keep_checkpoints": 50}))


def _launch(topology):
    from kiln_config import LaunchConfig

    return LaunchConfig(accelerate_config=str(topology), gpu_limit=None)


@pytest.mark.integration
def test_collective_that_cannot_form_fails_fast(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    topo = yaml.safe_load((TOPO / "cpu-ddp-2.yaml").read_text())
    # Two machines, but only this one launches: rank 0 waits for a peer that never comes.
    topo.update(
        num_machines=2,
        main_process_ip="127.0.0.1",
        main_process_port=port,
        rdzv_backend="static",
        same_network=True,
    )
    (tmp_path / "two-node.yaml").write_text(yaml.safe_dump(topo))
    with pytest.raises(HealthCheckError, match=r"all-reduce .* did not complete"):
        check_collective(_launch(tmp_path / "two-node.yaml"), tmp_path / "h", timeout_s=12)
    report = check_collective(_launch(TOPO / "cpu-ddp-2.yaml"), tmp_path / "ok", 120)
    assert report["world_size"] == 2 and report["backend"] == "gloo"


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="a GPU's one process is still probed"
)
def test_a_one_process_topology_has_no_collective_to_check(tmp_path, tiny_shards):
    """No all-reduce launch for one CPU process (no collective, no device to probe); the
    other checks still run."""
    from tasks.launch.preflight import preflight

    _, root, version = tiny_shards
    train = load_config(REPO / "configs" / "tiny.yaml").train
    good = str(root / "shards" / version / "32")
    single = _launch(TOPO / "single.yaml")
    report = preflight.fn(train, single, str(tmp_path / "run"), [good])
    assert report["world_size"] == 1 and report["collective"].startswith("skipped")
    assert not (tmp_path / "run" / "health").exists(), "nothing was launched"
    with pytest.raises(HealthCheckError, match="cannot read the dataset index"):
        preflight.fn(train, single, str(tmp_path / "run"), [str(tmp_path / "nowhere")])
