"""Training throughput of one stage through the real training loop, on this machine.

Runs `models.measure_throughput.measure_stage` (build_models, build_dataloader and train_loop from
`models.train` on a synthetic MDS dataset at the stage's resolution; one device) and writes
JSON with `img_per_s`, `mfu`, `data_wait_frac` and `peak_mem_gb`. The baseline measured in the
same run is the same stage with the speed options off (eager attention, no channels_last, no
compile), so `speedup_vs_baseline` says what the options buy on this device.

    python benchmarks/train_throughput.py --out benchmarks/results/train_throughput_cpu.json
    python benchmarks/train_throughput.py --config configs/sd2-base.yaml --stage 0 \\
        --random-encoders --compile --out benchmarks/results/train_throughput_h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# SD2's frozen encoders as config dicts (OpenCLIP-H text tower, SD VAE), for machines that
# cannot download them: throughput does not depend on the weights.
SD2_VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 4,
    "sample_size": 768,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
}
SD2_TEXT = {
    "vocab_size": 49408,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 23,
    "num_attention_heads": 16,
    "max_position_embeddings": 77,
    "hidden_act": "gelu",
    "projection_dim": 1024,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON output path")
    p.add_argument("--config", default=str(REPO / "configs" / "tiny.yaml"))
    p.add_argument("--stage", type=int, default=0, help="Stage index")
    p.add_argument("--steps", type=int, default=12, help="Optimizer steps (half are measured)")
    p.add_argument("--batch-size", type=int, default=None, help="Override the stage's batch")
    p.add_argument("--compile", action="store_true", help="Also torch.compile the UNet")
    p.add_argument("--random-encoders", action="store_true", help="SD2 encoders from configs")
    p.add_argument("--no-baseline", action="store_true", help="Skip the eager baseline")
    args = p.parse_args()

    from kiln_config import load_config
    from models.measure_throughput import measure_stage

    cfg = load_config(args.config).train
    if args.random_encoders:
        from kiln_config import Component, TokenizerConfig

        cfg.model.vae = Component(config=SD2_VAE)
        cfg.model.text_encoder = Component(config=SD2_TEXT)
        cfg.model.tokenizer = TokenizerConfig(builtin="bytes")
        cfg.model.text_encoder.config["vocab_size"] = 514
        cfg.model.text_encoder.config.update(bos_token_id=512, eos_token_id=513, pad_token_id=513)
    if args.batch_size:
        stage = cfg.stages[args.stage]
        cfg.stages[args.stage] = stage.model_copy(update={"batch_size": args.batch_size})
    fast = cfg.model_copy(
        update={"attention": "sdpa", "channels_last": True, "compile": args.compile}
    )
    result = measure_stage(fast, args.stage, steps=args.steps)
    out = {
        "benchmark": "train_throughput",
        "config": str(args.config),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "options": {"attention": "sdpa", "channels_last": True, "compile": args.compile},
        **result,
    }
    if not args.no_baseline:
        slow = cfg.model_copy(
            update={"attention": "eager", "channels_last": False, "compile": False}
        )
        base = measure_stage(slow, args.stage, steps=args.steps)
        out["baseline"] = {k: base[k] for k in ("img_per_s", "mfu", "data_wait_frac")}
        out["speedup_vs_baseline"] = round(result["img_per_s"] / base["img_per_s"], 3)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))  # noqa: T201 - a benchmark script reports on stdout


if __name__ == "__main__":
    main()
