"""A real two-node SLURM cluster on this machine, on loopback: `munged`, one `slurmctld` and
two `slurmd` (n1, n2), every spool, state, pid and log path in one temporary folder.

Needs root and Debian's `slurmd slurmctld slurm-client munge` (`make test` installs them).
The SLURM commands find the cluster through `SLURM_CONF` (`env()`); nothing global is
changed. Used by tests/tasks/launch/test_slurm.py and benchmarks/multinode.py.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["SlurmCluster", "slurm_available"]

_BINARIES = (
    "taskset",
    "unshare",
    "munged",
    "slurmctld",
    "slurmd",
    "sbatch",
    "srun",
    "scontrol",
    "squeue",
    "scancel",
)


def slurm_available() -> str | None:
    """None when a cluster can be started here, else why not."""
    missing = [b for b in _BINARIES if shutil.which(b) is None]
    if missing:
        return f"missing {', '.join(missing)} (apt-get install slurmd slurmctld slurm-client munge)"
    if os.geteuid() != 0:
        return "slurmd must run as root"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "no munge user (the munge package creates it)"
    if not Path("/etc/munge/munge.key").is_file():
        return "no /etc/munge/munge.key (the munge package creates it; or run mungekey)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    """Start with `start()`, stop with `stop()` (or use it as a context manager)."""

    def __init__(self, base: Path, nodes: tuple[str, ...] = ("n1", "n2"), cpus: int = 1):
        self.base, self.nodes, self.cpus = Path(base), nodes, cpus
        self.conf = self.base / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self.munge_dir: Path | None = None
        self.munge_pid: Path | None = None

    def env(self) -> dict[str, str]:
        """The environment that points the SLURM commands at this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def __enter__(self) -> SlurmCluster:
        try:
            return self.start()
        except BaseException:  # nothing of a half-started cluster stays behind
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout_s: float = 60) -> SlurmCluster:
        b = self.base
        for d in ("spool", "state", "log", "run"):
            (b / d).mkdir(parents=True, exist_ok=True)
        # munged runs as user munge, which must reach its folder: pytest's temporary folders
        # are private to root, so this one lives beside them.
        munge_dir = self.munge_dir = Path(tempfile.mkdtemp(prefix="kiln-munge-"))
        os.chmod(munge_dir, 0o755)
        user = pwd.getpwnam("munge")
        os.chown(munge_dir, user.pw_uid, user.pw_gid)
        key = munge_dir / "munge.key"
        shutil.copyfile("/etc/munge/munge.key", key)
        os.chown(key, user.pw_uid, user.pw_gid)
        os.chmod(key, 0o400)
        socket_path = munge_dir / "munge.socket"
        self.munge_pid = munge_dir / "munged.pid"
        munged = [
            "munged",
            f"--socket={socket_path}",
            f"--key-file={key}",
            f"--pid-file={self.munge_pid}",
            f"--log-file={munge_dir / 'munged.log'}",
            f"--seed-file={munge_dir / 'seed'}",
            "--force",
        ]
        # munged daemonizes itself.
        started = subprocess.run(
            ["runuser", "-u", "munge", "--", *munged], capture_output=True, text=True
        )
        if started.returncode != 0:
            raise RuntimeError(f"munged did not start: {started.stderr.strip()}")
        self.munge_pid = munge_dir / "munged.pid"
        ctl_port = _free_port()
        lines = [
            "ClusterName=kiln-test",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={ctl_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            f"AuthInfo=socket={socket_path}",
            "CredType=cred/munge",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "ReturnToService=2",
            "SchedulerType=sched/builtin",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            "MinJobAge=600",
            "KillWait=5",
            "InactiveLimit=0",
            "SlurmdTimeout=30",
            f"StateSaveLocation={b / 'state'}",
            f"SlurmdSpoolDir={b / 'spool'}/%n",
            f"SlurmctldPidFile={b / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={b / 'run'}/slurmd-%n.pid",
            f"SlurmctldLogFile={b / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={b / 'log'}/slurmd-%n.log",
        ]
        for node in self.nodes:
            lines.append(
                f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 "
                f"Port={_free_port()} CPUs={self.cpus} State=UNKNOWN"
            )
        lines.append(
            f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES "
            "MaxTime=INFINITE State=UP"
        )
        self.conf.write_text("\n".join(lines) + "\n")
        for node in self.nodes:
            (b / "spool" / node).mkdir(exist_ok=True)
        self._daemon(["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld")
        cores = sorted(os.sched_getaffinity(0))
        for i, node in enumerate(self.nodes):
            # Each node gets its own /dev/shm and its own core, as separate machines have:
            # streaming's local leader on each node registers its shared memory under the same
            # name, and a rank sizes its threads by the cores it may run on.
            slurmd = shlex.join(["slurmd", "-D", "-N", node, "-f", str(self.conf)])
            core = str(cores[i % len(cores)])
            self._daemon(
                [
                    "taskset",
                    "-c",
                    core,
                    "unshare",
                    "--mount",
                    "--propagation",
                    "private",
                    "sh",
                    "-c",
                    f"mount -t tmpfs -o size=1g tmpfs /dev/shm && exec {slurmd}",
                ],
                f"slurmd-{node}",
            )
        self._wait_idle(timeout_s)
        return self

    def _daemon(self, argv: list[str], name: str) -> None:
        with open(self.base / "log" / f"{name}.stdout", "wb") as log:  # the child keeps its copy
            self.procs.append(
                subprocess.Popen(
                    argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env(),
                    start_new_session=True,
                )
            )

    def _wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        out = ""
        while time.monotonic() < deadline:
            proc = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, env=self.env()
            )
            out = proc.stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            if proc.returncode == 0 and all(states.get(n) == "idle" for n in self.nodes):
                return
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited {p.returncode}: see {self.base}/log")
            time.sleep(0.5)
        raise RuntimeError(f"the SLURM nodes did not become idle in {timeout_s}s: {out!r}")

    def jobs(self) -> list[str]:
        """The ids of the jobs in the queue (pending or running)."""
        out = subprocess.run(
            ["squeue", "-h", "-o", "%i"], capture_output=True, text=True, env=self.env(), check=True
        ).stdout
        return out.split()

    def stop(self) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):  # no controller: nothing to cancel
            subprocess.run(
                ["scancel", "--full", "-u", "root"], env=self.env(), capture_output=True, timeout=30
            )
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        if self.munge_pid is not None and self.munge_pid.is_file():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(self.munge_pid.read_text().strip()), signal.SIGTERM)
        if self.munge_dir is not None:
            shutil.rmtree(self.munge_dir, ignore_errors=True)
