"""The held-out loss of an exported stage: a bootstrap CI on its conditioning gap, and a command.

The numbers are the training loop's own (`models.evaluation.heldout`: fixed timesteps,
fixed noise, the stage's validation split), computed again for the UNet of an exported
pipeline:

- `bootstrap_cond_gap` re-evaluates an exported stage and puts a bootstrap CI on its gap;
- `python -m models.heldout_loss` evaluates one UNet on a stage's split (under Accelerate too).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from kiln_config import StageRun, load_yaml_model
from kiln_config.errors import InputError
from models.components.factory import build_components
from models.evaluation.heldout import Validator, build_validator

__all__ = ["bootstrap_cond_gap", "main"]

log = logging.getLogger("kiln.validation")


def _weights_validator(run, weights: str | None) -> Validator:
    """A validator of the stage's split for the UNet in `weights` (an exported pipeline
    folder; None: the config's seeded fresh UNet), in fp32, on this process's device."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    comps = build_components(run.train.model, seed=run.train.seed, init_unet_from=weights)
    for module in (comps.unet, comps.vae, comps.text_encoder):
        module.to(accelerator.device)
    return build_validator(run, accelerator, comps, None, torch.float32)


def bootstrap_cond_gap(
    export_dir: str | Path, manifest: dict, n_boot: int = 2000, level: float = 0.95, seed: int = 0
) -> dict:
    """The conditioning gap of an exported stage, with a bootstrap CI over validation images.

    Evaluates the export's UNet (its EMA weights when EMA was on) on the stage's validation
    split exactly as training did at the stage's end (`<stage>/stage.yaml` gives the split and
    the settings), then resamples the images: each image's gap (averaged over the timesteps)
    is one observation.

    Args:
        export_dir: The stage's `final/` folder; its parent holds `stage.yaml`.
        manifest: The stage's manifest.json; when it holds the end-of-stage numbers, they are
            checked against this evaluation (a warning if they differ).
        n_boot: Bootstrap resamples.
        level: Confidence level of the percentile interval.
        seed: Seed of the resampling.

    Returns:
        {"cond_gap", "ci_low", "ci_high", "n" (images), "level", "weights" ("ema" or "raw")}.

    Raises:
        ValueError: when the stage had no validation split.
    """

    export_dir = Path(export_dir)
    run: StageRun = load_yaml_model(StageRun, export_dir.parent / "stage.yaml")
    if run.val_shards is None:
        raise InputError(
            f"{export_dir.parent / 'stage.yaml'} sets no val_shards: the stage had no "
            "validation split (shards.val_fraction), so there is no gap to test"
        )
    validator = _weights_validator(run, str(export_dir))
    table = validator.tables()["raw"]  # the export's weights, whatever they are
    validator.evalset.close()
    gaps = (table[..., 1] - table[..., 0]).mean(dim=1).numpy()
    rng = np.random.default_rng(seed)
    means = gaps[rng.integers(0, len(gaps), (n_boot, len(gaps)))].mean(axis=1)
    tail = (1 - level) / 2 * 100
    weights = "ema" if manifest.get("ema") else "raw"
    out = {
        "cond_gap": float(gaps.mean()),
        "ci_low": float(np.percentile(means, tail)),
        "ci_high": float(np.percentile(means, 100 - tail)),
        "n": len(gaps),
        "level": level,
        "weights": weights,
    }
    logged = (manifest.get("val") or {}).get(f"{weights}/val/cond_gap")
    if logged is not None and not np.isclose(logged, out["cond_gap"], rtol=1e-4, atol=1e-7):
        log.warning(
            "the export's conditioning gap %.6g differs from the %.6g training logged at "
            "its end (another precision or device?)",
            out["cond_gap"],
            logged,
        )
    return out


def main(argv: list[str] | None = None) -> None:
    """Evaluate one UNet on a stage's validation split, on its own or under Accelerate:

        accelerate launch -m models.heldout_loss --config stage.yaml --weights final --out v.json

    The stage file gives the model, the split (`val_shards`) and the settings; `--weights` is
    an exported pipeline folder (its `unet/`), default the seeded fresh UNet of the config.
    """
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="Resolved stage.yaml (StageRun)")
    parser.add_argument("--weights", help="Exported pipeline folder whose unet/ is evaluated")
    parser.add_argument("--out", required=True, help="JSON file the metrics are written to")
    args = parser.parse_args(argv)
    run: StageRun = load_yaml_model(StageRun, args.config)
    if run.val_shards is None:
        raise SystemExit(f"{args.config} sets no val_shards: there is nothing to evaluate")
    validator = _weights_validator(run, args.weights)
    metrics = validator.evaluate()
    validator.evalset.close()
    if validator.accelerator.is_main_process:
        Path(args.out).write_text(json.dumps(metrics, indent=2))
    validator.accelerator.wait_for_everyone()
    # Without it the process group outlives the interpreter and a rank aborts at exit.
    validator.accelerator.end_training()


if __name__ == "__main__":
    main()
