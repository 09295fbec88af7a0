"""SD2-base's frozen components with random weights, loaded the way a hub id is."""

import json
from pathlib import Path

import pytest
import yaml

from kiln_config import ModelConfig
from models.components.factory import build_components
from models.sd2_components import sd2_pretrained_entries, write_sd2_components


@pytest.fixture(scope="module")
def sd2_folder(tmp_path_factory):
    return write_sd2_components(tmp_path_factory.mktemp("sd2") / "random", text_layers=1)


def test_folder_is_laid_out_like_the_hub_repo(sd2_folder):
    assert {p.name for p in sd2_folder.iterdir()} >= {"vae", "text_encoder", "tokenizer"}
    vae = json.loads((sd2_folder / "vae" / "config.json").read_text())
    assert vae["scaling_factor"] == 0.18215 and vae["block_out_channels"] == [128, 256, 512, 512]
    text = json.loads((sd2_folder / "text_encoder" / "config.json").read_text())
    assert (text["hidden_size"], text["num_attention_heads"], text["num_hidden_layers"]) == (
        1024,
        16,
        1,
    )


def test_sd2_base_builds_from_the_folder_through_pretrained_paths(sd2_folder):
    model = yaml.safe_load(Path("configs/sd2-base.yaml").read_text())["train"]["model"]
    model |= sd2_pretrained_entries(sd2_folder)
    # A small UNet of the same cross-attention width: the components are what is checked.
    model["unet"] |= {
        "block_out_channels": [32, 64],
        "layers_per_block": 1,
        "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
        "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
        "attention_head_dim": [2, 4],
        "norm_num_groups": 16,
    }
    comps = build_components(ModelConfig.model_validate(model))
    assert comps.vae.config.scaling_factor == 0.18215
    assert comps.text_encoder.config.hidden_size == comps.unet.config.cross_attention_dim == 1024
    ids = comps.tokenizer("a red circle", padding="max_length", max_length=77).input_ids
    assert len(ids) == 77 and ids[0] == comps.tokenizer.bos_token_id


def test_same_seed_writes_the_same_weights(tmp_path, sd2_folder):
    again = write_sd2_components(tmp_path / "again", text_layers=1)
    for sub in ("vae", "text_encoder"):
        (name,) = [p.name for p in (again / sub).glob("*.safetensors")]
        assert (again / sub / name).read_bytes() == (sd2_folder / sub / name).read_bytes()


def test_text_layers_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="text_layers must be at least 1, received 0"):
        write_sd2_components(tmp_path, text_layers=0)
