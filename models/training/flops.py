"""Performance accounting for training: FLOPs per sample, device peak, MFU, device stats.

FLOPs are counted once per stage with `torch.utils.flop_counter.FlopCounterMode` on *meta*
copies of the models (no memory, no compute): one sample through the frozen VAE encoder and
text encoder (when latents are not precomputed) plus the UNet's forward and backward. MFU is
then achieved FLOP/s over the peak of the devices in use (Chowdhery et al., PaLM, App. B).
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["device_peak_flops", "device_stats", "train_flops_per_sample"]

# Dense bf16/fp16 tensor-core peaks (FLOP/s), from the vendors' data sheets.
_GPU_PEAKS = {
    "H200": 989e12,
    "H100": 989e12,  # SXM; the PCIe card is 756e12
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10": 125e12,
    "V100": 125e12,
}


def train_flops_per_sample(
    unet_config: dict,
    vae=None,
    text_encoder=None,
    resolution: int = 256,
    latent_channels: int = 4,
    vae_scale: int = 8,
    seq_len: int = 77,
) -> float:
    """FLOPs of one training sample: encoders forward (if given) + UNet forward and backward."""
    from diffusers import UNet2DConditionModel

    lat = resolution // vae_scale
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(unet_config)
        x = torch.randn(1, latent_channels, lat, lat)
        hidden = torch.randn(1, seq_len, unet.config.cross_attention_dim)
        t = torch.tensor([500])
    flops = 0.0
    with FlopCounterMode(display=False) as fc:
        unet(x, t, hidden).sample.float().pow(2).mean().backward()
    flops += fc.get_total_flops()
    for enc, make in (
        (vae, lambda: (torch.randn(1, 3, resolution, resolution, device="meta"),)),
        (text_encoder, lambda: (torch.zeros(1, seq_len, dtype=torch.long, device="meta"),)),
    ):
        if enc is None:
            continue
        with torch.device("meta"):
            meta = type(enc).from_config(enc.config) if hasattr(enc, "from_config") else None
            if meta is None:
                meta = type(enc)(enc.config)
        fwd = meta.encode if hasattr(meta, "encode") else meta
        with FlopCounterMode(display=False) as fc, torch.no_grad():
            fwd(*make())
        flops += fc.get_total_flops()
    return float(flops)


def _cpu_matmul_peak() -> float:
    """Measured fp32 matmul FLOP/s of this process on CPU: the practical CPU peak, over a
    0.2 s window (every launched process pays it)."""
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    reps, t = 0, time.perf_counter()
    while time.perf_counter() - t < 0.2:
        a @ b
        reps += 1
    return 2 * n**3 * reps / (time.perf_counter() - t)


def device_peak_flops(
    device: torch.device, override_tflops: float | None = None
) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the figure came from)."""
    if override_tflops:
        return override_tflops * 1e12, "train.peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in _GPU_PEAKS.items():
            if key in name:
                return peak, f"data sheet ({name}, bf16 dense)"
        return float("nan"), f"unknown GPU {name}: set train.peak_tflops"
    return _cpu_matmul_peak(), "measured fp32 matmul on this CPU"


def device_stats(device: torch.device) -> dict[str, float]:
    """Peak memory (GB) and, with NVML, utilisation (%) of this process's GPU."""
    if device.type != "cuda":
        return {}
    stats = {"gpu_mem_peak_gb": torch.cuda.max_memory_allocated(device) / 1e9}
    with contextlib.suppress(Exception):  # NVML (pynvml) is optional
        stats["gpu_util_pct"] = float(torch.cuda.utilization(device))
    return stats
