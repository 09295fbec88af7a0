"""The MLflow pyfunc wrapper: `mlflow.pyfunc.load_model("models:/kiln-t2i@candidate")`.

`predict` takes a DataFrame with a `prompt` column and returns one row per prompt with the
PNG bytes of the generated image, its width and height. Optional params:
`num_inference_steps`, `guidance_scale`, `seed` (row i uses seed + i), `height`, `width`,
`batch_size` (prompts per pipeline call, so a 500-row frame does not run out of memory). The
steps and guidance default to what the model was evaluated with (`evaluate.num_inference_steps`
and `evaluate.guidance_scale`): registration passes them in (`KilnDiffusionModel(steps,
guidance)`), since this module reads no config, and the signature's params show them. A prompt
longer than the text encoder reads is cut first (`truncate_prompts`); the output keeps it as
given. On CUDA the pipeline runs in bfloat16 (float16 where bf16 is unsupported); on CPU in
float32.

One request cannot take the GPU: a request is refused, naming what is over, past `LIMITS` (a
height or width that is not 0 or a multiple of 8 from 64 to 2048, more than 200 steps, a batch
over 16), past `MAX_ROWS` prompts or `MAX_PROMPT_CHARS` characters a prompt, or past the work
one request may ask for (`MAX_WORK`: prompts x steps x pixels, 64 images of 50 steps at 512
px) and one pipeline call may hold (`MAX_BATCH_PIXELS`: 16 images at 512 px); a client sends
more in several requests.

This module is the only Kiln code a registered model ships (`code_paths`), under a name no
consumer's package can shadow: it imports nothing else from Kiln.
"""

from __future__ import annotations

import io
import logging
from typing import TYPE_CHECKING

import mlflow.pyfunc
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

__all__ = [
    "LIMITS",
    "MAX_BATCH_PIXELS",
    "MAX_PROMPT_CHARS",
    "MAX_ROWS",
    "MAX_WORK",
    "SERVING_PARAMS",
    "KilnDiffusionModel",
    "checked_params",
    "default_params",
    "load_pipeline",
    "signature",
    "truncate_prompts",
]

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("kiln.pyfunc")

SERVING_PARAMS = {"seed": 0, "height": 0, "width": 0, "batch_size": 4}
"""The params no config section holds: they belong to serving (height and width 0: the
model's own size)."""


LIMITS = {
    "num_inference_steps": (1, 200),
    "guidance_scale": (0.0, 50.0),
    "seed": (0, 2**63 - 1),
    "height": (0, 2048),  # 0, or a multiple of 8 from 64
    "width": (0, 2048),
    "batch_size": (1, 16),
}
"""Each param's allowed range; a request outside it is refused."""

MAX_ROWS = 64
"""Prompts in one request at most."""
MAX_PROMPT_CHARS = 2000
"""Characters of one prompt at most (the text encoder reads 77 tokens of it)."""
MAX_BATCH_PIXELS = 16 * 512 * 512
"""Pixels one pipeline call denoises at once (`batch_size` images), at most."""
MAX_WORK = 64 * 50 * 512 * 512
"""Prompts x steps x pixels of one request, at most."""


def checked_params(params: dict, prompts: list[str], native_side: int) -> dict:
    """`params` when every value is within `LIMITS`, the prompts within `MAX_ROWS` and
    `MAX_PROMPT_CHARS`, and the request within `MAX_BATCH_PIXELS` and `MAX_WORK`.

    Args:
        params: The request's params, every default filled in.
        prompts: Its prompts.
        native_side: The model's own image side (the size of a height or width of 0).

    Raises:
        ValueError: naming the first value out of range, its range and the value received.
    """
    rows = len(prompts)
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"a request holds 1 to {MAX_ROWS} prompts, got {rows}")
    longest = max(len(p) for p in prompts)
    if longest > MAX_PROMPT_CHARS:
        raise ValueError(f"a prompt holds {MAX_PROMPT_CHARS} characters at most, got {longest}")
    for name, (low, high) in LIMITS.items():
        value = params[name]
        if not low <= value <= high:
            raise ValueError(f"params.{name} must be in [{low}, {high}], got {value}")
    for name in ("height", "width"):
        value = params[name]
        if value and (value < 64 or value % 8):
            raise ValueError(
                f"params.{name} must be 0 (the model's own size) or a multiple of 8 from 64, "
                f"got {value}"
            )
    pixels = (params["height"] or native_side) * (params["width"] or native_side)
    if params["batch_size"] * pixels > MAX_BATCH_PIXELS:
        raise ValueError(
            f"params.batch_size x height x width must be at most {MAX_BATCH_PIXELS} pixels (16 "
            f"images at 512 px), got {params['batch_size']} x {pixels}"
        )
    work = rows * params["num_inference_steps"] * pixels
    if work > MAX_WORK:
        raise ValueError(
            f"prompts x num_inference_steps x pixels must be at most {MAX_WORK} (64 images of 50 "
            f"steps at 512 px), got {rows} x {params['num_inference_steps']} x {pixels}: send "
            "fewer prompts a request"
        )
    return params


def default_params(num_inference_steps: int, guidance_scale: float) -> dict[str, int | float]:
    """Every param's default: the evaluation's steps and guidance, then `SERVING_PARAMS`."""
    return {
        "num_inference_steps": int(num_inference_steps),
        "guidance_scale": float(guidance_scale),
        **SERVING_PARAMS,
    }


