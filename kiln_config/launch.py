"""The `launch` section: the Accelerate topology, restarts, the GPU limit, and the SLURM and
Kubernetes backends.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from kiln_config.base import EnvPath, Strict

__all__ = ["CONTROL", "GpuLimitConfig", "KubernetesConfig", "LaunchConfig", "SlurmConfig"]

# A character that ends or bends a line of a script or header (newline, carriage return, NUL...).
CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class GpuLimitConfig(Strict):
    """A Prefect global concurrency limit held around every `accelerate launch`, so runs from
    the UI, schedules and triggers never share the GPUs (tasks/launch/gpu_limit.py)."""

    name: str = Field("gpu", min_length=1, description="The global concurrency limit's name.")
    slots: int = Field(
        1, ge=1, description="Its slots when Kiln creates it on first use (launches at once)."
    )
    lease_s: float = Field(
        300,
        ge=60,
        le=86400,
        description="Lease of a held slot (the server accepts 60 s to a "
        "day), renewed while the launch runs; a killed holder's slot frees itself after this "
        "long on a Prefect server.",
    )


class SlurmConfig(Strict):
    """Where and how a stage's job is submitted when `launch.backend` is `slurm`. The cluster
    is the one the SLURM commands on PATH reach (`SLURM_CONF` as usual)."""

    partition: str | None = Field(None, description="None: the cluster's default partition.")
    account: str | None = None
    time_limit: str | None = Field(None, description="sbatch --time, e.g. 2-00:00:00.")
    gpus_per_node: int | None = Field(
        None, ge=1, description="sbatch --gpus-per-node; also each node's process count."
    )
    sbatch_lines: list[str] = Field(
        default_factory=list, description="Extra `#SBATCH` lines, e.g. `--exclusive`."
    )
    main_process_port: int = Field(
        29500,
        gt=0,
        le=64536,
        description="Rendezvous port on the job's first node, plus the "
        "job id modulo 1000 (so two jobs that share a first node do not collide).",
    )
    poll_s: float = Field(2.0, gt=0, description="How often the job's state and log are read.")

    @field_validator("partition", "account", "time_limit", "sbatch_lines")
    @classmethod
    def _one_line(cls, v):
        # Each value becomes one `#SBATCH` line of the batch script: a newline in it would
        # start a shell line that the job runs.
        for text in [v] if isinstance(v, str) else v or []:
            if CONTROL.search(text):
                raise ValueError(
                    "a newline or control character, which would add a line to the batch "
                    "script: give each #SBATCH option as its own item"
                )
        return v


class KubernetesConfig(Strict):
    """Where and how a stage's Kubeflow Trainer `TrainJob` runs when `launch.backend` is
    `kubernetes`. The cluster is the one the Kubernetes client finds the standard way (the
    in-cluster service account, else `KUBECONFIG` or ~/.kube/config)."""

    image: str | None = Field(
        None,
        description="Container image with Kiln installed at its working directory "
        "(required for the kubernetes backend).",
    )
    namespace: str = "default"
    runtime: str = Field(
        "torch-distributed", description="The ClusterTrainingRuntime the TrainJob refers to."
    )
    context: str | None = Field(None, description="kubeconfig context; None: the current one.")
    gpus_per_node: int | None = Field(
        None, ge=1, description="nvidia.com/gpu per node; also each node's process count."
    )
    resources_per_node: dict[str, str] = Field(
        default_factory=dict, description="More limits per node, e.g. {cpu: '32', memory: 400Gi}."
    )
    storage_claim: str | None = Field(
        None,
        description="PersistentVolumeClaim holding the storage root, mounted on every "
        "node at mount_path; None: the runtime mounts the shared filesystem itself.",
    )
    mount_path: str | None = Field(
        None,
        description="Where storage_claim is mounted: the storage root's absolute path, "
        "the same as on the machine that runs the flow.",
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="Environment of every node, e.g. NCCL_SOCKET_IFNAME."
    )
    node_selector: dict[str, str] = Field(default_factory=dict)
    poll_s: float = Field(5.0, gt=0, description="How often the job's status and log are read.")

    @model_validator(mode="after")
    def _claim_has_a_path(self) -> KubernetesConfig:
        if self.storage_claim and not (self.mount_path and self.mount_path.startswith("/")):
            raise ValueError(
                f"launch.kubernetes.mount_path: storage_claim {self.storage_claim!r} needs the "
                f"absolute path to mount it at (received {self.mount_path!r})"
            )
        return self


class LaunchConfig(Strict):
    accelerate_config: EnvPath = Field(
        "configs/accelerate/single.yaml", description="Accelerate topology YAML."
    )
    num_processes: int | None = Field(None, gt=0, description="Override the topology's count.")
    max_restarts: int = Field(2, ge=0, description="Relaunches (resuming) after a crash.")
    hang_timeout_s: float = Field(
        900, gt=0, description="Kill a launch whose heartbeat is older than this (a hang)."
    )
    gpu_hour_usd: float = Field(
        0.0, ge=0, description="Price of one device-hour; 0 reports GPU-hours without cost."
    )
    health_check: bool = Field(
        True, description="Pre-flight check (GPUs, all-reduce, disk, storage) before launches."
    )
    health_timeout_s: float = Field(
        300, gt=0, description="Longest the pre-flight all-reduce launch may take."
    )
    gpu_limit: GpuLimitConfig | None = Field(
        default_factory=GpuLimitConfig,
        description="Global concurrency limit taken around every local launch; null: none. "
        "On a cluster backend the cluster's scheduler owns the GPUs.",
    )
    backend: Literal["local", "slurm", "kubernetes"] = Field(
        "local",
        description="local: `accelerate launch` on this machine; slurm: one SLURM "
        "job per stage on its `num_machines` nodes; kubernetes: one Kubeflow Trainer TrainJob "
        "per stage. A cluster backend needs the storage root on a shared filesystem.",
    )
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    kubernetes: KubernetesConfig = Field(default_factory=KubernetesConfig)
    gpu_memory_gb: float = Field(
        80.0,
        gt=0,
        description="Memory of each GPU (GB): `kiln plan` and the train flow check "
        "every stage's per-GPU memory (tasks/planning/memory_model.py) against it.",
    )
    inter_node_gbps: float = Field(
        400.0,
        gt=0,
        description="Network bandwidth of each node (Gbit/s; p4de: 400): "
        "`kiln plan`'s gradient traffic and scaling efficiency (tasks/planning/scale_model.py).",
    )

    @model_validator(mode="after")
    def _kubernetes_has_an_image(self) -> LaunchConfig:
        if self.backend == "kubernetes" and not self.kubernetes.image:
            raise ValueError(
                "launch.kubernetes.image: the kubernetes backend runs each node in a container "
                "image with Kiln installed; name it (received None)"
            )
        return self
