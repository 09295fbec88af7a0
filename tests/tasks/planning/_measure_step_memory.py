"""One real training step's memory on CPU, measured in a fresh process (argv: JSON of
[unet config, batch, latent side, text length, attention,
checkpointing, precision ('no' or 'bf16': CPU autocast)]); prints JSON.

Parameters, gradients and AdamW's state are the tensors' own bytes after a real optimizer
step. Activations are the rise of the process's peak resident memory (Linux VmHWM, reset
through /proc/self/clear_refs) over one forward and backward pass, taken after the weights,
gradients and optimizer state exist; run with MALLOC_MMAP_THRESHOLD_ fixed, so every large
tensor is its own mapping and a freed one leaves the resident set.
"""

import gc
import json
import sys
from pathlib import Path

import torch
from diffusers import UNet2DConditionModel


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def main() -> None:
    cfg, batch, side, seq, attention, checkpointing, precision = json.loads(sys.argv[1])
    torch.manual_seed(0)
    torch.set_num_threads(1)
    unet = UNet2DConditionModel.from_config(cfg)
    unet.train()
    if attention == "eager":
        from diffusers.models.attention_processor import AttnProcessor

        unet.set_attn_processor(AttnProcessor())
    if checkpointing:
        unet.enable_gradient_checkpointing()
    opt = torch.optim.AdamW(unet.parameters(), lr=1e-4)
    for p in unet.parameters():  # gradients and AdamW's moments, with no activations yet
        p.grad = torch.zeros_like(p)
    opt.step()
    x = torch.randn(batch, cfg["in_channels"], side, side)
    t = torch.randint(0, 1000, (batch,))
    text = torch.randn(batch, seq, cfg["cross_attention_dim"])

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = unet(x, t, text).sample.float().square().mean()
        loss.backward()

    step()  # a warm-up: the kernels' one-time caches are not the step's activations
    gc.collect()
    before = _status("VmRSS:")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    step()
    peak = _status("VmHWM:")
    state = [v for s in opt.state.values() for v in s.values() if v.dim() > 0]
    print(
        json.dumps(
            {
                "activations": peak - before,
                "parameters": sum(p.nbytes for p in unet.parameters()),
                "gradients": sum(p.grad.nbytes for p in unet.parameters()),
                "optimizer": sum(v.nbytes for v in state),
            }
        )
    )


if __name__ == "__main__":
    main()
