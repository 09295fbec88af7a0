"""The command every node of a multi-node stage runs: it reads what the cluster engine tells
this node (its rank, the node count, the first node's address) and runs `accelerate launch`
with the matching flags, so the same training command works under SLURM, Kubeflow Trainer
(torchrun's `PET_*` variables) or flags given by hand:

    srun python -m models.node_launch --source slurm --main-process-port 29517 -- \\
        --config_file configs/accelerate/single.yaml -m models.train --config stage.yaml

Everything after `--` is passed to `accelerate launch` unchanged. The flags are explicit
because `accelerate launch` does not read the engines' variables consistently: it reads
torchrun's `PET_*` but its own `main_process_port` default (29500) overrides `PET_MASTER_PORT`.
Runs before torch is imported, so it imports little.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from kiln_config.errors import InputError
from models.training.cpu_threads import cpu_threads_per_process

__all__ = [
    "NodeLaunchError",
    "NodeRole",
    "accelerate_argv",
    "from_flags",
    "from_slurm",
    "from_torchrun",
    "main",
]

DEFAULT_PORT = 29500  # torchrun's and accelerate's default rendezvous port


class NodeLaunchError(InputError):
    """What the engine gave this node is missing or contradicts itself; names the variable."""


@dataclass(frozen=True)
class NodeRole:
    """This node's place in the job: what `accelerate launch` needs to join the others."""

    num_machines: int
    machine_rank: int
    main_process_ip: str
    main_process_port: int
    processes_per_machine: int

    def __post_init__(self):
        if self.num_machines < 1:
            raise NodeLaunchError(f"the node count must be at least 1 (got {self.num_machines})")
        if not 0 <= self.machine_rank < self.num_machines:
            raise NodeLaunchError(
                f"node rank {self.machine_rank} is outside 0...{self.num_machines - 1} "
                f"({self.num_machines} nodes)"
            )
        if self.processes_per_machine < 1:
            raise NodeLaunchError(
                f"processes per node must be at least 1 (got {self.processes_per_machine})"
            )
        if not 0 < self.main_process_port < 65536:
            raise NodeLaunchError(f"port {self.main_process_port} is not a TCP port")

    @property
    def num_processes(self) -> int:
        """All processes of the job (accelerate's `--num_processes` is the total)."""
        return self.num_machines * self.processes_per_machine


