"""Time per step and scaling efficiency of a stage on N nodes: gradient traffic over the
inter-node network, overlapped with the backward pass.

Per optimizer step, each process computes `batch_size x gradient_accumulation_steps` samples at
its measured or given rate. Its gradients then cross the network once (Accelerate skips the
synchronisation on accumulation micro-batches):

- DDP: a ring all-reduce of the fp32 gradients, 2(N-1)/N x gradient bytes through each node's
  link (N processes in all);
- FSDP SHARD_GRAD_OP: a reduce-scatter of the gradients and an all-gather of the parameters
  for the next forward, (N-1)/N x bytes each, in the compute dtype.

That traffic runs at `launch.inter_node_gbps` per node, overlapped with the last micro-batch's
backward pass (about 2/3 of its compute: a backward costs twice a forward); what does not fit
under it adds to the step, and so does the last 25 MB bucket's share, which can only start once
the backward pass has ended, plus a latency per collective (DDP's buckets; `kiln plan` counts
none: the loopback fit of `fit_loopback` measures gloo over TCP, not NCCL). On one node the
traffic stays on NVLink and is taken as hidden. Efficiency is compute over step time.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["BUCKET_BYTES", "fit_loopback", "global_batch_scaling", "stage_scaling"]

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb
_BACKWARD_SHARE = 2 / 3


def _traffic_bytes(n_params: int, strategy: str, world: int, half: bool) -> float:
    """Bytes each node's link carries per optimizer step."""
    if world <= 1:
        return 0.0
    dtype = 2 if half else 4
    if strategy == "fsdp":
        return 2 * (world - 1) / world * n_params * dtype  # reduce-scatter + all-gather
    if strategy == "full_shard":  # an all-gather for the forward and again for the backward
        return 3 * (world - 1) / world * n_params * dtype
    return 2 * (world - 1) / world * n_params * 4  # ring all-reduce of fp32 gradients


