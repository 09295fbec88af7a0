"""`train.sharding`'s settings refused before anything runs, where they cannot work: with
`train.compile`, on an FSDP or fp16 topology; a checkpoint resumed under the other sharding."""

from pathlib import Path

import pytest
import yaml

from kiln_config import ConfigError, load_config
from kiln_config.errors import InputError
from models.components.sharding import STATE_FILE
from models.training.checkpoint import load_checkpoint
from tasks.inputs import check_inputs

REPO = Path(__file__).resolve().parents[3]


def _tiny(tmp_path, topology="single.yaml", **train):
    cfg = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    cfg["train"].update(train)
    cfg["launch"]["accelerate_config"] = str(REPO / "configs" / "accelerate" / topology)
    cfg["storage"]["root"] = str(tmp_path / "root")
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def test_a_stage_of_its_own_overrides_the_train_setting(tmp_path):
    cfg = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    cfg["train"]["stages"][2] |= {"sharding": "full_shard", "gradient_checkpointing": True}
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    train = load_config(path).train
    assert [train.stage_sharding(i) for i in range(3)] == ["ddp", "ddp", "full_shard"]
    assert [train.checkpointing(i) for i in range(3)] == [False, False, True]


def test_compile_with_sharding_is_refused_at_load(tmp_path):
    with pytest.raises(ConfigError, match="train.compile is not supported with train.sharding"):
        load_config(_tiny(tmp_path, compile=True, sharding="shard_grad_op"))


@pytest.mark.parametrize(
    ("topology", "precision", "says"),
    [
        ("fsdp.yaml", None, "needs a DDP topology"),
        ("cpu-ddp-2.yaml", "fp16", "trains in bf16 or fp32, not fp16"),
    ],
)
def test_a_topology_sharding_cannot_use_is_refused_before_the_run(
    tmp_path, topology, precision, says
):
    topo = REPO / "configs" / "accelerate" / topology
    if precision:
        cfg = yaml.safe_load(topo.read_text()) | {"mixed_precision": precision}
        topo = tmp_path / "topo.yaml"
        topo.write_text(yaml.safe_dump(cfg))
    path = _tiny(tmp_path, sharding="full_shard")
    cfg = load_config(path)
    cfg.launch.accelerate_config = str(topo)
    with pytest.raises(ConfigError, match=says) as err:
        check_inputs(cfg, ("topology",))
    assert str(err.value).startswith("train.sharding: stage 1 shards with full_shard")


def test_a_checkpoint_resumes_only_under_the_sharding_it_was_written_with(tmp_path):
    ddp, sharded = tmp_path / "ddp", tmp_path / "sharded"
    ddp.mkdir()
    sharded.mkdir()
    (sharded / STATE_FILE).write_bytes(b"")
    with pytest.raises(
        InputError, match="written under DDP and this launch trains the stage under train.sharding"
    ):
        load_checkpoint(None, ddp, sharded=("unet", "optimizer", "lr_scheduler"))
    with pytest.raises(
        InputError, match="written under train.sharding and this launch .* under DDP"
    ):
        load_checkpoint(None, sharded, sharded=None)