def _int(env: dict[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        if default is not None:
            return default
        raise NodeLaunchError(f"{name} is not set: is this running inside the job's step?")
    try:
        return int(raw)
    except ValueError:
        raise NodeLaunchError(f"{name} is not a whole number (got {raw!r})") from None


def _run(argv: list[str], env: dict[str, str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, check=True, env=env).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        raise NodeLaunchError(f"`{' '.join(argv)}` failed: {detail.strip()}") from e


def slurm_first_node_address(nodelist: str, env: dict[str, str]) -> str:
    """The address of the first node of `nodelist` (SLURM's compressed form, `n[1-2]`):
    its `NodeAddr` as SLURM knows it, which is what the other nodes can reach, else its name."""
    hosts = _run(["scontrol", "show", "hostnames", nodelist], env).split()
    if not hosts:
        raise NodeLaunchError(f"SLURM_JOB_NODELIST {nodelist!r} names no host")
    node = _run(["scontrol", "show", "node", "-o", hosts[0]], env)
    for field in node.split():
        if field.startswith("NodeAddr="):
            return field.split("=", 1)[1] or hosts[0]
    return hosts[0]


def from_slurm(env: dict[str, str], port: int, processes_per_machine: int) -> NodeRole:
    """The role of this node in a SLURM job step (one task per node: `srun --ntasks-per-node=1`)."""
    if "SLURM_NNODES" not in env and "SLURM_JOB_NUM_NODES" not in env:
        raise NodeLaunchError("SLURM_NNODES is not set: is this running inside the job's step?")
    nodes = _int(env, "SLURM_NNODES" if "SLURM_NNODES" in env else "SLURM_JOB_NUM_NODES")
    rank = _int(env, "SLURM_NODEID")
    tasks = _int(env, "SLURM_NTASKS", nodes)
    if tasks != nodes:
        raise NodeLaunchError(
            f"SLURM_NTASKS is {tasks} but SLURM_NNODES is {nodes}: run one task per node "
            "(`srun --ntasks-per-node=1`); each node's `accelerate launch` starts its processes"
        )
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise NodeLaunchError("SLURM_JOB_NODELIST is not set: is this running inside the job?")
    return NodeRole(
        nodes, rank, slurm_first_node_address(nodelist, env), port, processes_per_machine
    )


def from_torchrun(env: dict[str, str]) -> NodeRole:
    """The role of this node from torchrun's `PET_*` variables (Kubeflow Trainer sets them on
    each node of a `torch-distributed` TrainJob)."""
    master = env.get("PET_MASTER_ADDR", "").strip()
    if not master:
        raise NodeLaunchError("PET_MASTER_ADDR is not set: is this running in a TrainJob node?")
    nproc = env.get("PET_NPROC_PER_NODE", "1").strip()
    if not nproc.isdigit():  # torchrun also accepts "gpu"/"auto"; Kiln needs the number
        raise NodeLaunchError(f"PET_NPROC_PER_NODE must be a number of processes (got {nproc!r})")
    return NodeRole(
        _int(env, "PET_NNODES"),
        _int(env, "PET_NODE_RANK"),
        master,
        _int(env, "PET_MASTER_PORT", DEFAULT_PORT),
        int(nproc),
    )


def from_flags(
    num_machines: int,
    machine_rank: int,
    main_process_ip: str | None,
    port: int,
    processes_per_machine: int,
) -> NodeRole:
    """The role given by hand (flags), for engines Kiln does not read."""
    if not main_process_ip:
        raise NodeLaunchError("--main-process-ip is required with --source flags")
    return NodeRole(num_machines, machine_rank, main_process_ip, port, processes_per_machine)


def accelerate_argv(role: NodeRole, rest: list[str], python: str = sys.executable) -> list[str]:
    """`accelerate launch` for this node: the role's flags, then `rest` (`--config_file ...
    -m module args`). A topology without its own distributed type (`NO`, one process) gets
    `--multi_gpu` (DDP; gloo on CPU) when the job has more than one process."""
    topology = {}
    if "--config_file" in rest:
        path = Path(rest[rest.index("--config_file") + 1])
        if not path.is_file():
            raise NodeLaunchError(f"--config_file {path} not found on this node")
        topology = yaml.safe_load(path.read_text()) or {}
    argv = [
        python,
        "-m",
        "accelerate.commands.launch",
        "--num_machines",
        str(role.num_machines),
        "--machine_rank",
        str(role.machine_rank),
        "--main_process_ip",
        role.main_process_ip,
        "--main_process_port",
        str(role.main_process_port),
        "--num_processes",
        str(role.num_processes),
    ]
    if role.num_machines > 1:
        # Every node knows the first one's address: no rendezvous server needed.
        argv += ["--rdzv_backend", "static", "--same_network"]
    if role.num_processes > 1 and str(topology.get("distributed_type", "NO")) in ("NO", "None"):
        argv.append("--multi_gpu")
    if "--num_cpu_threads_per_process" not in rest and not _has_gpu():
        argv += [
            "--num_cpu_threads_per_process",
            str(cpu_threads_per_process(role.processes_per_machine)),
        ]
    return argv + rest


def _has_gpu() -> bool:
    # nvidia-smi's answer, without importing torch in a process that only starts another.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return visible.strip() not in ("", "-1")
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" not in argv:
        raise SystemExit("node_launch: put `--` before the `accelerate launch` arguments")
    cut = argv.index("--")
    p = argparse.ArgumentParser(
        prog="python -m models.node_launch", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--source", choices=("slurm", "torchrun", "flags"), required=True)
    p.add_argument(
        "--main-process-port",
        type=int,
        default=None,
        help=f"Rendezvous port (slurm, flags; default {DEFAULT_PORT}).",
    )
    p.add_argument(
        "--processes-per-machine",
        type=int,
        default=1,
        help="Processes per node (slurm, flags; torchrun: PET_NPROC_PER_NODE).",
    )
    p.add_argument("--num-machines", type=int, help="flags: the node count.")
    p.add_argument("--machine-rank", type=int, help="flags: this node's rank.")
    p.add_argument("--main-process-ip", help="flags: the first node's address.")
    return p.parse_args(argv[:cut]), argv[cut + 1 :]


def role_for(args: argparse.Namespace, env: dict[str, str]) -> NodeRole:
    port = args.main_process_port or DEFAULT_PORT
    if args.source == "slurm":
        return from_slurm(env, port, args.processes_per_machine)
    if args.source == "torchrun":
        return from_torchrun(env)
    if args.num_machines is None or args.machine_rank is None:
        raise NodeLaunchError("--num-machines and --machine-rank are required with --source flags")
    return from_flags(
        args.num_machines, args.machine_rank, args.main_process_ip, port, args.processes_per_machine
    )


def main(argv: list[str] | None = None) -> int:
    args, rest = _parse(sys.argv[1:] if argv is None else argv)
    try:
        role = role_for(args, dict(os.environ))
        cmd = accelerate_argv(role, rest)
    except NodeLaunchError as e:
        sys.stderr.write(f"node_launch: error: {e}\n")
        return 2
    sys.stdout.write(f"node {role.machine_rank} of {role.num_machines}: {' '.join(cmd)}\n")
    sys.stdout.flush()
    # Replaced, not wrapped: the engine's signals (scancel, a pod's termination) reach the
    # launcher itself, which stops its ranks.
    os.execv(cmd[0], cmd)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
