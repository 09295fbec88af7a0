"""The Kubernetes backend at its boundaries (no Kubernetes cluster runs here): the TrainJob it
submits against the Kubeflow Trainer's own API models, the end states it reads, what each
node runs under the `PET_*` variables the Trainer sets (two nodes' launchers on loopback),
and the errors a user meets first."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kiln_config import HealthCheckRun, KubernetesConfig, LaunchConfig, write_run_file
from tasks.launch.accelerate import ClusterJob
from tasks.launch.kubernetes import KubernetesRejected, job_outcome, run_train_job, train_job

REPO = Path(__file__).resolve().parents[3]
REST = [
    "--config_file",
    "configs/accelerate/single.yaml",
    "-m",
    "models.train",
    "--config",
    "/mnt/kiln/runs/r1/stage-256/stage.yaml",
]


def test_the_train_job_is_what_the_trainer_schema_accepts():
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

    kube = KubernetesConfig(
        image="registry.example/kiln:1.0",
        namespace="ml",
        gpus_per_node=8,
        resources_per_node={"cpu": "64", "memory": "900Gi"},
        storage_claim="kiln-data",
        mount_path="/mnt/kiln",
        env={"NCCL_SOCKET_IFNAME": "eth0"},
        node_selector={"gpu": "h100"},
    )
    job = train_job(
        REST,
        name="stage-256px",
        nodes=4,
        processes_per_machine=8,
        kube=kube,
        env={"S3_ENDPOINT_URL": "http://minio:9000"},
    )
    parsed = TrainerV1alpha1TrainJob.from_dict(job)
    assert parsed.to_dict() == job, "every key is one the TrainJob schema knows"
    trainer = parsed.spec.trainer
    assert (trainer.num_nodes, trainer.num_proc_per_node) == (4, 8)
    assert trainer.command == ["python", "-m", "models.node_launch", "--source", "torchrun", "--"]
    assert trainer.args == REST, "the same training command as a local or SLURM launch"
    limits = job["spec"]["trainer"]["resourcesPerNode"]["limits"]
    assert limits == {"cpu": "64", "memory": "900Gi", "nvidia.com/gpu": "8"}
    assert {e.name: e.value for e in trainer.env} == {
        "NCCL_SOCKET_IFNAME": "eth0",
        "PYTHONUNBUFFERED": "1",
        "S3_ENDPOINT_URL": "http://minio:9000",
    }
    assert parsed.spec.runtime_ref.name == "torch-distributed"
    assert job["metadata"]["namespace"] == "ml"
    assert job["metadata"]["name"].startswith("kiln-stage-256px-")
    pod = (
        parsed.spec.runtime_patches[0]
        .training_runtime_spec.template.spec.replicated_jobs[0]
        .template.spec.template.spec
    )
    assert pod.volumes[0].persistent_volume_claim.claim_name == "kiln-data"
    assert pod.containers[0].name == "node"
    assert pod.containers[0].volume_mounts[0].mount_path == "/mnt/kiln"
    assert pod.node_selector == {"gpu": "h100"}
    again = train_job(REST, name="stage-256px", nodes=4, processes_per_machine=8, kube=kube)
    assert again["metadata"]["name"] != job["metadata"]["name"], "a retry is a new TrainJob"
    plain = train_job(
        REST, name="health", nodes=2, processes_per_machine=1, kube=KubernetesConfig(image="kiln")
    )
    assert (
        "runtimePatches" not in plain["spec"] and "resourcesPerNode" not in plain["spec"]["trainer"]
    ), "nothing to patch: the runtime's own pod template"


def test_the_end_states_of_a_train_job():
    def status(*conds):
        return {"status": {"conditions": list(conds)}}

    assert job_outcome({}) is None and job_outcome(status()) is None
    created = {"type": "Created", "status": "True", "reason": "JobSetCreated"}
    assert job_outcome(status(created)) is None
    assert job_outcome(
        status(created, {"type": "Complete", "status": "True", "reason": "JobSetCompleted"})
    ) == ("Complete", "JobSetCompleted")
    failed = {
        "type": "Failed",
        "status": "True",
        "reason": "FailedJobs",
        "message": "jobset failed: node-1 BackoffLimitExceeded",
    }
    assert job_outcome(status(created, failed)) == (
        "Failed",
        "FailedJobs: jobset failed: node-1 BackoffLimitExceeded",
    )
    assert job_outcome(status({**failed, "status": "False"})) is None


def test_kubernetes_settings_are_checked_at_load():
    with pytest.raises(ValueError, match=r"launch\.kubernetes\.image"):
        LaunchConfig(backend="kubernetes")
    with pytest.raises(ValueError, match=r"launch\.kubernetes\.mount_path"):
        KubernetesConfig(image="kiln", storage_claim="data")
    with pytest.raises(ValueError, match=r"launch\.kubernetes\.mount_path"):
        KubernetesConfig(image="kiln", storage_claim="data", mount_path="kiln-data")


def test_without_a_cluster_the_job_is_refused_with_the_reason(tmp_path, monkeypatch):
    """No service account and no kubeconfig: one clear error, not retried."""
    import logging

    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing-kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(KubernetesRejected, match="no cluster to talk to"):
        job = ClusterJob(REST, 2, 1, "stage", logging.getLogger())
        run_train_job(job, KubernetesConfig(image="k"))
    # `kiln train` asks before any work: the same reason, as a config error.
    from kiln_config import ConfigError, load_config
    from tasks.inputs import check_inputs

    cfg = load_config(REPO / "configs" / "tiny.yaml")
    cfg.launch = LaunchConfig(backend="kubernetes", kubernetes=KubernetesConfig(image="k"))
    with pytest.raises(ConfigError, match="no cluster to talk to"):
        check_inputs(cfg, ("cluster",))


@pytest.mark.integration
def test_two_trainjob_nodes_form_one_world_from_the_trainer_variables(tmp_path):
    """What each node's container runs, started twice on loopback with the variables Kubeflow
    Trainer sets on node 0 and node 1: one two-rank gloo world, all-reduced."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "health"
    run = write_run_file(HealthCheckRun(out_dir=str(out)), tmp_path / "health.yaml")
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "PET_NNODES": "2",
            "PET_NODE_RANK": str(rank),
            "PET_MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_PORT": str(port),
            "PET_NPROC_PER_NODE": "1",
            "GLOO_SOCKET_IFNAME": "lo",
        }
        cmd = [
            sys.executable,
            "-m",
            "models.node_launch",
            "--source",
            "torchrun",
            "--",
            "--config_file",
            str(REPO / "configs" / "accelerate" / "single.yaml"),
            "-m",
            "models.collective_check",
            "--config",
            str(run),
        ]
        procs.append(
            subprocess.Popen(
                cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    assert "node 0 of 2" in outputs[0] and "node 1 of 2" in outputs[1]
    assert f"--main_process_port {port}" in outputs[0], "PET_MASTER_PORT, not accelerate's 29500"
    report = json.loads((out / "health.json").read_text())
    assert report["world_size"] == 2


def test_the_claim_must_hold_the_storage_root(tmp_path):
    """The nodes read and write the run folder at the flow machine's path: the claim's mount
    must contain storage.root."""
    import yaml

    from kiln_config import ConfigError, load_config

    cfg = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    cfg["storage"]["root"] = "/mnt/kiln/data"
    cfg["launch"] |= {
        "backend": "kubernetes",
        "kubernetes": {"image": "kiln", "storage_claim": "kiln", "mount_path": "/mnt/other"},
    }
    (tmp_path / "k.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match=r"launch\.kubernetes\.mount_path: the nodes must see"):
        load_config(tmp_path / "k.yaml")
    cfg["launch"]["kubernetes"]["mount_path"] = "/mnt/kiln"
    (tmp_path / "k.yaml").write_text(yaml.safe_dump(cfg))
    assert load_config(tmp_path / "k.yaml").launch.kubernetes.mount_path == "/mnt/kiln"
