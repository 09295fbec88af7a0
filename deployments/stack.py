"""A team's services on one machine, started as they would run on several: `kiln stack`.

    kiln stack --dir ./stack          (or `make stack`)

- **PostgreSQL** (Debian's, 14 or newer), data in `<dir>/postgres`, on 127.0.0.1 with password
  (SCRAM) authentication. Databases: `prefect` (with `pg_trgm`, as Prefect's docs ask), `mlflow`,
  `mlflow_auth` (the tracking server's users) and `ratings`.
- **An S3 object store**: moto's server on 127.0.0.1 stands in for MinIO or AWS, with its
  authentication on (`deployments/object_store.py`): an unsigned request or a wrong key is
  refused, the members' key reaches the bucket but `mlflow/`, and only the MLflow server's key
  reaches `mlflow/`, the registry's artifacts. Its objects live in its memory: they are gone
  when the stack stops. `--s3-endpoint` names a real one instead (its keys from the
  environment's `AWS_ACCESS_KEY_ID` and `AWS_SECRET_ACCESS_KEY`, for both uses).
- **Prefect**: the server on PostgreSQL with an auth string (the UI asks for it), the process
  work pool `kiln-process`, and a worker polling it.
- **MLflow**: the tracking server with its backend store on PostgreSQL, artifacts proxied to
  `s3://<bucket>/mlflow` (clients need no S3 keys) and the `basic-auth` app. Users: `admin`,
  `kiln` (the worker's and the team's pipeline user) and `viewer` (read only: a consumer).
- **The rating app** (`kiln rate serve`) on PostgreSQL.

Secrets are made once, into `<dir>/secrets.env` (mode 600), and kept: a restarted stack opens the
same databases. Each service gets its secrets in its environment, never on its command line
(`ps` shows command lines to every user). `<dir>/team.env` (mode 600) holds what a Kiln user
exports to work against the stack with `configs/team.yaml`; `<dir>/viewer.env` holds what a
registry consumer needs: the tracking URL and the viewer's login, nothing else.

PostgreSQL and the object store listen on 127.0.0.1 only; `--public-host` moves the three web
services (Prefect, MLflow, the rating app). The stack prints each UI's link and stops every
service on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

__all__ = ["Stack", "StackError", "main", "read_env_file"]

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parent.parent
POOL = "kiln-process"
# PostgreSQL and the object store listen here only, whatever the web services do.
LOOPBACK = "127.0.0.1"
# Each database and the role that owns it (the service's login).
PG_DATABASES = {
    "prefect": "prefect",
    "mlflow": "mlflow",
    "mlflow_auth": "mlflow",
    "ratings": "ratings",
}
# Each owner role and the secret that holds its password.
ROLE_SECRETS = {
    "prefect": "PREFECT_DB_PASSWORD",
    "mlflow": "MLFLOW_DB_PASSWORD",
    "ratings": "RATINGS_DB_PASSWORD",
}
PG_VERSIONS = ("17", "16", "15", "14")  # Prefect asks for PostgreSQL 14.9 or newer
HEARTBEAT_S = 30
"""The worker's flow runs' heartbeat period (PREFECT_FLOWS_HEARTBEAT_FREQUENCY; Prefect's least):
the crash automation (deployments/automations.py) acts after three are missed."""


class StackError(RuntimeError):
    """A service did not start, with what to do about it."""


def read_env_file(path: Path) -> dict[str, str]:
    """`NAME=value` lines, shell-quoted (the files the stack writes, which `.` reads),
    comments and blank lines skipped."""
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, value = line.partition("=")
            words = shlex.split(value)
            out[name.strip()] = words[0] if words else ""
    return out


def _write_private(path: Path, text: str) -> None:
    """Write `text` readable by its owner alone from its first byte (mode 600), through a new
    temporary file of its own (never one that was there, nor a link)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _env_text(values: dict[str, str], header: str) -> str:
    return f"# {header}\n" + "".join(f"{k}={shlex.quote(v)}\n" for k, v in values.items())


def _postgres_bin() -> Path:
    for v in PG_VERSIONS:
        d = Path(f"/usr/lib/postgresql/{v}/bin")
        if (d / "pg_ctl").is_file():
            return d
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).parent
    raise StackError(
        "PostgreSQL's server is not installed: `apt-get install postgresql` (Debian's "
        "postgresql-15 or newer; `make system-packages` installs it)"
    )


_STOP: list[int] = []  # the signals received: a start in progress gives up at its next wait


