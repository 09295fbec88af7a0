"""Captions -> token ids, the same way in the loader and in the shard step.

The shard step can store token ids in the shards (`shards.token_ids`); the loader uses them
only when they are what `CaptionTokenizer` makes of the stored captions, so stored and
computed ids never differ.

`truncate_prompts` cuts prompts for a diffusers pipeline to what its text encoder can read,
before the pipeline sees them: otherwise its CLIP truncation warning decodes the whole cut
batch, hundreds of `<|endoftext|>` pads included, into the log for every batch.
"""

from __future__ import annotations

import logging

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

__all__ = ["CaptionTokenizer", "fast_tokenizer", "truncate_prompts"]

log = logging.getLogger(__name__)


def truncate_prompts(tokenizer: PreTrainedTokenizerBase, prompts: list[str]) -> list[str]:
    """`kiln_pyfunc.truncate_prompts`: the served model ships without the rest of Kiln, so the
    prompt cut lives in its module. Imported here on first use, because that module imports
    MLflow (1.5 s), which a training process does not otherwise need."""
    from kiln_pyfunc import truncate_prompts as cut

    return cut(tokenizer, prompts)


def fast_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """The Rust ("fast") version of `tokenizer`; converted once from its files if it is slow."""
    if tokenizer.is_fast:
        return tokenizer
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kiln-tok-") as d:
        tokenizer.save_pretrained(d)
        return AutoTokenizer.from_pretrained(d, use_fast=True)


class CaptionTokenizer:
    """Captions -> token ids, padded and truncated to the model's `model_max_length`, by the
    tokenizer's Rust backend. The loader and the shard step (which can store the ids in the
    shards) both tokenize with this, so stored ids are the ones the loader would make."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        from tokenizers import Tokenizer

        fast = fast_tokenizer(tokenizer)
        self.max_length = int(tokenizer.model_max_length)
        # A private copy of the backend: padding and truncation are set on it once, instead
        # of being re-applied by the Python wrapper on every call.
        backend = Tokenizer.from_str(fast.backend_tokenizer.to_str())
        backend.enable_truncation(self.max_length)
        backend.enable_padding(
            length=self.max_length, pad_id=fast.pad_token_id, pad_token=fast.pad_token
        )
        self.backend = backend

    def __call__(self, captions: list[str]) -> torch.Tensor:
        """Token ids (len(captions), max_length), int64."""
        # One caption at a time on this thread: `encode_batch` hands the batch to a Rayon
        # thread pool, whose wake-up costs more than the work here (measured 42 vs 17 us per
        # caption between decodes) and which oversubscribes the cores loader workers share.
        enc = self.backend.encode
        return torch.tensor([enc(c).ids for c in captions], dtype=torch.int64)
