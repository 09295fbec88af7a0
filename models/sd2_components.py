"""SD2-base's frozen components at their real architecture, with random seeded weights, written
as a local folder laid out like the hub repo (`vae/`, `text_encoder/`, `tokenizer/`).

`configs/sd2-base.yaml` loads the VAE, text encoder and tokenizer through `pretrained:` paths.
On a machine that cannot download `stabilityai/stable-diffusion-2-base` (this one, CI, an air-gapped
cluster before its weights arrive), this folder takes the hub id's place, loaded by the same
`from_pretrained` calls (models/components/factory.py), so the real recipe runs end to end at its
real size: the SD VAE (8x downsampling, scaling factor 0.18215) and an OpenCLIP-H-like text tower
(width 1024, 16 heads, 23 layers, 77 tokens). The tokenizer is the byte-level CLIP BPE the tiny
preset builds offline; its ids fit the real vocabulary size. Nothing here is trained: the weights
only make shapes, memory and time real, not images.

    python -m models.sd2_components --out /data/sd2-random [--text-layers 2] [--seed 0]

then point `train.model.{vae,text_encoder,tokenizer}.pretrained` at that folder.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
from diffusers import AutoencoderKL
from transformers import CLIPTextConfig, CLIPTextModel

from kiln_config import TokenizerConfig
from models.components.factory import build_tokenizer

__all__ = ["SD2_TEXT_ENCODER", "SD2_VAE", "sd2_pretrained_entries", "write_sd2_components"]

log = logging.getLogger("kiln.sd2_components")

# stabilityai/stable-diffusion-2-base vae/config.json.
SD2_VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 4,
    "sample_size": 512,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "act_fn": "silu",
    "norm_num_groups": 32,
    "scaling_factor": 0.18215,
}

# stabilityai/stable-diffusion-2-base text_encoder/config.json (OpenCLIP ViT-H/14's text tower
# with its last layer dropped: SD2 reads the penultimate layer's states), except the special
# token ids, which are the offline byte tokenizer's.
SD2_TEXT_ENCODER = {
    "vocab_size": 49408,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 23,
    "num_attention_heads": 16,
    "max_position_embeddings": 77,
    "hidden_act": "gelu",
    "projection_dim": 512,
    "layer_norm_eps": 1e-5,
}


def write_sd2_components(out: Path, *, seed: int = 0, text_layers: int = 23) -> Path:
    """Write SD2-base's VAE, text encoder and tokenizer with random seeded weights to `out`.

    Args:
        out: The folder to write (its `vae/`, `text_encoder/` and `tokenizer/` are replaced).
        seed: Seeds every random weight: the same seed writes the same bytes.
        text_layers: Transformer layers of the text encoder (SD2: 23). Fewer keep its width,
            heads and sequence length, for a smaller model of the same shapes.

    Returns:
        `out`, to use as `pretrained:` with subfolders `vae`, `text_encoder`, `tokenizer`.

    Raises:
        ValueError: when `text_layers` is below 1.
    """
    if text_layers < 1:
        raise ValueError(f"text_layers must be at least 1, received {text_layers}")
    out = Path(out)
    tokenizer = build_tokenizer(TokenizerConfig(builtin="bytes", model_max_length=77))
    specials = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    torch.manual_seed(seed)
    vae = AutoencoderKL.from_config(SD2_VAE)
    vae.save_pretrained(out / "vae")
    del vae
    text_cfg = CLIPTextConfig(**(SD2_TEXT_ENCODER | specials | {"num_hidden_layers": text_layers}))
    CLIPTextModel(text_cfg).save_pretrained(out / "text_encoder")
    tokenizer.save_pretrained(out / "tokenizer")
    (out / "kiln_random.json").write_text(json.dumps({"seed": seed, "text_layers": text_layers}))
    log.info("wrote SD2-base components with random weights (seed %d) to %s", seed, out)
    return out


def sd2_pretrained_entries(folder: Path | str) -> dict[str, dict[str, str]]:
    """`train.model` entries that load the components of `folder`, as a hub id's would."""
    return {
        name: {"pretrained": str(folder), "subfolder": name}
        for name in ("vae", "text_encoder", "tokenizer")
    }


def main(argv: list[str] | None = None) -> None:
    """Write the components (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="Folder to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--text-layers", type=int, default=23, help="SD2: 23")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    write_sd2_components(Path(args.out), seed=args.seed, text_layers=args.text_layers)


if __name__ == "__main__":
    main()
