"""A stage (or the pre-flight check) as one SLURM job: `sbatch`, then watch it to the end.

The job runs one task per node (`srun --ntasks-per-node=1`); each task is the node entrypoint
(`models/node_launch.py`), which starts that node's `accelerate launch`. The job's output file
streams into the Prefect log line by line, the stage's heartbeat keeps the hang watchdog
working, and a job that is still queued or running when the watch ends for any reason (a
hang, a timeout, an exception, a cancelled or killed flow run) is cancelled with `scancel`,
so no job is left behind.

Plain `sbatch`/`scontrol`/`scancel` rather than submitit: the job is one shell command on N
nodes (no pickled Python callable to ship), the end state needs `scontrol` anyway (submitit
reads `sacct`, which needs SLURM's accounting database, absent on many clusters), and the
commands are what an operator reads in the job script Kiln writes next to the stage.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from kiln_config import SlurmConfig
from kiln_config.launch import CONTROL
from tasks.launch.common import ClusterJob, HeartbeatWatch, LaunchError, LaunchRejected

__all__ = [
    "SlurmError",
    "SlurmRejected",
    "SlurmUnavailable",
    "check_slurm",
    "job_script",
    "run_slurm_job",
]

# End states (`scontrol show job`'s JobState). Any of them but COMPLETED fails the launch, and
# the stage task's retries resubmit it (resuming from the newest checkpoint) unless the stage
# diverged: NODE_FAIL, PREEMPTED, a killed rank (FAILED) and TIMEOUT all come back that way.
# Jobs are submitted with --no-requeue, so SLURM does not resubmit them behind Kiln's back.
FINISHED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
}
# States of a job that will not go on by itself: ended as far as Kiln is concerned, and
# cancelled so that it leaves the queue.
HELD = {"SPECIAL_EXIT", "REQUEUE_HOLD", "REQUEUE_FED", "REQUEUED", "STOPPED", "SUSPENDED"}


# Pending reasons that no wait resolves: the job asks for more than the partition, account or
# QOS allows. A cluster without `EnforcePartLimits` accepts such a job and leaves it pending
# for ever; the stage fails at once instead, as if sbatch had refused it.
# (PartitionNodeLimit is not among them: it also means that needed nodes are down for now.)
NEVER_RUNS = {
    "PartitionConfig",
    "PartitionTimeLimit",
    "BadConstraints",
    "InvalidAccount",
    "InvalidQOS",
    "AccountNotAllowed",
    "QOSMaxNodePerJobLimit",
    "QOSMaxWallDurationPerJobLimit",
    "QOSMaxGRESPerJob",
}

# sbatch failures that a later try may not meet: the controller busy or unreachable.
TRANSIENT = (
    "Socket timed out",
    "Unable to contact slurm controller",
    "temporarily unable",
    "Resource temporarily unavailable",
    "Zero Bytes were transmitted",
    "Transport endpoint",
    "timed out after",
)
# How long the controller may not answer `scontrol` before the watch gives up on the job.
UNREACHABLE_S = 300.0


class SlurmError(LaunchError):
    """A SLURM command failed, or the job ended in another state than COMPLETED."""


class SlurmRejected(SlurmError, LaunchRejected):
    """`sbatch` refused the job (a bad partition, account or node count): resubmitting the same
    job would be refused the same way, so it is not retried."""


class SlurmUnavailable(SlurmError):
    """No SLURM commands here, or the controller did not answer."""


def _slurm(argv: list[str], env: dict[str, str] | None = None) -> str:
    """Run a SLURM command; its stdout.

    Raises:
        SlurmUnavailable: the command is missing, timed out, or met a busy controller.
        SlurmError: it failed with another message (the message is SLURM's).
    """
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    except FileNotFoundError:
        raise SlurmUnavailable(
            f"`{argv[0]}` is not on PATH: launch.backend slurm needs the SLURM client commands "
            "(sbatch, scontrol, scancel) on this machine"
        ) from None
    except subprocess.TimeoutExpired:
        raise SlurmUnavailable(f"`{shlex.join(argv)}` timed out after 60 s") from None
    if proc.returncode != 0:
        said = proc.stderr.strip() or proc.stdout.strip()
        kind = SlurmUnavailable if any(t in said for t in TRANSIENT) else SlurmError
        raise kind(said)
    return proc.stdout


def _directives(slurm: SlurmConfig, nodes: int, name: str, log: Path) -> list[str]:
    lines = [
        f"--job-name={name}",
        f"--nodes={nodes}",
        "--ntasks-per-node=1",
        f"--output={log}",
        "--no-requeue",
    ]
    if slurm.partition:
        lines.append(f"--partition={slurm.partition}")
    if slurm.account:
        lines.append(f"--account={slurm.account}")
    if slurm.time_limit:
        lines.append(f"--time={slurm.time_limit}")
    if slurm.gpus_per_node:
        lines.append(f"--gpus-per-node={slurm.gpus_per_node}")
    return lines + list(slurm.sbatch_lines)


def check_slurm(slurm: SlurmConfig, nodes: int) -> None:
    """Ask the cluster whether it would run a job of `nodes` nodes with these settings
    (`sbatch --test-only`), so a bad partition or an impossible node count fails before any
    work, with SLURM's own reason.

    Raises:
        SlurmRejected: the cluster refuses it.
        SlurmUnavailable: no SLURM commands here, or the controller does not answer.
    """
    lines = _directives(slurm, nodes, "kiln-check", Path(os.devnull))
    argv = ["sbatch", "--test-only", *(a for d in lines for a in shlex.split(d)), "--wrap", "true"]
    try:
        _slurm(argv)
    except SlurmUnavailable:
        raise
    except SlurmError as e:
        raise SlurmRejected(f"launch.slurm: the cluster refuses a {nodes}-node job ({e})") from None


def job_script(
    rest: list[str],
    *,
    nodes: int,
    processes_per_machine: int,
    slurm: SlurmConfig,
    name: str,
    log: Path,
    workdir: str,
) -> str:
    """The batch script: one node entrypoint per node, each starting `accelerate launch
    <rest>` with that node's flags. The rendezvous port is the configured one plus the job
    id modulo 1000, so two jobs that share a first node do not collide."""
    directives = _directives(slurm, nodes, name, log)
    bad = [d for d in directives if CONTROL.search(d)]
    if bad:  # the config refuses them; a log path under a root named with a newline does not
        raise SlurmRejected(f"launch.slurm: an #SBATCH line holds a control character: {bad[0]!r}")
    header = "".join(f"#SBATCH {d}\n" for d in directives)
    node = [
        sys.executable,
        "-m",
        "models.node_launch",
        "--source",
        "slurm",
        "--processes-per-machine",
        str(processes_per_machine),
    ]
    port = f'--main-process-port "$(( {slurm.main_process_port} + SLURM_JOB_ID % 1000 ))"'
    return (
        "#!/bin/bash\n"
        f"{header}"
        "# Written by Kiln (tasks/launch/slurm.py); resubmitted as is by a retry.\n"
        "set -euo pipefail\n"
        f"cd {shlex.quote(workdir)}\n"
        "export PYTHONUNBUFFERED=1\n"
        # srun (SLURM 22.05+) does not pass --cpus-per-task on from sbatch by itself.
        "srun --kill-on-bad-exit=1 ${SLURM_CPUS_PER_TASK:+--cpus-per-task=$SLURM_CPUS_PER_TASK} "
        f"{shlex.join(node)} {port} -- {shlex.join(rest)}\n"
    )


def _job(job_id: str) -> dict[str, str]:
    """`scontrol show job`'s fields of the job (JobState, ExitCode, Reason, NodeList...)."""
    out = _slurm(["scontrol", "show", "job", "-o", job_id])
    fields = {}
    for part in out.split():
        key, eq, value = part.partition("=")
        if eq:
            fields.setdefault(key, value)
    return fields


def _cancel(job_id: str, log: logging.Logger | logging.LoggerAdapter) -> None:
    """scancel the job and wait (up to a minute) until SLURM reports it ended."""
    with contextlib.suppress(SlurmError):
        _slurm(["scancel", job_id])
        log.warning("cancelled SLURM job %s", job_id)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if _job(job_id).get("JobState") in FINISHED:
                return
            time.sleep(0.5)


class _Tail:
    """New complete lines of the job's output file, each logged once."""

    def __init__(self, path: Path, log, keep: collections.deque):
        self.path, self.log, self.keep, self.offset, self.partial = path, log, keep, 0, ""

    def read(self, final: bool = False) -> None:
        if not self.path.is_file():
            return
        with self.path.open("r", errors="replace") as f:
            f.seek(self.offset)
            chunk = f.read()
            self.offset = f.tell()
        text = self.partial + chunk
        lines = text.split("\n")
        self.partial = "" if final else lines.pop()
        for line in lines:
            if line or final:
                self.keep.append(line)
                self.log.info(line)


def run_slurm_job(job: ClusterJob, slurm: SlurmConfig, workdir: Path) -> str:
    """Submit `job` as one SLURM job (its script and output in `workdir`) and watch it to the
    end; returns the job id.

    Raises:
        SlurmRejected: sbatch refused the job, or it can never start (not retried).
        SlurmError: the job ended in another state than COMPLETED, hung (no heartbeat for
            `job.hang_timeout_s`) or ran past `job.timeout_s`; the message has its last
            output lines.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    name, nodes, logger = job.name, job.nodes, job.logger
    log_path = workdir / f"slurm-{name}.log"
    script = workdir / f"slurm-{name}.sh"
    text = job_script(
        job.rest,
        nodes=nodes,
        processes_per_machine=job.processes_per_machine,
        slurm=slurm,
        name=name,
        log=log_path,
        workdir=os.getcwd(),
    )
    script.write_text(text)
    offset = log_path.stat().st_size if log_path.is_file() else 0  # a retry appends
    sbatch_env = {**os.environ, **(job.env or {})}
    try:
        job_id = (
            _slurm(["sbatch", "--parsable", "--open-mode=append", str(script)], sbatch_env)
            .strip()
            .split(";")[0]
        )
    except SlurmUnavailable as e:  # retried: the controller may answer next time
        raise SlurmError(f"sbatch could not submit the job: {e}") from e
    except SlurmError as e:
        raise SlurmRejected(f"sbatch refused the job: {e}") from e
    logger.info(
        "submitted SLURM job %s: %d node(s), script %s, output %s", job_id, nodes, script, log_path
    )
    tail: collections.deque[str] = collections.deque(maxlen=40)
    reader = _Tail(log_path, logger, tail)
    reader.offset = offset
    beat = job.heartbeat_watch()
    state, why, fields = "PENDING", None, {}
    answered, first_running = time.time(), None
    try:
        while True:
            try:
                fields = _job(job_id)
                answered = time.time()
            except SlurmUnavailable as e:  # a busy controller: the job itself goes on
                if time.time() - answered > UNREACHABLE_S:
                    raise SlurmError(
                        f"SLURM job {job_id}: no answer for {UNREACHABLE_S:g}s ({e})"
                    ) from e
                logger.warning(
                    "SLURM job %s: scontrol did not answer (%s); trying again", job_id, e
                )
                time.sleep(slurm.poll_s)
                continue
            state = fields.get("JobState", "UNKNOWN")
            reader.read()
            if state == "RUNNING":
                first_running = first_running or time.time()
            since = _start_time(fields, first_running or time.time())
            if state in FINISHED or (why := _why_stop(state, fields, beat, job.timeout_s, since)):
                break
            time.sleep(slurm.poll_s)
    finally:
        if state not in FINISHED:  # an exception, SIGTERM or Ctrl-C too
            logger.error("SLURM job %s %s: cancelling it", job_id, why or "interrupted")
            _cancel(job_id, logger)
        reader.read(final=True)
    if why and why.startswith("can never start"):
        raise SlurmRejected(
            f"SLURM job {job_id} {why}: the cluster has no room for {nodes} "
            "node(s) with these launch.slurm settings"
        )
    if why or state != "COMPLETED" or fields.get("ExitCode", "0:0") != "0:0":
        reason = fields.get("Reason", "None")
        what = why or (
            f"ended {state} (exit code {fields.get('ExitCode', '?')}"
            + (f", {reason}" if reason not in ("None", "") else "")
            + ")"
        )
        raise SlurmError(f"SLURM job {job_id} {what}\n" + "\n".join(tail))
    return job_id


def _why_stop(
    state: str, fields: dict[str, str], beat: HeartbeatWatch, timeout_s: float | None, since: float
) -> str | None:
    """Why the watch stops a job that has not finished: held, never to start, hung, or past
    `timeout_s` (the watchdog and the timeout count from its start); None to watch on."""
    if state in HELD:
        return f"ended {state}"
    if state == "PENDING" and fields.get("Reason") in NEVER_RUNS:
        return f"can never start ({fields['Reason']})"
    if state == "RUNNING":
        if why := beat.check(since):
            return why
        if timeout_s and time.time() - since > timeout_s:
            return f"still running after {timeout_s:g}s"
    return None


def _start_time(fields: dict[str, str], fallback: float) -> float:
    """When the job started running (its StartTime), for the hang watchdog's first wait."""
    with contextlib.suppress(KeyError, ValueError):
        return time.mktime(time.strptime(fields["StartTime"], "%Y-%m-%dT%H:%M:%S"))
    return fallback