def stage_scaling(
    n_params: int,
    img_per_s_per_device: float,
    batch_size: int,
    accumulation: int,
    nodes: list[int],
    per_node: int,
    *,
    strategy: str = "ddp",
    half: bool = True,
    inter_node_gbps: float = 400.0,
    collective_latency_s: float = 0.0,
) -> list[dict]:
    """Predicted step time and efficiency at each node count.

    Args:
        n_params: UNet parameters.
        img_per_s_per_device: One process's training rate (samples per second).
        batch_size: Samples per process per micro-batch.
        accumulation: Micro-batches per optimizer step.
        nodes: Node counts to predict.
        per_node: Processes (GPUs) per node.
        strategy: `ddp`, `fsdp` (SHARD_GRAD_OP) or `full_shard`.
        half: bf16/fp16 compute (FSDP's collectives in the compute dtype).
        inter_node_gbps: Each node's network bandwidth, Gbit/s.
        collective_latency_s: Fixed cost of each collective.

    Returns:
        Per node count: traffic, compute, communication, exposed time, step time, efficiency.
    """
    compute = batch_size * accumulation / img_per_s_per_device
    window = compute / accumulation * _BACKWARD_SHARE
    out = []
    for n in nodes:
        world = n * per_node
        traffic = _traffic_bytes(n_params, strategy, world, half) if n > 1 else 0.0
        comm = traffic * 8 / (inter_node_gbps * 1e9)
        collectives = -(-n_params * 4 // BUCKET_BYTES) if n > 1 else 0
        # The last bucket is reduced after the backward pass ends: never overlapped.
        last = comm * min(1.0, BUCKET_BYTES / (n_params * 4)) if n > 1 else 0.0
        exposed = max(0.0, comm - window - last) + last + collectives * collective_latency_s
        step = compute + exposed
        out.append(
            {
                "nodes": n,
                "processes": world,
                "traffic_gb": round(traffic / 1e9, 3),
                "compute_s": round(compute, 4),
                "comm_s": round(comm, 4),
                "exposed_s": round(exposed, 4),
                "step_s": round(step, 4),
                "efficiency": round(compute / step, 4),
            }
        )
    return out


def global_batch_scaling(
    n_params: int,
    img_per_s_per_device: float,
    global_batch: int,
    nodes: list[int],
    per_node: int,
    fits: Callable[[int, int], float | None],
    **network,
) -> list[dict]:
    """Step time and efficiency at each node count with the global batch held as written:
    each GPU's share of it shrinks as nodes are added, so less compute hides the same
    gradient traffic. At each point the per-GPU micro-batch is the largest divisor of that
    share that fits memory, and accumulation makes up the rest.

    Efficiency is compute over step time at the per-GPU rate given (taken as independent of
    the micro-batch: a GPU fed a very small batch runs below it, which this leaves out).

    Args:
        n_params: UNet parameters.
        img_per_s_per_device: One GPU's training rate (samples per second).
        global_batch: Samples per optimizer step, all GPUs together.
        nodes: Node counts to predict.
        per_node: GPUs per node.
        fits: `fits(micro_batch, world)`: that micro-batch's memory per GPU in GB when it fits
            at that world size, else None.
        **network: `stage_scaling`'s strategy, half, inter_node_gbps, collective_latency_s.

    Returns:
        Per node count: `stage_scaling`'s fields plus the per-GPU samples, micro-batch,
        accumulation, memory (GB) and the global rate; `split: False` (and no timings) where
        the global batch does not divide evenly over the GPUs or no micro-batch fits.
    """
    out = []
    for n in nodes:
        world = n * per_node
        share, rest = divmod(global_batch, world)
        base = {"nodes": n, "processes": world, "per_device": share}
        micro, gb = None, None
        if share and not rest:
            # Memory grows with the micro-batch: bisect the divisors for the largest that fits.
            divisors = [b for b in range(1, share + 1) if share % b == 0]
            lo, hi = 0, len(divisors) - 1
            while lo <= hi:
                mid = (lo + hi) // 2
                if (got := fits(divisors[mid], world)) is not None:
                    micro, gb, lo = divisors[mid], got, mid + 1
                else:
                    hi = mid - 1
        if micro is None:
            reason = "does not split evenly" if rest or not share else "no micro-batch fits"
            out.append({**base, "split": False, "reason": reason})
            continue
        row = stage_scaling(
            n_params, img_per_s_per_device, micro, share // micro, [n], per_node, **network
        )[0]
        out.append(
            {
                **base,
                **row,
                "split": True,
                "micro_batch": micro,
                "accumulation": share // micro,
                "memory_gb": round(gb, 2),
                "img_per_s": round(global_batch / row["step_s"], 2),
            }
        )
    return out


def fit_loopback(measured: dict, n_params: int, logged_reductions: int = 1) -> dict:
    """Fit the per-collective latency to benchmarks/multinode.py's loopback measurement.

    Both engines run the same 2 processes on one machine; the 2-node engine's collectives cross
    "nodes" (separate SLURM allocations over loopback), the 1-node one's do not. The step time
    difference, over the collectives per step (DDP's gradient buckets plus the logged loss's
    reduction at `log_every` 1), is the latency each inter-node collective adds. With one
    difference and one unknown the fit reproduces the measurement exactly; the per-step fixed
    overhead cannot be told apart from compute without a one-process run, and is left at 0.

    Args:
        measured: The benchmark's `median` (per engine, `step_s`).
        n_params: Parameters of the benchmark's UNet.
        logged_reductions: Other collectives per step (the logged loss).

    Returns:
        The fitted latency, the collectives per step and each engine's predicted step.
    """
    local, slurm = measured["local_1x2"]["step_s"], measured["slurm_2x1"]["step_s"]
    collectives = -(-n_params * 4 // BUCKET_BYTES) + logged_reductions
    latency = max(0.0, (slurm - local) / collectives)
    predicted = round(local + collectives * latency, 4)
    return {
        "collective_latency_s": round(latency, 5),
        "collectives_per_step": collectives,
        "step_overhead_s": 0.0,
        "predicted_step_s": {"local_1x2": local, "slurm_2x1": predicted},
        "measured_step_s": {"local_1x2": local, "slurm_2x1": slurm},
    }
