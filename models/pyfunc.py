"""The MLflow pyfunc wrapper: `mlflow.pyfunc.load_model("models:/kiln-t2i@candidate")`.

`predict` takes a DataFrame with a `prompt` column and returns one row per prompt with the
PNG bytes of the generated image, its width and height. Optional params:
`num_inference_steps`, `guidance_scale`, `seed`, `height`, `width`. A prompt longer than the
text encoder reads is cut first (`models.tokenization.truncate_prompts`); the output keeps it
as given.
"""

from __future__ import annotations

import io

import mlflow.pyfunc
import pandas as pd

__all__ = ["KilnDiffusionModel", "signature"]

DEFAULT_PARAMS = {
    "num_inference_steps": 25,
    "guidance_scale": 7.5,
    "seed": 0,
    "height": 0,
    "width": 0,
}


def signature():
    """Input: `prompt` strings. Output: prompt, PNG bytes, width, height. Params as above."""
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
                ParamSpec("num_inference_steps", "long", 25),
                ParamSpec("guidance_scale", "double", 7.5),
                ParamSpec("seed", "long", 0),
                ParamSpec("height", "long", 0),
                ParamSpec("width", "long", 0),
            ]
        ),
    )


class KilnDiffusionModel(mlflow.pyfunc.PythonModel):
    """Wraps the exported diffusers `StableDiffusionPipeline` (artifact `pipeline`)."""

    def load_context(self, context) -> None:
        import torch
        from diffusers import StableDiffusionPipeline

        self.pipe = StableDiffusionPipeline.from_pretrained(context.artifacts["pipeline"])
        self.pipe.set_progress_bar_config(disable=True)
        if torch.cuda.is_available():
            self.pipe.to("cuda")

    def predict(
        self, context, model_input: pd.DataFrame, params: dict | None = None
    ) -> pd.DataFrame:
        import torch

        from models.tokenization import truncate_prompts

        if not isinstance(model_input, pd.DataFrame) or "prompt" not in model_input.columns:
            got = (
                list(model_input.columns)
                if isinstance(model_input, pd.DataFrame)
                else type(model_input).__name__
            )
            raise ValueError(f"predict needs a DataFrame with a 'prompt' column; got {got}")
        p = {**DEFAULT_PARAMS, **(params or {})}
        prompts = [str(x) for x in model_input["prompt"].tolist()]
        size = {k: int(p[k]) for k in ("height", "width") if int(p[k]) > 0}
        gens = [torch.Generator("cpu").manual_seed(int(p["seed"]) + i) for i in range(len(prompts))]
        images = self.pipe(
            truncate_prompts(self.pipe.tokenizer, prompts),
            num_inference_steps=int(p["num_inference_steps"]),
            guidance_scale=float(p["guidance_scale"]),
            generator=gens,
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
