"""Ratings under load: 50 concurrent raters, 40 pairs each, against `kiln rate serve` on SQLite
and on PostgreSQL, over loopback.

Each rater answers as fast as the app does (GET the page, POST the ballot: the raters of
tests/human_eval/rating_load.py). Checked on each backend: every ballot stored exactly once, on
distinct pairs for each rater (no rater sees a pair twice), no pair over its quota, the admin
page's count equal to the database's; then the app is stopped and PostgreSQL restarted
(`pg_ctl restart`), and the app started again shows the same count. Written: votes per second
and the vote POST's p50 and p99 latency for both backends, in one run, so the two compare on
the same machine.

    python benchmarks/ratings_load.py --out benchmarks/results/ratings_load.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from human_eval.store import RatingStore, sqlite_url  # noqa: E402
from human_eval.studies import create_comparison, load_study  # noqa: E402
from tasks.storage.layout import Layout  # noqa: E402


def _load(name: str, folder: str = "tests/human_eval"):
    """A test helper module by its file (`tests` is not a package outside pytest)."""
    spec = importlib.util.spec_from_file_location(name, REPO / folder / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


helpers = _load("conftest")  # studies on disk and the app as a process
load = _load("rating_load")  # the simulated raters
servers = _load("servers", "tests")  # a free port

RATERS, VOTES, PAIRS, LIMIT_S = 50, 40, 450, 900  # 450 pairs x K=5 >= 2,000 ballots


class Postgres:
    """A private server in a temporary folder, on a Unix socket (as `postgres` when root)."""

    def __init__(self):
        bins = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
        if not bins:
            raise SystemExit("PostgreSQL's server is not installed (make system-packages)")
        self.bin = bins[-1].parent
        self.base = Path(tempfile.mkdtemp(prefix="kiln-bench-pg-"))
        self.run_as = []
        if os.geteuid() == 0:
            shutil.chown(self.base, "postgres", "postgres")
            self.run_as = ["runuser", "-u", "postgres", "--"]
        self.data = self.base / "data"
        self._pg("initdb", "-D", str(self.data), "-U", "kiln", "--auth=trust")
        self.opts = f"-k {self.base} -c listen_addresses=''"
        self.ctl("start")

    def _pg(self, *args: str) -> None:
        cmd = [*self.run_as, str(self.bin / args[0]), *args[1:]]
        subprocess.run(cmd, check=True, capture_output=True)

    def ctl(self, action: str) -> None:
        log = str(self.base / "server.log")
        self._pg("pg_ctl", "-D", str(self.data), "-l", log, "-w", "-o", self.opts, action)

    def url(self, db: str) -> str:
        import psycopg

        with psycopg.connect(host=str(self.base), user="kiln", dbname="postgres") as c:
            c.autocommit = True
            c.execute(f'CREATE DATABASE "{db}"')
        return f"postgresql+psycopg://kiln@/{db}?host={self.base}"

    def close(self) -> None:
        self._pg("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")
        shutil.rmtree(self.base, ignore_errors=True)


def _admin_count(base: str, token: str) -> int:
    page = httpx.get(f"{base}/admin/{token}", timeout=60).text
    return int(page.split("votes ", 1)[1].split(" of ")[0])


def run_backend(name: str, work: Path, pg: Postgres | None) -> dict:
    root = work / name
    prompts = helpers.many_prompts(PAIRS)
    a = helpers.write_study(root, "study-a", prompts=prompts, size=16)
    b = helpers.write_study(root, "study-b", prompts=prompts, size=16, colour=(0, 0, 250))
    url = pg.url(f"bench_{int(time.time())}") if pg else sqlite_url(Layout(root).ratings_db())
    store = RatingStore(url)
    cid, _ = create_comparison(store, load_study(a), load_study(b), raters_per_pair=5, gold=0)
    tokens = [t for _, t in store.add_raters(cid, RATERS)]
    config = work / f"{name}.yaml"
    base_cfg = str(REPO / "configs" / "tiny.yaml")
    config.write_text(yaml.safe_dump({"base": base_cfg, "human_eval": {"database_url": url}}))
    port = servers.free_port()
    argv = helpers.serve_argv(root, port, str(config))
    proc, base = helpers.start_server(argv, port)
    try:
        raters, t0, deadline = load.run_load(base, tokens, VOTES, LIMIT_S)
        load.join(raters, deadline)
        wall = time.perf_counter() - t0
        token = store.new_admin_token(rotate=True)
        shown = _admin_count(base, token)
    finally:
        helpers.stop(proc)
    load.check_exact(store, cid, RATERS, VOTES)
    ballots = store.count_votes(cid) // 2
    store.close()
    if pg:
        pg.ctl("restart")
    proc, base = helpers.start_server(argv, port)
    try:
        after = _admin_count(base, token)
    finally:
        helpers.stop(proc)
    store = RatingStore(url)
    load.check_exact(store, cid, RATERS, VOTES)
    store.close()
    if not ballots == shown == after == RATERS * VOTES:
        raise SystemExit(f"{name}: stored {ballots}, shown {shown}, after the restart {after}")
    return load.latency_summary(raters, wall) | {
        "ballots_stored": ballots,
        "admin_page_count": shown,
        "after_restart": after,
        "restarted": "app and PostgreSQL" if pg else "app",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="JSON output path")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kiln-ratings-load-"))
    pg = Postgres()
    try:
        res = {
            "raters": RATERS,
            "pairs_each": VOTES,
            "sqlite": run_backend("sqlite", work, None),
            "postgresql": run_backend("postgresql", work, pg),
        }
    finally:
        pg.close()
        shutil.rmtree(work, ignore_errors=True)
    s, q = res["sqlite"], res["postgresql"]
    res["postgresql_vs_sqlite"] = {
        "votes_per_s": round(q["votes_per_s"] / s["votes_per_s"], 2),
        "p99_ms": round(q["p99_ms"] / s["p99_ms"], 2),
    }
    res["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    sys.stdout.write(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
