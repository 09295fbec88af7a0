"""Scores read from CLIP embeddings: the image-caption cosine (the CLIP score of DataComp and
LAION-2B's filter) and a LAION-style linear aesthetic head.

The embeddings come from models/embed_content.py (an accelerate launch) and are stored
L2-normalised, so a cosine is a dot product. The aesthetic head is LAION-Aesthetics
Predictor V1's form: one linear layer (`weight` [1, D], `bias` [1]) on the normalised image
embedding of the CLIP it was fitted on (`sa_0_4_vit_b_32_linear.pth` for ViT-B/32, 512-d;
`sa_0_4_vit_l_14_linear.pth` for ViT-L/14, 768-d), giving a score on the 1-10 scale that
MosaicML's SD2 run cut at 4.5.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kiln_config.errors import InputError

__all__ = ["AestheticHead", "clip_scores"]


def clip_scores(images: np.ndarray, captions: np.ndarray) -> np.ndarray:
    """Row-wise cosine of normalised image and caption embeddings (float32)."""
    return np.einsum("ij,ij->i", images.astype(np.float32), captions.astype(np.float32))


@dataclass(frozen=True)
class AestheticHead:
    weight: np.ndarray  # (D,)
    bias: float

    @classmethod
    def load(cls, path: str | Path) -> AestheticHead:
        """The head from a .safetensors or a PyTorch state dict file (`weight`, `bias`, or one
        linear layer's `<name>.weight` and `<name>.bias`).

        Raises:
            InputError: no such file, or it holds no single linear layer to one output.
        """
        path = Path(path).expanduser()
        if not path.is_file():
            raise InputError(
                f"quality.aesthetic_head: no file at {path}; stage LAION's linear head "
                "(e.g. sa_0_4_vit_b_32_linear.pth) there (docs/operations.md)"
            )
        if path.suffix == ".safetensors":
            from safetensors.numpy import load_file

            state = load_file(str(path))
        else:
            import torch

            state = {k: v.float().numpy() for k, v in torch.load(path, weights_only=True).items()}
        w = [k for k in state if k.endswith("weight")]
        b = [k for k in state if k.endswith("bias")]
        if len(w) != 1 or len(b) != 1 or state[w[0]].shape[0] != 1:
            raise InputError(
                f"quality.aesthetic_head {path}: expected one linear layer to one output "
                f"(weight [1, D], bias [1]); found {[(k, v.shape) for k, v in state.items()]}"
            )
        return cls(state[w[0]].reshape(-1).astype(np.float32), float(state[b[0]].reshape(-1)[0]))

    def scores(self, images: np.ndarray) -> np.ndarray:
        """The head's score of each normalised image embedding.

        Raises:
            InputError: the head was fitted on a CLIP of another width.
        """
        if images.shape[1] != len(self.weight):
            raise InputError(
                f"quality.aesthetic_head expects {len(self.weight)}-d embeddings; "
                f"quality.clip_model gives {images.shape[1]}-d: use the head of that CLIP"
            )
        return images.astype(np.float32) @ self.weight + self.bias
