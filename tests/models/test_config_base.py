"""`base:` in a config file: a variant states only what differs from its preset."""

from pathlib import Path

import pytest
import yaml

from kiln_config import ConfigError, read_yaml

REPO = Path(__file__).resolve().parents[2]


def _write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_mappings_merge_and_lists_replace(tmp_path):
    _write(
        tmp_path / "preset.yaml",
        {
            "train": {
                "seed": 0,
                "ema": {"enabled": True, "decay": 0.99},
                "stages": [{"resolution": 32}, {"resolution": 64}],
            },
            "evaluate": {"seeds": [0, 1]},
        },
    )
    variant = _write(
        tmp_path / "variant.yaml",
        {
            "base": "preset.yaml",
            "train": {"ema": {"decay": 0.9}, "stages": [{"resolution": 48}]},
        },
    )
    assert read_yaml(variant) == {
        "train": {
            "seed": 0,
            "ema": {"enabled": True, "decay": 0.9},
            "stages": [{"resolution": 48}],
        },
        "evaluate": {"seeds": [0, 1]},
    }


def test_bases_chain_and_cycles_are_refused(tmp_path):
    _write(tmp_path / "a.yaml", {"base": "b.yaml", "x": 1})
    _write(tmp_path / "b.yaml", {"base": "c.yaml", "y": 2})
    _write(tmp_path / "c.yaml", {"z": 3})
    assert read_yaml(tmp_path / "a.yaml") == {"z": 3, "y": 2, "x": 1}
    _write(tmp_path / "c.yaml", {"base": "a.yaml"})
    with pytest.raises(ConfigError, match="include each other"):
        read_yaml(tmp_path / "a.yaml")


@pytest.mark.parametrize(
    ("base", "message"),
    [("missing.yaml", "base: config file not found"), (["x.yaml"], "expected the path")],
)
def test_a_bad_base_names_the_file_and_the_field(tmp_path, base, message):
    variant = _write(tmp_path / "v.yaml", {"base": base, "x": 1})
    with pytest.raises(ConfigError, match=message):
        read_yaml(variant)


def test_the_short_demo_variant_differs_from_the_tiny_preset_only_in_its_stages():
    tiny = read_yaml(REPO / "configs" / "tiny.yaml")
    short = read_yaml(REPO / "configs" / "tiny-short.yaml")
    assert [s["resolution"] for s in short["train"]["stages"]] == [
        s["resolution"] for s in tiny["train"]["stages"]
    ], "the same resolutions: the two studies are compared image for image"
    steps = lambda c: sum(s["max_steps"] for s in c["train"]["stages"])  # noqa: E731
    assert steps(short) * 5 <= steps(tiny)
    short["train"].pop("stages"), tiny["train"].pop("stages")
    assert short == tiny


def test_the_retraining_recipe_is_the_base_recipe_warm_started_on_one_stage():
    base = read_yaml(REPO / "configs" / "sd2-base.yaml")
    retrain = read_yaml(REPO / "configs" / "sd2-retrain.yaml")
    assert retrain["train"].pop("init_from_model") == "models:/kiln-t2i@champion"
    assert [s["resolution"] for s in retrain["train"].pop("stages")] == [1024]
    base["train"].pop("stages")
    assert retrain == base
