"""The GPU check's measurements: the bf16 matmul rate, the SD2-base UNet's training step, and
the loader at 256 px.

Run by `benchmarks/gpu_check.py`, each in its own process with a time box:

    python benchmarks/gpu_check_unet.py matmul --result FILE [--toy]
    python benchmarks/gpu_check_unet.py unet --result FILE --variants 256:ddp:cl,... [--toy]
    python benchmarks/gpu_check_unet.py loader --work DIR --result FILE [--toy]

`unet` trains `configs/sd2-base.yaml`'s UNet (random weights, real size) on random latents
and text states in bf16 autocast with fused AdamW, one process, wrapped in DDP or in FSDP
`SHARD_GRAD_OP` (world size 1: no gradient traffic, but FSDP's own flattening, casts and
hooks, so a memory and speed figure), eager or `torch.compile`d, with or without
channels_last. Each variant records img/s over timed steps after warm-up, peak memory, the
compile time and the SDPA kernels the step ran (from the profiler). Results are appended one
JSON line per variant, so a variant cut off by the time box leaves the earlier ones.
With `--toy` (no CUDA) the UNet is the tiny preset's at a quarter of each side, the batches are
tiny, and `torch.compile` uses the `aot_eager` backend (the same graph capture, no codegen).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the device machine has Kiln's dependencies, not Kiln installed

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
# Per-process batch at each resolution: the same pixels per step at 256 and 512 px.
BATCH = {True: {256: 2, 512: 1}, False: {256: 64, 512: 16}}
STEPS = {True: (1, 1), False: (3, 10)}  # (warm-up, timed) optimizer steps


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def matmul_rate(toy: bool) -> dict:
    """bf16 matmul FLOP/s of this device: the median of timed products after warm-up, on
    random data (zeros run faster and would overstate the ceiling)."""
    n = 512 if toy else 8192
    a, b = (torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(5 if toy else 20):
        _sync()
        t = time.perf_counter()
        a @ b
        _sync()
        times.append(time.perf_counter() - t)
    median = sorted(times)[len(times) // 2]
    return {"n": n, "dtype": "bf16", "tflops": round(2 * n**3 / median / 1e12, 3)}


def _peak_mem() -> float:
    """Peak bytes: the GPU's allocated memory, or on a CPU the process's peak resident set
    (every variant so far; Linux reports KiB)."""
    if CUDA:
        return torch.cuda.max_memory_allocated()
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _unet_config(toy: bool) -> dict:
    import yaml

    preset = "tiny.yaml" if toy else "sd2-base.yaml"
    return yaml.safe_load((REPO / "configs" / preset).read_text())["train"]["model"]["unet"]


def _init_group() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        f = tempfile.mkstemp(prefix="kiln-gpu-check-pg-")[1]
        os.unlink(f)
        dist.init_process_group(
            "nccl" if CUDA else "gloo", init_method=f"file://{f}", rank=0, world_size=1
        )


def _wrap(unet, wrapper: str):
    """DDP or FSDP SHARD_GRAD_OP (Accelerate's fsdp.yaml settings) at world size 1."""
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy
    from torch.nn.parallel import DistributedDataParallel

    if wrapper == "ddp":
        return DistributedDataParallel(unet, device_ids=[0] if CUDA else None)
    policy = size_based_auto_wrap_policy
    return FullyShardedDataParallel(
        unet,
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
        use_orig_params=True,
        auto_wrap_policy=lambda *a, **k: policy(*a, **k, min_num_params=1_000_000),
        device_id=DEVICE,
    )


def _attention_kernels(step) -> list[str]:
    """The scaled-dot-product attention ops one training step ran (profiler op names)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
        _sync()
    return sorted({e.key for e in prof.key_averages() if "scaled_dot_product" in e.key})


def unet_variant(res: int, wrapper: str, channels_last: bool, compiled: bool, toy: bool) -> dict:
    """One training-step measurement of the UNet at `res` px (see the module docstring)."""
    from diffusers import UNet2DConditionModel

    from models.training.flops import train_flops_per_sample

    cfg = _unet_config(toy)
    batch, (warm, timed) = BATCH[toy][res], STEPS[toy]
    preset_res, res = res, res // 4 if toy else res  # toy: a quarter of the side, in seconds
    lat = res // 8
    torch.manual_seed(0)
    with DEVICE:  # initialised where it trains: seconds less for 865.9M parameters on a GPU
        unet = UNet2DConditionModel.from_config(cfg).train()
    if channels_last:
        unet.to(memory_format=torch.channels_last)
    model = _wrap(unet, wrapper)
    # As models/train.py's fused_adamw: FSDP hands channels_last parameters contiguous
    # gradients, which the fused kernel refuses.
    fused = CUDA and not (wrapper == "fsdp" and channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(batch, 4, lat, lat, device=DEVICE).contiguous(memory_format=fmt)
    text = torch.randn(batch, 77, cfg["cross_attention_dim"], device=DEVICE)
    t = torch.randint(0, 1000, (batch,), device=DEVICE)
    target = torch.randn_like(x)
    # Toy: Dynamo and AOTAutograd trace the step as on the GPU, without Inductor's minutes
    # of C++ compilation on a CPU.
    backend = "aot_eager" if toy else "inductor"
    fwd = torch.compile(model, backend=backend) if compiled else model

    def step():
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            pred = fwd(x, t, text).sample
        loss = torch.nn.functional.mse_loss(pred.float(), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    step()  # the first step: compilation, allocator warm-up
    _sync()
    first_s = time.perf_counter() - t0
    kernels = _attention_kernels(step)  # a warm-up step, profiled
    for _ in range(warm - 2):
        step()
    _sync()
    t0 = time.perf_counter()
    for _ in range(timed):
        step()
    _sync()
    secs = time.perf_counter() - t0
    flops = train_flops_per_sample(cfg, resolution=res, latent_channels=4, vae_scale=8)
    out = {
        "resolution": res,
        "preset_resolution": preset_res,
        "wrapper": wrapper,
        "channels_last": channels_last,
        "compile": compiled,
        "compile_backend": backend if compiled else None,
        "batch": batch,
        "timed_steps": timed,
        "optimizer": "fused" if fused else "foreach",
        "img_per_s": round(batch * timed / secs, 3),
        "first_step_s": round(first_s, 2),
        "flops_per_sample": flops,
        "attention_kernels": kernels,
        "peak_mem_gb": round(_peak_mem() / 1e9, 3),
        "params_m": round(sum(p.numel() for p in unet.parameters()) / 1e6, 1),
    }
    return out


def _free() -> None:
    """Give back the last variant's memory (its step closure holds a reference cycle) and
    compiled graphs before the next one."""
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
    torch._dynamo.reset()


def loader_rate(work: Path, toy: bool) -> dict:
    """Kiln's streaming loader at 256 px with one worker per core, at the sd2-base stage's
    per-process batch: steady samples/s over two epochs (benchmarks/loader.py's timing). The
    images are random noise, the decoder's worst case: photos decode faster."""
    import yaml
    from loader import _time_loader  # benchmarks/loader.py: its steady-state timing

    from kiln_config import load_config
    from models.components.factory import build_tokenizer
    from models.data.loader import build_loader
    from models.measure_throughput import write_synthetic_shards

    train = load_config(REPO / "configs" / "tiny.yaml").train
    workers = os.cpu_count() or 1
    batch = (
        8
        if toy
        else yaml.safe_load((REPO / "configs" / "sd2-base.yaml").read_text())["train"]["stages"][0][
            "batch_size"
        ]
    )
    n = batch * (4 if toy else 12)
    t = time.perf_counter()
    write_synthetic_shards(work / "loader-256", 256, n, size_limit=1 << 24)
    shards_s = time.perf_counter() - t
    train = train.model_copy(update={"num_workers": workers})
    loader = build_loader(
        train, str(work / "loader-256"), build_tokenizer(train.model.tokenizer), 256, batch
    )
    timing = _time_loader(loader, epochs=2)
    loader.dataset.release()
    return {
        "resolution": 256,
        "workers": workers,
        "batch": batch,
        "images": n,
        "samples_per_s": round(timing["n"] / timing["seconds"], 1),
        "startup_s": timing["startup_s"],
        "shards_s": round(shards_s, 2),
        "pin_memory": bool(loader.pin_memory),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("step", choices=["matmul", "unet", "loader"])
    p.add_argument("--result", required=True, help="JSON (matmul, loader) or JSON lines (unet)")
    p.add_argument("--work", default=tempfile.gettempdir(), help="Scratch folder (loader)")
    p.add_argument("--variants", default="", help="res:ddp|fsdp:cl|plain[:compile],...")
    p.add_argument("--toy", action="store_true", help="Tiny UNet and batches (CPU)")
    a = p.parse_args()
    if a.step == "matmul":
        Path(a.result).write_text(json.dumps(matmul_rate(a.toy)))
    elif a.step == "loader":
        Path(a.result).write_text(json.dumps(loader_rate(Path(a.work), a.toy)))
    else:
        _init_group()
        for v in a.variants.split(","):
            res, wrapper, layout, *rest = v.split(":")
            try:
                rec = unet_variant(int(res), wrapper, layout == "cl", rest == ["compile"], a.toy)
            except Exception as e:  # noqa: BLE001 - recorded (an OOM, say); the next one runs
                rec = {"variant": v, "error": f"{type(e).__name__}: {e}"[:1500]}
            _free()
            with open(a.result, "a") as f:
                f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
