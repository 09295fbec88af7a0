"""Pre-flight health check, launched with the same topology as training:

    accelerate launch --config_file TOPOLOGY -m models.collective_check --config health.yaml

Every process checks that it sees its device, then all processes all-reduce a tensor of ones;
the sum must equal the world size. The main process writes `health.json` into the run file's
`out_dir` (`kiln_config.HealthCheckRun`). A collective that cannot form (a node missing, a
firewall, a broken NCCL or gloo setup) hangs or fails here, in seconds, instead of after the
model is built; the launching task bounds it with a timeout.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch
from accelerate import Accelerator

from kiln_config import HealthCheckRun, load_yaml_model

__all__ = ["main"]

log = logging.getLogger("kiln.collective_check")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="Run file (kiln_config.HealthCheckRun)")
    run: HealthCheckRun = load_yaml_model(HealthCheckRun, p.parse_args(argv).config)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    dev = accelerator.device
    if dev.type == "cuda":
        # Touch the device: a dead or busy GPU fails here, on this rank, with its name.
        torch.ones(1, device=dev).sum().item()
    t = time.perf_counter()
    total = accelerator.reduce(torch.ones(1, device=dev), reduction="sum").item()
    elapsed = time.perf_counter() - t
    world = accelerator.num_processes
    if total != world:
        raise SystemExit(
            f"health check: all-reduce across {world} processes returned {total:g}, not {world}"
        )
    if accelerator.is_main_process:
        out = Path(run.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        report = {
            "world_size": world,
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "backend": str(accelerator.state.backend),
            "all_reduce_s": round(elapsed, 4),
            "time": time.time(),
        }
        (out / "health.json").write_text(json.dumps(report, indent=2))
        log.info("health check passed: %s", report)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # or a rank can abort at exit with the process group still up


if __name__ == "__main__":
    main()
