"""A stage's export: the diffusers pipeline in `final/`, the raw UNet beside it when EMA is on,
and `manifest.json` last.

The pipeline's format is written by one function (`write_pipeline`): the stage's `final/`
export and the sample grids' temporary exports (`models.evaluation.sample_grid`) are the same
bytes for the same weights, so a grid shows what `kiln evaluate` will load. `export_stage`
writes a finished stage crash-safely, once the ranks are shown to hold the same weights.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from accelerate.utils import DistributedType
from diffusers import StableDiffusionPipeline
from diffusers.training_utils import EMAModel

from models.components.factory import Components, sampling_scheduler
from models.components.sharding import is_sharded, local_tensor, whole_unet

__all__ = [
    "check_identical_weights",
    "export_stage",
    "export_unet",
    "state_dict_sha256",
    "write_pipeline",
]

log = logging.getLogger("kiln.train")


def write_pipeline(comps: Components, unet: torch.nn.Module, path: Path) -> None:
    """Write the fp32 diffusers pipeline of `unet` and the frozen components to `path`,
    replacing whatever is there (a stale copy left by a killed launch included).

    The VAE and text encoder are cast to fp32 in place, the export's dtype: a caller that
    goes on training casts them back to the training dtype.
    """
    pipe = StableDiffusionPipeline(
        vae=comps.vae.to(torch.float32),
        text_encoder=comps.text_encoder.to(torch.float32),
        tokenizer=comps.tokenizer,
        unet=unet.to(torch.float32),
        scheduler=sampling_scheduler(comps.noise_scheduler),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    shutil.rmtree(path, ignore_errors=True)
    pipe.save_pretrained(path)


def export_unet(unet: torch.nn.Module, ema: EMAModel | None) -> torch.nn.Module:
    """The UNet an export holds: a copy carrying the EMA weights when EMA is on (the training
    UNet keeps its raw weights untouched), else `unet` itself."""
    if ema is None:
        return unet
    copied = copy.deepcopy(unet)
    ema.copy_to(copied.parameters())
    return copied


def state_dict_sha256(module: torch.nn.Module) -> str:
    """sha256 over a module's state dict (names, dtypes, shapes and bytes, in order): equal
    digests mean bit-identical tensors."""
    h = hashlib.sha256()
    for name, t in module.state_dict().items():
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _param_checksum(module: torch.nn.Module) -> float:
    """The sum of this process's weights (its own shards when the UNet is sharded)."""
    return float(sum(local_tensor(p.detach()).double().sum().item() for p in module.parameters()))


def check_identical_weights(checksums: list[float]) -> None:
    """Raise unless every DDP rank's weight checksum is the same, bit for bit.

    Exact, not within a tolerance: DDP starts every rank from rank 0's weights and all-reduces
    the gradients, so each rank applies the same update to the same values and the same
    float64 sum over them gives the same bits. Any difference means a rank trained apart.

    Raises:
        RuntimeError: naming each rank's checksum.
    """
    if any(c != checksums[0] for c in checksums):  # NaN != NaN: NaN weights fail too
        ranks = ", ".join(f"rank {i}: {c!r}" for i, c in enumerate(checksums))
        raise RuntimeError(
            f"the {len(checksums)} ranks hold different UNet weights at export ({ranks}); "
            "DDP keeps them identical, so a rank trained apart from the others. Nothing was "
            "exported."
        )


def _replace_dir(src: Path, dst: Path) -> None:
    # A kill between the two leaves `src` only; the relaunch rewrites it and comes back here.
    shutil.rmtree(dst, ignore_errors=True)
    src.rename(dst)


def export_stage(
    out: Path,
    accelerator,
    comps: Components,
    ema: EMAModel | None,
    manifest: Callable[[list[float]], dict],
    faults,
) -> None:
    """Export the pipeline (EMA weights when enabled) to `out/final`, the raw UNet beside it,
    and `out/manifest.json` last. Crash-safe at every point: folders are written under a
    temporary name and replace any stale copy; the manifest is renamed into place, and is the
    only marker of a complete stage, so a launch killed mid-export just exports again. A
    collective: every rank calls it; only the main process writes.

    Args:
        out: The stage folder.
        accelerator: The stage's Accelerator.
        comps: The stage's components, the prepared UNet among them.
        ema: The UNet's EMA, or None.
        manifest: The manifest's contents, given every rank's weight checksum.
        faults: The stage file's fault points (`models.training.faults.Faults`): `at(point,
            ...)` is called at each of the export's named points.

    Raises:
        RuntimeError: when DDP ranks hold different weights (nothing is exported).
    """
    accelerator.wait_for_everyone()
    unet, checksums = _agreed_unet(accelerator, comps, faults)
    if not accelerator.is_main_process:
        return
    export = export_unet(unet, ema)
    if ema is not None:
        raw_tmp = out / ".final-raw.tmp"
        shutil.rmtree(raw_tmp, ignore_errors=True)
        unet.save_pretrained(raw_tmp / "unet")
        _replace_dir(raw_tmp, out / "final-raw")
        faults.at("export:after_raw")
    tmp = out / ".final.tmp"
    write_pipeline(comps, export, tmp)
    faults.at("export:after_final_tmp")
    _replace_dir(tmp, out / "final")
    faults.at("export:after_final")
    manifest_tmp = out / ".manifest.json.tmp"
    manifest_tmp.write_text(json.dumps(manifest(checksums), indent=2))
    faults.at("export:after_manifest_tmp")
    manifest_tmp.replace(out / "manifest.json")
    log.info("exported %s", out / "final")


def _agreed_unet(accelerator, comps, faults) -> tuple[torch.nn.Module | None, list[float]]:
    """The full trained UNet (on the main process; None under FSDP elsewhere) and every rank's
    weight checksum, once the ranks are shown to agree. A collective: every rank calls it.

    Raises:
        RuntimeError: when DDP ranks hold different weights.
    """
    unet = accelerator.unwrap_model(comps.unet)
    if is_sharded(unet):  # Kiln's FSDP: the shards' checksums; the whole UNet on the main one
        sums = accelerator.gather(
            torch.tensor([_param_checksum(unet)], device=accelerator.device, dtype=torch.float64)
        )
        return whole_unet(unet, everywhere=False), [float(x) for x in sums.cpu().tolist()]
    faults.at("weights", unet, rank=accelerator.process_index)
    # Every rank reports a checksum of its weights: DDP must have kept them identical.
    sums = accelerator.gather(
        torch.tensor([_param_checksum(unet)], device=accelerator.device, dtype=torch.float64)
    )
    checksums = [float(x) for x in sums.cpu().tolist()]
    if accelerator.distributed_type != DistributedType.FSDP:
        # FSDP ranks hold different shards; every rank checks, so all raise together.
        check_identical_weights(checksums)
        return unet, checksums
    # Under FSDP each rank holds shards: gather the full state dict (a collective, so every
    # rank calls it) and rebuild a plain UNet from it on the main process.
    full_state = accelerator.get_state_dict(comps.unet)
    if not accelerator.is_main_process:
        return None, checksums
    plain = type(unet).from_config(unet.config)
    plain.load_state_dict(full_state)
    return plain, checksums
