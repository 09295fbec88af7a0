"""Warm-start retraining: the champion's exact weights start the next run, whose registered
version names its parent (real flow runs, a real `accelerate launch`, a real registry). The
weekly-retrain deployment itself runs on a real server and worker in tests/test_scheduler.py."""

import json

import pytest
import yaml
from diffusers import UNet2DConditionModel
from mlflow.tracking import MlflowClient

from flows.promote import promote_flow
from flows.register import register_flow
from flows.train import train_flow
from kiln_config import load_config
from models.components.export import state_dict_sha256

from .test_run_config import ONE_STAGE, _root_with_shards

pytestmark = pytest.mark.integration


def test_a_retrain_starts_from_the_champions_weights_and_names_its_parent(
    tmp_path, tiny_shards, demo_src, make_config
):
    root, version = _root_with_shards(tmp_path, tiny_shards)
    cfg = make_config(tmp_path / "tiny.yaml", root, demo_src, **ONE_STAGE)
    first = train_flow(load_config(cfg), dataset_version=version)
    v1 = register_flow(load_config(cfg), run_id=first["run_id"])
    promote_flow(load_config(cfg), candidate=f"models:/kiln-t2i/{v1['version']}", first=True)

    retrain = yaml.safe_load(cfg.read_text())
    retrain["train"]["init_from_model"] = "models:/kiln-t2i@champion"
    retrain["train"]["stages"][0]["learning_rate"] = 1e-5
    (tmp_path / "retrain.yaml").write_text(yaml.safe_dump(retrain))
    second = train_flow(load_config(tmp_path / "retrain.yaml"), dataset_version=version)
    assert second["init_from_model"]["resolved"] == f"models:/kiln-t2i/{v1['version']}"

    # Before its first step, the stage held exactly the champion's UNet (its EMA export).
    champion = UNet2DConditionModel.from_pretrained(first["export"], subfolder="unet")

    def init(run: dict) -> dict:
        return json.loads((root / "runs" / run["run_id"] / "stage-32" / "init.json").read_text())

    assert init(second)["unet_sha256"] == state_dict_sha256(champion)
    assert init(first)["unet_sha256"] != init(second)["unet_sha256"], "scratch starts elsewhere"
    # The tiny preset fits its VAE on the data; a warm start keeps the champion's instead.
    vae = [
        yaml.safe_load((root / "runs" / r["run_id"] / "config.yaml").read_text())["train"]["model"][
            "vae"
        ]["pretrained"]
        for r in (first, second)
    ]
    assert vae == [vae[0], second["init_from_model"]["folder"]] and "/vae/" in vae[0]
    # ...and trained from there: the new export differs, a little.
    after = UNet2DConditionModel.from_pretrained(second["export"], subfolder="unet")
    deltas = [
        (a - b).abs().max().item()
        for a, b in zip(after.parameters(), champion.parameters(), strict=True)
    ]
    assert 0 < max(deltas) < 0.1

    v2 = register_flow(load_config(tmp_path / "retrain.yaml"), run_id=second["run_id"])
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    tags = client.get_model_version("kiln-t2i", v2["version"]).tags
    assert tags["parent_model"] == f"models:/kiln-t2i/{v1['version']}"
    assert tags["parent_version"] == v1["version"]
    card = client.get_model_version("kiln-t2i", v2["version"]).description
    assert "## Model card" in card
    assert f"warm-started from `models:/kiln-t2i/{v1['version']}`" in card
    assert "| 32px | 2 | 8 |" in card, "steps and samples seen (2 steps x 4 per batch)"
    assert "GPU-hours" in card and "**Human evaluation**: none yet" in card
    assert str(client.get_model_version_by_alias("kiln-t2i", "candidate").version) == v2["version"]
    assert str(client.get_model_version_by_alias("kiln-t2i", "champion").version) == v1["version"]


def test_a_missing_champion_is_a_clear_error(tmp_path, tiny_shards, demo_src, make_config):
    root, version = _root_with_shards(tmp_path, tiny_shards)
    warm = {**ONE_STAGE, "train.init_from_model": "models:/kiln-t2i@champion"}
    cfg = make_config(tmp_path / "tiny.yaml", root, demo_src, **warm)
    with pytest.raises(ValueError, match="train.init_from_model: models:/kiln-t2i@champion does"):
        train_flow(load_config(cfg), dataset_version=version)
