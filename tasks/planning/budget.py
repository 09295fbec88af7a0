"""Plan a training run before it starts: steps, samples, wall time, GPU-hours and cost.

The rate per device comes from a measurement on this machine (`models.measure_throughput`,
the real training loop on synthetic data) or from a given img/s for the first stage, scaled to the
other stages by their FLOPs per sample. The global rate assumes linear scaling over the
topology's processes, which DDP gets close to within a node; treat multi-node plans as a
lower bound on time.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from kiln_config import TrainConfig
from kiln_config.errors import InputError
from models.measure_throughput import measure_stage
from models.training.flops import train_flops_per_sample
from tasks.planning.activation_trace import unet_parameter_count
from tasks.planning.memory_model import (
    GB,
    Setup,
    encoder_params,
    memory_plan,
    stage_memory,
    stage_strategy,
)
from tasks.planning.scale_model import global_batch_scaling, stage_scaling
from tasks.planning.topology import processes_per_machine, topology_setup

__all__ = [
    "StagePlan",
    "format_memory",
    "format_plan",
    "make_plan",
    "memory_and_scale",
]


@dataclass
class StagePlan:
    resolution: int
    steps: int
    samples: int
    img_per_s_per_device: float
    img_per_s: float
    wall_hours: float
    gpu_hours: float
    cost_usd: float
    rate_source: str
    processes: int = 1  # the stage's world: its nodes times the processes on each
    eval_hours: float = 0.0  # the validation passes' share of wall_hours
    val_forward_s: float | None = None  # measured cost of one validation forward (one sample)


def make_plan(
    train: TrainConfig,
    num_processes: int | list[int],
    gpu_hour_usd: float,
    *,
    img_per_s: float | None = None,
    measure_steps: int | None = None,
    val_samples: list[int] | None = None,
    processes_per_machine: int | None = None,
) -> dict:
    """Per-stage plan and totals; exactly one of `img_per_s` and `measure_steps`.

    `num_processes` is every stage's world size, or one per stage (a stage on more nodes
    trains on more processes: its steps take less wall time and its samples the same cost).

    `val_samples` (each stage's validation split size, from shards.json) adds the held-out
    evaluations' time: at the start, every `train.eval_every` steps and at the end, each
    `4 * val_timesteps * min(split, val_max_samples)` UNet forwards (EMA and raw weights,
    right and shuffled captions), each at the measured cost of one validation forward
    (`--measure-steps`), or at a third of a training sample (`--img-per-s`: a training sample
    is a forward and a backward, about three forwards).

    Without a GPU, a measurement uses the CPU threads each training process of the launch
    will get: `processes_per_machine` of them share the cores (default `num_processes`).
    """
    if (img_per_s is None) == (measure_steps is None):
        raise InputError("give exactly one of --img-per-s and --measure-steps")
    if img_per_s is not None and img_per_s <= 0:
        raise InputError(f"--img-per-s must be positive, got {img_per_s}")
    if isinstance(num_processes, int):
        num_processes = [num_processes] * len(train.stages)
    if measure_steps is not None:
        rates = _measured_rates(
            train, num_processes, measure_steps, val_samples, processes_per_machine
        )
    else:  # no validation forward measured: `_stage_plan` prices it from the training rate
        rates = [(*rate, None) for rate in _flops_scaled_rates(train, img_per_s)]
    stages = [
        _stage_plan(train, i, num_processes[i], rates[i], val_samples, gpu_hour_usd)
        for i in range(len(train.stages))
    ]
    total = {
        k: sum(getattr(p, k) for p in stages)
        for k in ("steps", "samples", "wall_hours", "gpu_hours", "cost_usd")
    }
    return {
        "gpu_hour_usd": gpu_hour_usd,
        "stages": [asdict(p) for p in stages],
        "total": total,
    }


def _measured_rates(
    train: TrainConfig,
    num_processes: list[int],
    measure_steps: int,
    val_samples: list[int] | None,
    processes_per_machine: int | None,
) -> list[tuple[float, str, float | None]]:
    """Per stage: (img/s per process, where it comes from, one validation forward's seconds),
    each measured by a few real steps."""
    out = []
    for i in range(len(train.stages)):
        # One process's share of the split the run will evaluate (an even split: the
        # evaluation deals batches round-robin, so the busiest rank can hold a batch more).
        share = None
        if val_samples and val_samples[i]:
            share = -(-min(val_samples[i], train.val_max_samples) // num_processes[i])
        m = measure_stage(
            train,
            i,
            steps=measure_steps,
            local_processes=processes_per_machine or num_processes[i],
            val_samples=share,
        )
        on = m["device"] + (f" ({m['cpu_threads']} threads)" if m["cpu_threads"] else "")
        out.append((m["img_per_s"], f"measured on {on}, {measure_steps} steps", m["val_forward_s"]))
    return out


def _flops_scaled_rates(train: TrainConfig, img_per_s: float) -> list[tuple[float, str]]:
    """Per stage: (img/s per process, where it comes from), the first stage's given rate
    scaled by the UNet's FLOPs. Its config is in the YAML (no download needed), and it
    dominates the cost of every stage."""
    unet = train.model.unet
    flops = [
        train_flops_per_sample(
            unet,
            resolution=s.resolution,
            latent_channels=unet.get("in_channels", 4),
            seq_len=train.model.tokenizer.model_max_length,
        )
        for s in train.stages
    ]
    return [
        (img_per_s * flops[0] / f, f"given {img_per_s:g} img/s at stage 1, FLOPs-scaled")
        for f in flops
    ]


def _stage_plan(
    train: TrainConfig,
    i: int,
    procs: int,
    stage_rate: tuple[float, str, float | None],
    val_samples: list[int] | None,
    gpu_hour_usd: float,
) -> StagePlan:
    """Stage `i`'s samples, wall time (its steps and its validation passes) and cost, from
    `stage_rate`: (img/s per process, where it comes from, one validation forward's seconds)."""
    s = train.stages[i]
    rate, source, val_forward_s = stage_rate
    samples = s.max_steps * s.global_batch(procs)
    global_rate = rate * procs
    n_val = min(val_samples[i], train.val_max_samples) if val_samples else 0
    evals = 2 + (s.max_steps - 1) // train.eval_every if train.eval_every else 2
    forwards = evals * 4 * train.val_timesteps * n_val
    if val_forward_s is not None:  # measured; each process evaluates its share
        eval_h = forwards * val_forward_s / procs / 3600
    else:  # a third of a training sample (a forward and a backward, about three forwards)
        eval_h = forwards / 3 / global_rate / 3600
    wall_h = samples / global_rate / 3600 + eval_h
    return StagePlan(
        resolution=s.resolution,
        steps=s.max_steps,
        samples=samples,
        img_per_s_per_device=round(rate, 3),
        img_per_s=round(global_rate, 3),
        wall_hours=wall_h,
        gpu_hours=wall_h * procs,
        cost_usd=wall_h * procs * gpu_hour_usd,
        rate_source=source,
        processes=procs,
        eval_hours=eval_h,
        val_forward_s=val_forward_s,
    )


def _hms(hours: float) -> str:
    secs = round(hours * 3600)
    return f"{secs // 3600}:{secs % 3600 // 60:02d}:{secs % 60:02d}"


def format_plan(plan: dict) -> str:
    """The plan as a fixed-width table."""
    head = (
        f"{'stage':>6} {'procs':>6} {'steps':>9} {'samples':>13} {'img/s/dev':>10} {'img/s':>10} "
        f"{'wall':>12} {'GPU-h':>10} {'cost $':>11}"
    )
    rows = [head, "-" * len(head)]
    for p in plan["stages"]:
        rows.append(
            f"{p['resolution']:>5}px {p['processes']:>6} {p['steps']:>9,} {p['samples']:>13,} "
            f"{p['img_per_s_per_device']:>10.2f} {p['img_per_s']:>10.2f} "
            f"{_hms(p['wall_hours']):>12} {p['gpu_hours']:>10,.3f} {p['cost_usd']:>11,.2f}"
        )
    t = plan["total"]
    rows.append("-" * len(head))
    rows.append(
        f"{'total':>6} {'':>6} {t['steps']:>9,} {t['samples']:>13,} {'':>10} {'':>10} "
        f"{_hms(t['wall_hours']):>12} {t['gpu_hours']:>10,.3f} {t['cost_usd']:>11,.2f}"
    )
    rows.append(
        f"one device per process at ${plan['gpu_hour_usd']:g} per device-hour; "
        f"rates: {plan['stages'][0]['rate_source']}"
    )
    return "\n".join(rows)


def save_plan(plan: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan, indent=2))


SCALE_NODES = (1, 2, 4, 8, 16)


def memory_and_scale(
    plan: dict, train: TrainConfig, launch, precomputed: bool, per_node: int | None = None
) -> dict:
    """Add each stage's GPU memory (`tasks.planning.memory_model`) and scaling over
    `SCALE_NODES` nodes (`tasks.planning.scale_model`) to `plan`, in its configured topology:
    at the per-GPU batch as written (`scaling`: the global batch grows with the nodes) and at
    the global batch as written (`scaling_global`: each GPU's share shrinks; its micro-batch
    and accumulation are derived and its memory checked at each point). `per_node`: GPUs per
    node, when not the launch's."""
    worlds = [p["processes"] for p in plan["stages"]]
    memory = memory_plan(train, launch.accelerate_config, worlds, launch.gpu_memory_gb, precomputed)
    strategy, precision = topology_setup(launch.accelerate_config)
    n_params = _unet_params(train)
    per_node = per_node or processes_per_machine(launch)
    half = precision in ("bf16", "fp16")
    network = {"half": half, "inter_node_gbps": launch.inter_node_gbps}
    counts = {"encoders": encoder_params(train), "unet_params": n_params}
    for i, (p, mem, s) in enumerate(zip(plan["stages"], memory, train.stages, strict=True)):
        p["memory"] = mem
        nodes = sorted({*SCALE_NODES, s.num_machines})
        rate = p["img_per_s_per_device"]
        kind = stage_strategy(train, i, strategy, p["processes"])
        p["scaling"] = stage_scaling(
            n_params,
            rate,
            s.batch_size,
            s.gradient_accumulation_steps,
            nodes,
            per_node,
            strategy=kind,
            **network,
        )

        def fits(batch: int, world: int, i: int = i) -> float | None:
            ckpt, kind = train.checkpointing(i), stage_strategy(train, i, strategy, world)
            setup = Setup(kind, ckpt, precision, world, launch.gpu_memory_gb, precomputed)
            m = stage_memory(train, i, setup, batch_size=batch, **counts)
            return m.total / GB if m.fits else None

        p["global_batch"] = s.global_batch(p["processes"])
        p["scaling_global"] = global_batch_scaling(
            n_params, rate, p["global_batch"], nodes, per_node, fits, strategy=kind, **network
        )
    plan["gpu_memory_gb"] = launch.gpu_memory_gb
    plan["inter_node_gbps"] = launch.inter_node_gbps
    plan["gpus_per_node"] = per_node
    return plan


def _unet_params(train: TrainConfig) -> int:
    return unet_parameter_count(train.model.unet)


def format_memory(plan: dict) -> str:
    """Per stage: GB per GPU by component, whether it fits, the other setups' totals, what to
    change; then the scaling table."""
    gb = 1e9
    cols = (
        "parameters",
        "gradients",
        "optimizer",
        "ema",
        "comm_buffers",
        "frozen_encoders",
        "activations",
        "total",
    )
    names = ("params", "grads", "adamw", "ema", "buckets", "encoders", "activ", "total")
    head = f"{'stage':>6} {'setup':>6} {'batch':>5} " + " ".join(f"{n:>8}" for n in names)
    rows = [f"memory per GPU (GB; {plan['gpu_memory_gb']:g} GB per GPU)", head, "-" * len(head)]
    notes = []
    for p in plan["stages"]:
        m = p["memory"]["configured"]
        rows.append(
            f"{p['resolution']:>5}px {m['setup']:>6} {m['batch_size']:>5} "
            + " ".join(f"{m[c] / gb:>8.1f}" for c in cols)
            + ("  fits" if m["fits"] else "  DOES NOT FIT")
        )
        others = ", ".join(f"{k} {v / gb:.1f}" for k, v in p["memory"]["setups_total"].items())
        rows.append(f"{'':>6} totals: {others}")
        rec = p["memory"]["recommendation"]
        if rec:
            rows.append(f"{'':>6} change: {rec['text']}")
            rows += [f"{'':>6}     or: {alt['text']}" for alt in rec.get("alternatives", [])]
        if p["memory"]["unknown_encoders"]:
            notes.append(", ".join(p["memory"]["unknown_encoders"]))
    if notes:
        rows.append(f"not counted: {notes[0]} (a hub id; point `pretrained` at a local folder)")
    rows.append("")
    rows.append(
        f"scaling ({plan['gpus_per_node']} GPUs per node, {plan['inter_node_gbps']:g} "
        "Gbit/s per node, traffic overlapped with the backward pass)"
    )
    head = (
        f"{'stage':>6} {'nodes':>5} {'GPUs':>5} {'traffic GB':>10} {'compute s':>10} "
        f"{'comm s':>8} {'step s':>8} {'efficiency':>10}"
    )
    rows += [head, "-" * len(head)]
    for p in plan["stages"]:
        for s in p["scaling"]:
            rows.append(
                f"{p['resolution']:>5}px {s['nodes']:>5} {s['processes']:>5} "
                f"{s['traffic_gb']:>10.2f} {s['compute_s']:>10.3f} {s['comm_s']:>8.3f} "
                f"{s['step_s']:>8.3f} {s['efficiency']:>10.2%}"
            )
    rows += ["", *_format_global(plan)]
    return "\n".join(rows)


def _format_global(plan: dict) -> list[str]:
    """The scaling table at each stage's global batch as written."""
    rows = [
        "scaling at each stage's global batch as written (each GPU's share shrinks with the "
        "nodes; micro-batch x accumulation derived, memory checked at each point)"
    ]
    head = (
        f"{'stage':>6} {'global':>6} {'nodes':>5} {'GPUs':>5} {'per GPU':>7} {'micro x acc':>11} "
        f"{'GB':>6} {'step s':>8} {'img/s':>10} {'efficiency':>10}"
    )
    rows += [head, "-" * len(head)]
    for p in plan["stages"]:
        for s in p["scaling_global"]:
            lead = (
                f"{p['resolution']:>5}px {p['global_batch']:>6} {s['nodes']:>5} "
                f"{s['processes']:>5} {s['per_device']:>7}"
            )
            if not s["split"]:
                rows.append(f"{lead}  {s['reason']}")
                continue
            rows.append(
                f"{lead} {str(s['micro_batch']) + ' x ' + str(s['accumulation']):>11} "
                f"{s['memory_gb']:>6.1f} {s['step_s']:>8.3f} {s['img_per_s']:>10,.1f} "
                f"{s['efficiency']:>10.2%}"
            )
    return rows
