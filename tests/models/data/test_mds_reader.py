"""The MDS reader (`models.data.mds_reader`): samples read as views of the mapped shard file."""

import numpy as np
import pytest
from streaming import MDSWriter, StreamingDataset

from models.data.mds_reader import MDSReader


def test_mapped_reads_match_streamings_reader(tmp_path, tiny_shards):
    """The mapped-shard reader returns exactly what StreamingDataset.get_item does,
    for image shards and for ndarray columns whose shape changes from sample to sample."""
    _, root, version = tiny_shards
    arrays = tmp_path / "arrays"
    cols = {
        "key": "str",
        "caption": "str",
        "a": "ndarray:float16",
        "b": "ndarray",
        "c": "ndarray:int32:3",
        "n": "int32",
        "meta": "json",
    }
    rng = np.random.default_rng(0)
    with MDSWriter(out=str(arrays), columns=cols, size_limit=1 << 12) as w:
        for i in range(40):
            shape = (4, 2, 2) if i % 7 else (2, 3)  # a shape change breaks the header cache
            w.write(
                {
                    "key": f"k{i}",
                    "caption": f"é {i}",
                    "n": i,
                    "meta": {"i": i},
                    "a": rng.standard_normal(shape).astype(np.float16),
                    "b": rng.standard_normal(5) if i % 2 else rng.integers(0, 9, (2, 2)),
                    "c": np.arange(3, dtype=np.int32) + i,
                }
            )
    for local in (str(root / "shards" / version / "32"), str(arrays)):
        ours = MDSReader(local=local, batch_size=1, shuffle=False)
        ref = StreamingDataset(local=local, batch_size=1, shuffle=False)
        assert ours.num_samples == ref.num_samples > 0
        assert len(ref.shards) > 1  # several shards, so the shard lookup is exercised
        for i in range(ref.num_samples):
            got, want = ours.read_sample(i), ref.get_item(i)
            assert got.keys() == want.keys()
            for k, v in want.items():
                if isinstance(v, np.ndarray):
                    assert got[k].dtype == v.dtype and np.array_equal(got[k], v), (i, k)
                elif isinstance(v, bytes):
                    assert bytes(got[k]) == v, (i, k)
                else:
                    assert got[k] == v, (i, k)


# Two ranks over gloo look for a free shared-memory prefix while another job's dataset closes:
# rank 0 looks while the job still holds the first free prefix, rank 1 after the job let it go
# (the suite failed so once, with the other test worker's datasets opening and closing).
RACE = """
import json, sys
from torch import distributed as dist
dist.init_process_group("gloo")
from streaming.base.constant import LOCALS, SHM_TO_CLEAN
from streaming.base.shared import SharedMemory
from streaming.base.shared import prefix as P
from streaming.base.world import World
import models.data.mds_reader as reader

rank, look, calls = dist.get_rank(), P._check_and_find_retrying, []
if rank == 0:  # the other job holds the first free prefix while rank 0 looks
    held = look([sys.argv[2]], [None], shm_name=LOCALS, retry=0)
    data = P._pack_locals(["/another/job"], held)
    job = SharedMemory(P._get_path(held, LOCALS), True, len(data))
    job.buf[: len(data)] = data


def racing_look(*args, **kwargs):
    calls.append(1)
    if rank == 1 and len(calls) == 1:
        dist.barrier()  # rank 0 has looked and the job has closed its dataset
    got = look(*args, **kwargs)
    if rank == 0 and len(calls) == len(SHM_TO_CLEAN):
        job.cleanup()  # closes and unlinks what it created
        dist.barrier()
    return got


P._check_and_find_retrying = racing_look
get = reader.agreed_shm_prefix if sys.argv[1] == "kiln" else P.get_shm_prefix
try:
    prefix, shm = get([sys.argv[2]], [None], World.detect())
    out = {"prefix": prefix}
except RuntimeError as e:
    out = {"error": str(e)}
dist.barrier()
print(json.dumps(out), flush=True)
"""