def signature(defaults: dict[str, int | float]):
    """Input: `prompt` strings. Output: prompt, PNG bytes, width, height. Params as above,
    with `defaults` (`default_params`) as their defaults."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    return ModelSignature(
        inputs=Schema([ColSpec("string", "prompt")]),
        outputs=Schema(
            [
                ColSpec("string", "prompt"),
                ColSpec("binary", "image"),
                ColSpec("long", "width"),
                ColSpec("long", "height"),
            ]
        ),
        params=ParamSchema(
            [
                ParamSpec(name, "double" if isinstance(v, float) else "long", v)
                for name, v in defaults.items()
            ]
        ),
    )


def load_pipeline(path: str):
    """The exported StableDiffusionPipeline at `path`: bf16 (fp16 without bf16) on CUDA,
    float32 on CPU, progress bars off."""
    import torch
    from diffusers import StableDiffusionPipeline

    dtype = torch.float32
    if torch.cuda.is_available():
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    pipe = StableDiffusionPipeline.from_pretrained(path, torch_dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to("cuda") if torch.cuda.is_available() else pipe


class KilnDiffusionModel(mlflow.pyfunc.PythonModel):
    """Wraps the exported diffusers `StableDiffusionPipeline` (artifact `pipeline`).

    Args:
        num_inference_steps: Default denoising steps of `predict`.
        guidance_scale: Default classifier-free guidance of `predict`.
    """

    def __init__(self, num_inference_steps: int, guidance_scale: float) -> None:
        self.defaults = default_params(num_inference_steps, guidance_scale)

    def load_context(self, context) -> None:
        self.pipe = load_pipeline(context.artifacts["pipeline"])

    def predict(
        self, context, model_input: pd.DataFrame, params: dict | None = None
    ) -> pd.DataFrame:
        import torch

        if not isinstance(model_input, pd.DataFrame) or "prompt" not in model_input.columns:
            got = (
                list(model_input.columns)
                if isinstance(model_input, pd.DataFrame)
                else type(model_input).__name__
            )
            raise ValueError(f"predict needs a DataFrame with a 'prompt' column; got {got}")
        p = {**self.defaults, **(params or {})}
        p = {k: (float(v) if k == "guidance_scale" else int(v)) for k, v in p.items()}
        prompts = [str(x) for x in model_input["prompt"].tolist()]
        unet, scale = self.pipe.unet.config, self.pipe.vae_scale_factor
        try:
            checked_params(p, prompts, int(unet.sample_size) * int(scale))
        except ValueError as e:  # the scoring server answers 400 with the message
            raise MlflowException(str(e), error_code=INVALID_PARAMETER_VALUE) from e
        size = {k: p[k] for k in ("height", "width") if p[k] > 0}
        batch = p["batch_size"]
        fed = truncate_prompts(self.pipe.tokenizer, prompts)
        images = []
        for start in range(0, len(prompts), batch):
            # One generator per row: an image depends on its seed, never on the batching.
            idx = range(start, min(start + batch, len(prompts)))
            images += self.pipe(
                [fed[i] for i in idx],
                num_inference_steps=p["num_inference_steps"],
                guidance_scale=p["guidance_scale"],
                generator=[torch.Generator("cpu").manual_seed(p["seed"] + i) for i in idx],
                **size,
            ).images
        rows = []
        for prompt, img in zip(prompts, images, strict=True):
            buf = io.BytesIO()
            img.save(buf, format="PNG")
            rows.append(
                {
                    "prompt": prompt,
                    "image": buf.getvalue(),
                    "width": img.width,
                    "height": img.height,
                }
            )
        return pd.DataFrame(rows, columns=["prompt", "image", "width", "height"])


def _token_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    # verbose=False: no "sequence length is longer than the specified maximum" warning either.
    return tokenizer(text, add_special_tokens=False, verbose=False).input_ids


def truncate_prompts(tokenizer: PreTrainedTokenizerBase, prompts: list[str]) -> list[str]:
    """Each prompt cut to the tokenizer's `model_max_length` (start and end tokens included),
    so that the pipeline's own truncation has nothing left to cut or warn about.

    A prompt that fits is returned unchanged. A long one becomes the decoded text of its
    first tokens: the tokens the pipeline would have kept (CLIP's tokenizer lower-cases and
    normalises spaces anyway), except that a word cut mid-way now ends as a word. One log
    line counts the cut prompts.
    """
    limit = int(tokenizer.model_max_length) - tokenizer.num_special_tokens_to_add()
    out, cut = [], 0
    for prompt in prompts:
        ids = _token_ids(tokenizer, prompt)
        if len(ids) <= limit:
            out.append(prompt)
            continue
        keep = limit
        text = tokenizer.decode(ids[:keep], skip_special_tokens=True)
        # A word cut mid-way can re-tokenize into more pieces (BPE merges differ at a word's
        # end): keep fewer tokens until the text fits.
        while keep > 0 and len(_token_ids(tokenizer, text)) > limit:
            keep -= 1
            text = tokenizer.decode(ids[:keep], skip_special_tokens=True)
        out.append(text)
        cut += 1
    if cut:
        log.info(
            "%d of %d prompts cut to the text encoder's %d tokens",
            cut,
            len(prompts),
            tokenizer.model_max_length,
        )
    return out