def _wait(what: str, check: Callable[[], bool], timeout: float, procs=()) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _STOP:
            raise StackError(f"stopped by signal {_STOP[0]} while waiting for {what}")
        for p in procs:
            if p.poll() is not None:
                raise StackError(f"{what}: the process exited ({p.returncode}); see its log")
        if check():
            return
        time.sleep(0.5)  # a poll interval of a bounded wait
    raise StackError(f"{what}: not ready after {timeout:.0f} s; see its log")


def _http_answers(url: str) -> bool:
    """Whether a server answers at `url` at all (a refusal is an answer)."""
    import httpx

    try:
        httpx.get(url, timeout=3)
    except httpx.HTTPError:
        return False
    return True


def _http_ok(url: str, headers: dict | None = None, auth=None) -> bool:
    import httpx

    try:
        return httpx.get(url, headers=headers, auth=auth, timeout=3).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class Ports:
    postgres: int = 5432
    s3: int = 9000
    prefect: int = 4200
    mlflow: int = 5000
    ratings: int = 8765


@dataclass
class Stack:
    """The stack's services, started in order by `start` and stopped in reverse by `stop`."""

    dir: Path
    ports: Ports = field(default_factory=Ports)
    host: str = "127.0.0.1"
    bucket: str = "kiln"
    s3_endpoint: str | None = None  # a real object store; default: moto's server
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    _pg_started: bool = False
    _db_owners: dict[str, str] = field(default_factory=dict)
    _restarts: list[float] = field(default_factory=list)

    # --- secrets and the environments -----------------------------------------------------

    def secrets(self) -> dict[str, str]:
        """The stack's secrets: made on its first start, read back on every later one."""
        path = self.dir / "secrets.env"
        kept = read_env_file(path) if path.is_file() else {}
        tok = lambda: secrets.token_urlsafe(24)  # noqa: E731
        values = {
            "POSTGRES_PASSWORD": tok(),
            "RATINGS_DB_PASSWORD": tok(),
            "PREFECT_DB_PASSWORD": tok(),
            "MLFLOW_DB_PASSWORD": tok(),
            "PREFECT_AUTH_PASSWORD": tok(),
            "MLFLOW_ADMIN_PASSWORD": tok(),
            "MLFLOW_KILN_PASSWORD": tok(),
            "MLFLOW_VIEWER_PASSWORD": tok(),
            "MLFLOW_FLASK_SERVER_SECRET_KEY": tok(),
            # The members' and the worker's key to the object store (images), and the MLflow
            # server's (artifacts), which no member holds.
            "AWS_ACCESS_KEY_ID": "AKIA" + secrets.token_hex(8).upper(),
            "AWS_SECRET_ACCESS_KEY": tok(),
            "S3_ARTIFACTS_KEY_ID": "AKIA" + secrets.token_hex(8).upper(),
            "S3_ARTIFACTS_SECRET": tok(),
        }
        if self.s3_endpoint:  # a real store's keys are the caller's, for both uses
            values["AWS_ACCESS_KEY_ID"] = os.environ.get("AWS_ACCESS_KEY_ID", "")
            values["AWS_SECRET_ACCESS_KEY"] = os.environ.get("AWS_SECRET_ACCESS_KEY", "")
            values["S3_ARTIFACTS_KEY_ID"] = values["AWS_ACCESS_KEY_ID"]
            values["S3_ARTIFACTS_SECRET"] = values["AWS_SECRET_ACCESS_KEY"]
        if kept.keys() >= values.keys():
            return kept
        values |= kept  # the ones made before stay: the databases were set up with them
        _write_private(path, _env_text(values, "kiln stack's secrets: keep this file private"))
        return values

    def pg_url(self, db: str, driver: str = "psycopg") -> str:
        """A service's own database, as the database's owner role: not a superuser, and
        never handed to a member. A database that an older stack made (owned by the server's
        login) is reached as that login, as before."""
        role = self._db_owners.get(db, "kiln")
        secret = ROLE_SECRETS.get(role, "POSTGRES_PASSWORD")
        pw = quote(self._secrets[secret], safe="")
        return f"postgresql+{driver}://{role}:{pw}@{LOOPBACK}:{self.ports.postgres}/{db}"

    def ratings_url(self) -> str:
        """The ratings database, as its own role: owner of that database and nothing else."""
        pw = quote(self._secrets["RATINGS_DB_PASSWORD"], safe="")
        return f"postgresql+psycopg://ratings:{pw}@{LOOPBACK}:{self.ports.postgres}/ratings"

    @property
    def s3_url(self) -> str:
        return self.s3_endpoint or f"http://{LOOPBACK}:{self.ports.s3}"

    @property
    def prefect_api(self) -> str:
        return f"http://{self.host}:{self.ports.prefect}/api"

    @property
    def mlflow_url(self) -> str:
        return f"http://{self.host}:{self.ports.mlflow}"

    def team_env(self) -> dict[str, str]:
        """What a Kiln user (and the worker) exports to run against the stack."""
        s = self._secrets
        return {
            "PREFECT_API_URL": self.prefect_api,
            "PREFECT_API_AUTH_STRING": f"admin:{s['PREFECT_AUTH_PASSWORD']}",
            "MLFLOW_TRACKING_URI": self.mlflow_url,
            "MLFLOW_TRACKING_USERNAME": "kiln",
            "MLFLOW_TRACKING_PASSWORD": s["MLFLOW_KILN_PASSWORD"],
            # A model of several GB goes through the server's proxy in parts, each request
            # with time to finish (docs/operations.md, "Running Kiln for a team").
            "MLFLOW_ENABLE_PROXY_MULTIPART_UPLOAD": "true",
            "MLFLOW_HTTP_REQUEST_TIMEOUT": "900",
            "KILN_ROOT": str(self.dir / "root"),
            "KILN_RATINGS_DATABASE_URL": self.ratings_url(),
            "KILN_S3_ENDPOINT_URL": self.s3_url,
            "KILN_SOURCE": f"s3://{self.bucket}/images",
            "AWS_ACCESS_KEY_ID": s["AWS_ACCESS_KEY_ID"],
            "AWS_SECRET_ACCESS_KEY": s["AWS_SECRET_ACCESS_KEY"],
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def viewer_env(self) -> dict[str, str]:
        """A registry consumer's: the tracking URL and a read-only login."""
        return {
            "MLFLOW_TRACKING_URI": self.mlflow_url,
            "MLFLOW_TRACKING_USERNAME": "viewer",
            "MLFLOW_TRACKING_PASSWORD": self._secrets["MLFLOW_VIEWER_PASSWORD"],
        }

    def _env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
        env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
        return env | extra

    def _log(self, name: str):
        path = self.dir / "logs" / f"{name}.log"
        return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "a")

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
        with self._log(name) as log:
            p = subprocess.Popen(
                cmd,
                env=env,
                cwd=self.dir,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs[name] = p
        return p

    # --- the services -----------------------------------------------------------------------

    def start(self, say: Callable[[str], None]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        # Others may pass through (PostgreSQL runs as `postgres` under root), never list it.
        os.chmod(self.dir, 0o711)
        (self.dir / "logs").mkdir(mode=0o700, exist_ok=True)
        (self.dir / "root").mkdir(exist_ok=True)
        self._secrets = self.secrets()
        _write_private(
            self.dir / "team.env",
            _env_text(self.team_env(), "kiln stack: `set -a; . team.env; set +a`, then kiln"),
        )
        _write_private(
            self.dir / "viewer.env",
            _env_text(self.viewer_env(), "a registry consumer's: the URL and a read-only login"),
        )
        self._start_postgres()
        dbs = ", ".join(PG_DATABASES)
        say(f"PostgreSQL    {LOOPBACK}:{self.ports.postgres} (databases {dbs})")
        if self.s3_endpoint:
            self._ensure_bucket()
        else:
            self._start_s3()  # makes the bucket itself
        say(f"S3            {self.s3_url} (bucket {self.bucket})")
        self._start_prefect()
        say(f"Prefect UI    http://{self.host}:{self.ports.prefect} (the auth string: team.env)")
        self._start_mlflow()
        say(f"MLflow UI     {self.mlflow_url} (users admin, kiln, viewer: secrets.env)")
        self._start_ratings()
        say(
            f"Rating app    http://{self.host}:{self.ports.ratings} (its admin link: "
            "kiln rate admin-link --config configs/team.yaml)"
        )
        say(f"Environment   {self.dir / 'team.env'} (a consumer's: {self.dir / 'viewer.env'})")
        say("kiln stack is up: Ctrl-C stops it")

    def _pg(self, *args: str) -> list[str]:
        """A PostgreSQL server command, as the `postgres` user when run as root (the server
        refuses to run as root)."""
        cmd = [str(_postgres_bin() / args[0]), *args[1:]]
        return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd

    def _start_postgres(self) -> None:
        import psycopg

        pg = self.dir / "postgres"
        data = pg / "data"
        if not (data / "PG_VERSION").is_file():  # none, or an initdb that did not finish
            pg.mkdir(exist_ok=True)
            if data.exists():
                shutil.rmtree(data)
            pwfile = pg / "pw"
            _write_private(pwfile, self._secrets["POSTGRES_PASSWORD"] + "\n")
            if os.geteuid() == 0:
                for p in (pg, pwfile):
                    shutil.chown(p, "postgres", "postgres")
                os.chmod(pg, 0o700)
            init = self._pg(
                "initdb",
                "-D",
                str(data),
                "-U",
                "kiln",
                "--auth=scram-sha-256",
                f"--pwfile={pwfile}",
            )
            try:
                r = subprocess.run(init, capture_output=True, text=True)
            finally:
                pwfile.unlink(missing_ok=True)
            if r.returncode:
                raise StackError(
                    f"initdb failed in {data}: {r.stderr.strip()[-600:]} (as root, the "
                    "`postgres` user must be able to reach this folder: give --dir one it can)"
                )
        opts = f"-p {self.ports.postgres} -c listen_addresses={LOOPBACK} -k {pg}"
        log = pg / "server.log"
        start = self._pg("pg_ctl", "-D", str(data), "-l", str(log), "-w", "-o", opts, "start")
        self._pg_started = True  # before: a server that comes up late is still stopped
        r = subprocess.run(start, capture_output=True, text=True)
        if r.returncode:
            tail = log.read_text()[-800:] if log.is_file() else r.stderr
            raise StackError(f"PostgreSQL did not start: {tail.strip()}")
        conn = dict(
            host=LOOPBACK,
            port=self.ports.postgres,
            user="kiln",
            password=self._secrets["POSTGRES_PASSWORD"],
        )
        with psycopg.connect(dbname="postgres", autocommit=True, **conn) as c:
            have = {r[0] for r in c.execute("SELECT datname FROM pg_database")}
            roles = {r[0] for r in c.execute("SELECT rolname FROM pg_roles")}
            # One owner role per service, each its database(s) only: not a superuser, so an
            # SQL injection in a server cannot reach the machine (`COPY ... TO PROGRAM`). The
            # `ratings` role is also the members' (they rate and report).
            for role, secret in ROLE_SECRETS.items():
                if role not in roles:
                    pw = self._secrets[secret].replace("'", "''")
                    c.execute(f"CREATE ROLE \"{role}\" LOGIN NOSUPERUSER PASSWORD '{pw}'")
            for db in PG_DATABASES:
                if db not in have:
                    c.execute(f'CREATE DATABASE "{db}" OWNER "{PG_DATABASES[db]}"')
                    c.execute(f'REVOKE ALL ON DATABASE "{db}" FROM PUBLIC')
            rows = c.execute("SELECT datname, pg_get_userbyid(datdba) FROM pg_database")
            self._db_owners = {db: owner for db, owner in rows if db in PG_DATABASES}
        with psycopg.connect(dbname="prefect", autocommit=True, **conn) as c:
            c.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm")

    def _start_s3(self) -> None:
        s = self._secrets
        env = self._env(
            KILN_S3_IMAGES_KEY_ID=s["AWS_ACCESS_KEY_ID"],
            KILN_S3_IMAGES_SECRET=s["AWS_SECRET_ACCESS_KEY"],
            KILN_S3_ARTIFACTS_KEY_ID=s["S3_ARTIFACTS_KEY_ID"],
            KILN_S3_ARTIFACTS_SECRET=s["S3_ARTIFACTS_SECRET"],
        )
        env = {k: v for k, v in env.items() if not k.startswith("AWS_")}
        cmd = [sys.executable, "-m", "deployments.object_store", "--host", LOOPBACK]
        cmd += ["--port", str(self.ports.s3), "--bucket", self.bucket]
        p = self._spawn("s3", cmd, env)
        _wait("the S3 server", lambda: _http_answers(self.s3_url), 60, [p])

    def _ensure_bucket(self) -> None:
        import boto3

        s = self._secrets
        client = boto3.client(
            "s3",
            endpoint_url=self.s3_url,
            aws_access_key_id=s["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=s["AWS_SECRET_ACCESS_KEY"],
            region_name="us-east-1",
        )
        names = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
        if self.bucket not in names:
            client.create_bucket(Bucket=self.bucket)

    def _prefect_env(self) -> dict[str, str]:
        return self._env(
            PREFECT_HOME=str(self.dir / "prefect"),
            PREFECT_API_URL=self.prefect_api,
            PREFECT_API_AUTH_STRING=self.team_env()["PREFECT_API_AUTH_STRING"],
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
        )

    def _start_prefect(self) -> None:
        env = self._prefect_env() | {
            "PREFECT_SERVER_API_AUTH_STRING": self.team_env()["PREFECT_API_AUTH_STRING"],
            "PREFECT_SERVER_DATABASE_CONNECTION_URL": self.pg_url("prefect", "asyncpg"),
        }
        cmd = [str(BIN / "prefect"), "server", "start", "--host", self.host]
        p = self._spawn("prefect-server", [*cmd, "--port", str(self.ports.prefect)], env)
        auth = base64.b64encode(env["PREFECT_API_AUTH_STRING"].encode()).decode()
        _wait(
            "the Prefect server",
            lambda: _http_ok(f"{self.prefect_api}/health", {"Authorization": f"Basic {auth}"}),
            180,
            [p],
        )
        pool = [str(BIN / "prefect"), "work-pool", "create", POOL, "--type", "process"]
        r = subprocess.run(pool, env=self._prefect_env(), capture_output=True, text=True)
        if r.returncode and "already exists" not in r.stdout + r.stderr:
            raise StackError(f"prefect work-pool create failed: {(r.stdout + r.stderr)[-600:]}")
        # A dead worker's runs are marked Crashed once their heartbeats stop
        # (deployments/automations.py).
        crash = [
            sys.executable,
            "-m",
            "deployments.automations",
            "--within-s",
            str(3 * HEARTBEAT_S),
        ]
        r = subprocess.run(crash, env=self._prefect_env(), cwd=REPO, capture_output=True, text=True)
        if r.returncode:
            raise StackError(f"the crash automation was not created: {r.stderr[-600:]}")
        self._start_worker()

    def _start_worker(self) -> subprocess.Popen:
        worker_env = self._prefect_env() | self.team_env()
        worker_env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] = str(HEARTBEAT_S)
        worker = [str(BIN / "prefect"), "worker", "start", "--pool", POOL, "--type", "process"]
        return self._spawn("prefect-worker", worker, worker_env)

    def _start_mlflow(self) -> None:
        s = self._secrets
        ini = self.dir / "mlflow-auth.ini"
        _write_private(
            ini,
            "[mlflow]\ndefault_permission = READ\n"
            f"database_uri = {self.pg_url('mlflow_auth')}\nadmin_username = admin\n"
            "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n",
        )
        env = self._env(
            MLFLOW_BACKEND_STORE_URI=self.pg_url("mlflow"),
            MLFLOW_AUTH_CONFIG_PATH=str(ini),
            MLFLOW_AUTH_ADMIN_PASSWORD=s["MLFLOW_ADMIN_PASSWORD"],
            MLFLOW_FLASK_SERVER_SECRET_KEY=s["MLFLOW_FLASK_SERVER_SECRET_KEY"],
            MLFLOW_S3_ENDPOINT_URL=self.s3_url,
            AWS_ACCESS_KEY_ID=s["S3_ARTIFACTS_KEY_ID"],
            AWS_SECRET_ACCESS_KEY=s["S3_ARTIFACTS_SECRET"],
            AWS_DEFAULT_REGION="us-east-1",
        )
        cmd = [
            str(BIN / "mlflow"),
            "server",
            "--host",
            self.host,
            "--port",
            str(self.ports.mlflow),
            "--artifacts-destination",
            f"s3://{self.bucket}/mlflow",
            "--app-name",
            "basic-auth",
        ]
        p = self._spawn("mlflow", cmd, env)
        admin = ("admin", s["MLFLOW_ADMIN_PASSWORD"])
        _wait(
            "the MLflow server",
            lambda: _http_ok(
                f"{self.mlflow_url}/api/2.0/mlflow/users/get?username=admin", auth=admin
            ),  # noqa: E501
            180,
            [p],
        )
        for user, key in (("kiln", "MLFLOW_KILN_PASSWORD"), ("viewer", "MLFLOW_VIEWER_PASSWORD")):
            self._mlflow_user(admin, user, s[key])

    def _mlflow_user(self, admin: tuple[str, str], user: str, password: str) -> None:
        import httpx

        api = f"{self.mlflow_url}/api/2.0/mlflow/users"
        if httpx.get(f"{api}/get", params={"username": user}, auth=admin, timeout=10).is_success:
            return
        r = httpx.post(
            f"{api}/create", json={"username": user, "password": password}, auth=admin, timeout=10
        )
        if not r.is_success:
            raise StackError(f"could not create the MLflow user {user}: {r.status_code} {r.text}")

    def _start_ratings(self) -> None:
        # What configs/team.yaml names, and no other credential: not the S3 keys, the Prefect
        # auth string nor an MLflow login.
        team = self.team_env()
        names = ("KILN_ROOT", "KILN_SOURCE", "KILN_S3_ENDPOINT_URL", "KILN_RATINGS_DATABASE_URL")
        env = self._env(MLFLOW_TRACKING_URI=team["MLFLOW_TRACKING_URI"])
        env = {k: v for k, v in env.items() if not k.startswith("AWS_")}
        env |= {k: team[k] for k in names}
        cmd = [
            str(BIN / "kiln"),
            "rate",
            "serve",
            "--config",
            str(REPO / "configs" / "team.yaml"),
            "--host",
            self.host,
            "--port",
            str(self.ports.ratings),
        ]
        p = self._spawn("ratings", cmd, env)
        url = f"http://{self.host}:{self.ports.ratings}/healthz"
        _wait("the rating app", lambda: _http_ok(url), 120, [p])

    # --- running and stopping ---------------------------------------------------------------

    def watch(self, say: Callable[[str], None]) -> str | None:
        """The first service that exited, or None while all run. A worker that died (killed,
        out of memory) is started again, as a process manager would: its runs that died with
        it are marked Crashed by the crash automation, and a new one polls the pool."""
        for name, p in list(self.procs.items()):
            if p.poll() is None:
                continue
            if name == "prefect-worker":
                say(f"kiln stack: the worker exited ({p.returncode}): starting another")
                self._restarts = [t for t in self._restarts if time.monotonic() - t < 60]
                if len(self._restarts) >= 5:
                    return "the worker exited 5 times in a minute; see its log"
                self._restarts.append(time.monotonic())
                self._start_worker()
                continue
            return f"{name} exited ({p.returncode}); see {self.dir / 'logs' / name}.log"
        return None

    def stop(self) -> None:
        """Stop every service, the last started first; PostgreSQL last, after its clients."""
        for name in reversed(list(self.procs)):
            p = self.procs[name]
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=30)
            # A leader gone leaves its group: children that outlived it (a server's workers).
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        self.procs.clear()
        if self._pg_started:
            data = self.dir / "postgres" / "data"
            subprocess.run(
                self._pg("pg_ctl", "-D", str(data), "-m", "fast", "-w", "stop"), capture_output=True
            )
            self._pg_started = False


def _say(line: str, err: bool = False) -> None:
    stream = sys.stderr if err else sys.stdout
    stream.write(line + "\n")
    stream.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kiln stack", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=Path("stack"), help="The stack's folder (kept).")
    p.add_argument(
        "--public-host",
        "--host",
        dest="host",
        default=LOOPBACK,
        help="Address the web services (Prefect, MLflow, the rating app) listen on; PostgreSQL "
        "and the object store stay on 127.0.0.1.",
    )
    p.add_argument("--bucket", default="kiln", help="The S3 bucket for artifacts and images.")
    p.add_argument("--s3-endpoint", default=None, help="A running object store (default moto's).")
    defaults = Ports()
    for name in ("postgres", "s3", "prefect", "mlflow", "ratings"):
        p.add_argument(f"--{name}-port", type=int, default=getattr(defaults, name))
    a = p.parse_args(argv)
    ports = Ports(**{n: getattr(a, f"{n}_port") for n in vars(defaults)})
    stack = Stack(a.dir.resolve(), ports, a.host, a.bucket, a.s3_endpoint)

    stops = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    for sig in stops:  # noted only: a start in progress gives up at its next wait
        signal.signal(sig, lambda signum, _frame: _STOP.append(signum))
    try:
        stack.start(_say)
        while not _STOP:
            dead = stack.watch(_say)
            if dead:
                _say(f"kiln stack: {dead}; stopping the others", err=True)
                return 1
            time.sleep(1)
        _say("kiln stack: stopping")
        return 0
    except StackError as e:
        _say(f"kiln stack: {e}", err=True)
        return 1
    finally:
        for sig in stops:  # a second Ctrl-C does not interrupt the stopping
            signal.signal(sig, signal.SIG_IGN)
        stack.stop()


if __name__ == "__main__":
    sys.exit(main())