# Both ranks of one run share a /dev/shm of their own: another test worker's datasets,
# opening and closing beside them, would otherwise take or free prefixes mid-race.
PRIVATE_SHM = """
mount -t tmpfs -o size=64m tmpfs /dev/shm || exit 90
RANK=0 LOCAL_RANK=0 "$0" -c "$1" "$2" "$3" >"$4/out0" 2>"$4/err0" & a=$!
RANK=1 LOCAL_RANK=1 "$0" -c "$1" "$2" "$3" >"$4/out1" 2>"$4/err1" & b=$!
wait $a; echo $? >"$4/rc0"; wait $b; echo $? >"$4/rc1"
"""


@pytest.mark.integration
def test_ranks_agree_on_the_shared_memory_prefix_when_another_job_takes_one(tmp_path):
    import json
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    # A mount namespace of its own; outside root, inside a user namespace that maps to root.
    unshare = ["unshare", "--mount", "--propagation", "private"]
    if os.geteuid() != 0:
        unshare[1:1] = ["--user", "--map-root-user"]
    results = {}
    for impl in ("streaming", "kiln"):
        run = tmp_path / impl  # distinct locals: the two runs do not collide
        run.mkdir()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "PYTHONPATH": str(repo),
        }
        done = subprocess.run(
            [*unshare, "sh", "-c", PRIVATE_SHM, sys.executable, RACE, impl, f"{run}/local", run],
            cwd=repo,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        results[impl] = []
        for r in (0, 1):
            err = (run / f"err{r}").read_text()
            assert (run / f"rc{r}").read_text().strip() == "0", err[-3000:]
            results[impl].append(json.loads((run / f"out{r}").read_text().splitlines()[-1]))
    # streaming's own: the leader registered the prefix after the job's, rank 1 the job's.
    assert "prefix" in results["streaming"][0]
    assert "was not registered by local leader" in results["streaming"][1]["error"]
    # Kiln's: both ranks take the node's largest pick, the one the leader found free.
    a, b = results["kiln"]
    assert "prefix" in a and a == b


# One process: another job claims the free prefix between streaming's look and its claim.
CLAIM = """
import json, sys
from streaming.base.constant import LOCALS, SHM_TO_CLEAN
from streaming.base.shared import SharedMemory
from streaming.base.shared import prefix as P
from streaming.base.world import World
import models.data.mds_reader as reader

look, calls, jobs = P._check_and_find_retrying, [], []


def look_then_lose_it(*args, **kwargs):
    got = look(*args, **kwargs)
    calls.append(got)
    if len(calls) == len(SHM_TO_CLEAN):  # the first full look: the job takes its pick
        data = P._pack_locals(["/another/job"], got)
        jobs.append(SharedMemory(P._get_path(got, LOCALS), True, len(data)))
        jobs[-1].buf[: len(data)] = data
    return got


P._check_and_find_retrying = look_then_lose_it
get = reader.agreed_shm_prefix if sys.argv[1] == "kiln" else P.get_shm_prefix
try:
    prefix, shm = get([sys.argv[2]], [None], World.detect())
    out = {"prefix": prefix, "job": calls[len(SHM_TO_CLEAN) - 1]}
    shm.cleanup()
except FileExistsError as e:
    out = {"error": str(e)}
for job in jobs:
    job.cleanup()
print(json.dumps(out), flush=True)
"""


def test_a_prefix_taken_between_look_and_claim_is_looked_for_again(tmp_path):
    """streaming's own claim fails when another job on the machine takes the free prefix
    first; Kiln's looks again and takes the next free one."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(repo)
    got = {}
    for impl in ("streaming", "kiln"):
        cmd = [sys.executable, "-c", CLAIM, impl, str(tmp_path / impl)]
        done = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        got[impl] = json.loads(done.stdout.splitlines()[-1])
    assert "File exists" in got["streaming"]["error"]
    assert got["kiln"]["prefix"] != got["kiln"]["job"]
