"""A stage (or the pre-flight check) as one Kubeflow Trainer `TrainJob`: create it, watch it to
the end, delete it.

The job runs on the `torch-distributed` runtime with `numNodes` nodes. Its container command
is the node entrypoint (`models/node_launch.py --source torchrun`), which turns the `PET_*`
variables the Trainer sets on each node into that node's `accelerate launch` flags, so the
training command is the one a local or SLURM launch runs. The object is built from the
Trainer's own API models (`kubeflow_trainer_api`), so a field the TrainJob schema does not
know fails here, not in the cluster.

While the job runs, node 0's log streams into the Prefect log, the stage's heartbeat (on the
shared storage root, which this machine sees too) drives progress and the hang watchdog, and
a job still running when the watch ends for any reason (a hang, a timeout, an exception, a
cancelled flow run, SIGTERM) is deleted with its pods. A flow-run process killed outright
(SIGKILL, the OOM killer) runs no cleanup: its TrainJob runs on until it ends or is deleted.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
import uuid

from kiln_config import KubernetesConfig
from tasks.launch.common import ClusterJob, LaunchError, LaunchRejected

__all__ = [
    "KubernetesError",
    "KubernetesRejected",
    "check_kubernetes",
    "job_outcome",
    "run_train_job",
    "train_job",
]

GROUP, VERSION, PLURAL = "trainer.kubeflow.org", "v1alpha1", "trainjobs"
NODE = "node"  # the torch-distributed runtime's replicated job, and its trainer container
STORAGE_VOLUME = "kiln-storage"
TIMEOUT = 60  # seconds, each API call
UNREACHABLE_S = 300.0  # how long the API may fail before the watch gives up on the job


class KubernetesError(LaunchError):
    """The Kubernetes API failed, or the TrainJob ended Failed; retried by the stage task."""


class KubernetesRejected(KubernetesError, LaunchRejected):
    """The API refused the TrainJob (a bad namespace, runtime, image or permission):
    creating it again would be refused the same way, so it is not retried."""


def _name(name: str) -> str:
    """A fresh DNS-1035 name for each submission (a retry is a new job)."""
    slug = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:40]
    return f"kiln-{slug}-{uuid.uuid4().hex[:6]}"


def train_job(
    rest: list[str],
    *,
    name: str,
    nodes: int,
    processes_per_machine: int,
    kube: KubernetesConfig,
    env: dict[str, str] | None = None,
) -> dict:
    """The TrainJob for `accelerate launch <rest>` on `nodes` nodes, as the API takes it.

    Raises:
        ValueError: a field the Trainer's TrainJob schema does not accept.
    """
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

    variables = {"PYTHONUNBUFFERED": "1", **kube.env, **(env or {})}
    trainer: dict = {
        "image": kube.image,
        "command": ["python", "-m", "models.node_launch", "--source", "torchrun", "--"],
        "args": list(rest),
        "numNodes": nodes,
        "numProcPerNode": processes_per_machine,
        "env": [{"name": k, "value": v} for k, v in sorted(variables.items())],
    }
    limits = dict(kube.resources_per_node)
    if kube.gpus_per_node:
        limits["nvidia.com/gpu"] = str(kube.gpus_per_node)
    if limits:
        trainer["resourcesPerNode"] = {"limits": limits}
    spec: dict = {"runtimeRef": {"name": kube.runtime}, "trainer": trainer}
    pod: dict = {}
    if kube.storage_claim:
        pod["volumes"] = [
            {"name": STORAGE_VOLUME, "persistentVolumeClaim": {"claimName": kube.storage_claim}}
        ]
        pod["containers"] = [
            {"name": NODE, "volumeMounts": [{"name": STORAGE_VOLUME, "mountPath": kube.mount_path}]}
        ]
    if kube.node_selector:
        pod["nodeSelector"] = dict(kube.node_selector)
    if pod:
        replicated = [{"name": NODE, "template": {"spec": {"template": {"spec": pod}}}}]
        spec["runtimePatches"] = [
            {
                "manager": "kiln",
                "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": replicated}}},
            }
        ]
    job = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainJob",
        "metadata": {
            "name": _name(name),
            "namespace": kube.namespace,
            "labels": {"app.kubernetes.io/managed-by": "kiln"},
        },
        "spec": spec,
    }
    # The generated models ignore unknown keys: a round trip that loses nothing means every
    # key is one the schema knows, with a value of its type.
    parsed = TrainerV1alpha1TrainJob.from_dict(job)
    if parsed is None or parsed.to_dict() != job:
        raise ValueError(f"not a TrainJob the Trainer's schema accepts: {job}")
    return job


def job_outcome(job: dict) -> tuple[str, str] | None:
    """("Complete" | "Failed", the condition's reason and message) once the TrainJob ended,
    else None."""
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("type") in ("Complete", "Failed") and cond.get("status") == "True":
            detail = ": ".join(x for x in (cond.get("reason"), cond.get("message")) if x)
            return cond["type"], detail
    return None


def _clients(kube: KubernetesConfig):
    """The API clients: the kubeconfig's `kube.context` when one is named, else the in-cluster
    service account, else the kubeconfig's current context."""
    from kubernetes import client, config

    errors = []
    loaders = [lambda: config.load_kube_config(context=kube.context)]
    if not kube.context:
        loaders.insert(0, config.load_incluster_config)
    for load in loaders:
        try:
            load()
            return client.CustomObjectsApi(), client.CoreV1Api()
        except (config.ConfigException, OSError) as e:
            errors.append(str(e))
    raise KubernetesRejected(
        "launch.backend kubernetes: no cluster to talk to (" + "; ".join(errors) + ")"
    )


def _refused(e) -> bool:
    """Whether an API error would come back the same on a retry (a 4xx other than a timeout,
    a conflict or throttling)."""
    status = getattr(e, "status", None) or 0
    return 400 <= status < 500 and status not in (408, 409, 429)


class _NodeZeroLog:
    """Follows node 0's pod log in a thread, each line into the task log (a new pod, after a
    restart, is followed from its start)."""

    def __init__(self, core, namespace: str, job: str, logger, keep: list[str]):
        self.core, self.ns, self.job, self.log, self.keep = core, namespace, job, logger, keep
        self.followed: set[str] = set()
        self.threads: list[threading.Thread] = []
        self.running_since: float | None = None  # when node 0 was first seen running

    def poll(self) -> None:
        selector = (
            f"jobset.sigs.k8s.io/jobset-name={self.job},"
            f"jobset.sigs.k8s.io/replicatedjob-name={NODE},"
            "batch.kubernetes.io/job-completion-index=0"
        )
        pods = self.core.list_namespaced_pod(
            self.ns, label_selector=selector, _request_timeout=TIMEOUT
        ).items
        for pod in pods:
            name, phase = pod.metadata.name, pod.status.phase
            if phase == "Running" and self.running_since is None:
                self.running_since = time.time()
            if name not in self.followed and phase in ("Running", "Succeeded", "Failed"):
                self.followed.add(name)
                thread = threading.Thread(target=self._follow, args=(name,), daemon=True)
                thread.start()
                self.threads.append(thread)

    def join(self, timeout_s: float = 5.0) -> None:
        """Let the log streams catch up with the pods' last lines (bounded)."""
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _follow(self, pod: str) -> None:
        from kubernetes import watch

        with contextlib.suppress(Exception):  # the pod went away: its log ends here
            for line in watch.Watch().stream(
                self.core.read_namespaced_pod_log,
                name=pod,
                namespace=self.ns,
                container=NODE,
                follow=True,
            ):
                self.keep.append(line)
                del self.keep[:-40]
                self.log.info(line)


def check_kubernetes(kube: KubernetesConfig) -> None:
    """Ask the cluster, before any work, whether the TrainJobs can run: a client
    configuration, and the runtime the jobs refer to.

    Raises:
        KubernetesRejected: no cluster configuration, or no such ClusterTrainingRuntime.
    """
    from kubernetes.client.exceptions import ApiException

    custom, _ = _clients(kube)
    try:
        custom.get_cluster_custom_object(
            GROUP, VERSION, "clustertrainingruntimes", kube.runtime, _request_timeout=TIMEOUT
        )
    except ApiException as e:
        raise KubernetesRejected(
            f"launch.kubernetes.runtime: the cluster has no ClusterTrainingRuntime "
            f"{kube.runtime!r} usable here ({e.status} {e.reason}); is Kubeflow Trainer installed?"
        ) from None


def run_train_job(job: ClusterJob, kube: KubernetesConfig) -> str:
    """Create `job` as one TrainJob and watch it to the end; returns the TrainJob's name.

    Raises:
        KubernetesRejected: the API refused the job (not retried by the stage task).
        KubernetesError: the job ended Failed, hung (no heartbeat for `job.hang_timeout_s`)
            or ran past `job.timeout_s`; the message has node 0's last log lines.
    """
    custom, core = _clients(kube)
    logger, timeout_s = job.logger, job.timeout_s
    obj = train_job(
        job.rest,
        name=job.name,
        nodes=job.nodes,
        kube=kube,
        env=job.env,
        processes_per_machine=job.processes_per_machine,
    )
    job_name, ns = obj["metadata"]["name"], kube.namespace
    api = (GROUP, VERSION, ns, PLURAL)
    try:
        custom.create_namespaced_custom_object(*api, obj, _request_timeout=TIMEOUT)
    except Exception as e:  # noqa: BLE001 - ApiException, or urllib3's connection errors
        detail = f"{getattr(e, 'status', '')} {getattr(e, 'reason', '')} {getattr(e, 'body', e)}"
        kind = KubernetesRejected if _refused(e) else KubernetesError
        raise kind(
            f"the Kubernetes API did not take TrainJob {ns}/{job_name}: {detail.strip()}"
        ) from None
    logger.info(
        "created TrainJob %s/%s: %d node(s) x %d process(es)",
        ns,
        job_name,
        job.nodes,
        job.processes_per_machine,
    )
    tail: list[str] = []
    node_zero = _NodeZeroLog(core, ns, job_name, logger, tail)
    beat = job.heartbeat_watch()
    outcome, why, answered = None, None, time.time()
    try:
        while True:
            try:
                current = custom.get_namespaced_custom_object(
                    *api, job_name, _request_timeout=TIMEOUT
                )
                node_zero.poll()
                answered = time.time()
            except Exception as e:  # noqa: BLE001 - the API busy or away: the job goes on
                if _refused(e) or time.time() - answered > UNREACHABLE_S:
                    raise KubernetesError(f"TrainJob {ns}/{job_name}: the API failed: {e}") from e
                logger.warning("TrainJob %s/%s: the API failed (%s); asking again", ns, job_name, e)
                time.sleep(kube.poll_s)
                continue
            if outcome := job_outcome(current):
                break
            since = node_zero.running_since  # not while pods wait for nodes or images
            if since is not None and (why := beat.check(since)):
                break
            if since is not None and timeout_s and time.time() - since > timeout_s:
                why = f"still running after {timeout_s:g}s"
                break
            time.sleep(kube.poll_s)
    finally:
        if outcome is None:  # a hang, a timeout, an exception, SIGTERM or a cancelled flow run
            logger.error("TrainJob %s/%s %s: deleting it", ns, job_name, why or "interrupted")
            _delete(custom, api, job_name, logger)
        node_zero.join()
    if outcome and outcome[0] == "Complete":
        return job_name
    what = why or f"ended Failed ({outcome[1] if outcome else '?'})"
    raise KubernetesError(f"TrainJob {ns}/{job_name} {what}\n" + "\n".join(tail))


def _delete(custom, api: tuple, job_name: str, logger) -> None:
    """Delete the TrainJob with its pods, and wait (up to a minute) until it is gone, so a
    retry's pods do not meet the old ones."""
    with contextlib.suppress(Exception):
        custom.delete_namespaced_custom_object(
            *api, job_name, propagation_policy="Foreground", _request_timeout=TIMEOUT
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                custom.get_namespaced_custom_object(*api, job_name, _request_timeout=TIMEOUT)
            except Exception as e:  # noqa: BLE001
                if getattr(e, "status", None) == 404:
                    return
            time.sleep(1)
        logger.warning("TrainJob %s still being deleted after 60 s", job_name)
