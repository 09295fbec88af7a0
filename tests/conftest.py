"""Tiny, seeded fixtures: demo images, a tiny pipeline config, moto's S3 server, Prefect."""

from __future__ import annotations

import contextlib
import os
import resource
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent

# Two test workers share the cores (`make test`), each launching training processes of its own: one
# thread per process (tests, `accelerate launch`es, `kiln plan`'s measurement;
# models/training/cpu_threads.py) instead of every process claiming every core. Set before torch
# loads.
os.environ.setdefault("OMP_NUM_THREADS", "1")
PROMPTS = REPO / "tests" / "data" / "prompts.csv"  # 12 prompts of our own, DrawBench's columns


# Seconds each of the longest files takes in `make test` (docs/benchmarks.md, "Test suite";
# rounded, since only their order matters): handed out longest first, so that the two workers
# start the long files together and finish on the short ones, instead of one long file running
# alone at the end while the other worker idles.
LONG_FILES = {
    "test_stack.py": 700,
    "models/test_train.py": 550,
    "test_real_size.py": 500,
    "test_newcomer.py": 480,
    "test_e2e.py": 230,
    "tasks/launch/test_launch.py": 180,
    "test_learning.py": 150,
    "tasks/planning/test_memory_model.py": 150,
    "test_gpu_check.py": 120,
    "tasks/launch/test_slurm.py": 120,
    "test_scheduler.py": 110,
}


def _weight(item) -> int:
    """0 for end-to-end tests, 1 for integration tests, 2 for the rest (their markers)."""
    if item.get_closest_marker("e2e"):
        return 0
    return 1 if item.get_closest_marker("integration") else 2


def _seconds(path: Path) -> int:
    tests = REPO / "tests"
    if not path.is_relative_to(tests):
        return 0
    return LONG_FILES.get(path.relative_to(tests).as_posix(), 0)


def pytest_collection_modifyitems(config, items):
    """The longest files first (`LONG_FILES`), then end-to-end files, then integration files,
    then unit tests: a scheduling hint for the test workers (`--dist loadfile
    --no-loadscope-reorder` hands out whole files in this order), so that a long file never
    starts last and runs alone at the end. It reads only the markers the tests carry anyway and
    the table above; the sort is stable, so each file's tests stay together."""
    weight: dict = {}
    for item in items:
        weight[item.path] = min(weight.get(item.path, 2), _weight(item))
    items.sort(key=lambda item: (-_seconds(item.path), weight[item.path]))


# CPU-seconds of each test phase: this process's and its finished children's (a subprocess
# counts once it is waited for, with everything it waited for, so a server process that a
# shared fixture keeps up counts in the teardown that stops it; a server on one of this
# process's threads counts in whatever phase runs meanwhile). `make test` prints the largest
# (`--cpu-top`): the suite keeps both cores busy, so its time is its CPU work, and wall
# durations alone hide a test that waits idle or one that keeps several processes busy.
_PHASES = ("setup", "call", "teardown")
_CPU = pytest.StashKey[dict]()


def _cpu_s() -> float:
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


@contextlib.contextmanager
def _cpu_of(item, when: str):
    start = _cpu_s()
    try:
        yield
    finally:
        item.stash.setdefault(_CPU, {})[when] = _cpu_s() - start


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-top",
        type=int,
        default=0,
        metavar="N",
        help="list the N test phases that used the most CPU-seconds (with their children's)",
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _cpu_of(item, "setup"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _cpu_of(item, "call"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    with _cpu_of(item, "teardown"):
        return (yield)


def pytest_terminal_summary(terminalreporter, config):
    top = config.getoption("--cpu-top")
    if not top:
        return
    rows = [
        (dict(r.user_properties)["cpu_s"], r.when, r.nodeid)
        for reports in terminalreporter.stats.values()
        for r in reports
        if getattr(r, "when", None) in _PHASES and "cpu_s" in dict(r.user_properties)
    ]
    total = sum(cpu for cpu, _, _ in rows)
    terminalreporter.write_sep(
        "=", f"the {top} test phases with the most CPU-seconds (all phases: {total:.0f} CPU-s)"
    )
    for cpu, when, nodeid in sorted(rows, reverse=True)[:top]:
        terminalreporter.write_line(f"{cpu:8.1f}s {when:<8} {nodeid}")


# A module or session fixture that fails is re-raised, with its whole traceback, in every test
# that uses it. The first such test reports it in full; the others say where to look.
_FAILED_FIXTURES: dict[int, tuple[BaseException, str]] = {}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    cpu = item.stash.get(_CPU, {}).get(call.when)
    if cpu is not None:
        report.user_properties.append(("cpu_s", round(cpu, 1)))
    if call.when != "setup" or call.excinfo is None or not report.failed:
        return report
    exc = call.excinfo.value
    first = _FAILED_FIXTURES.setdefault(id(exc), (exc, item.nodeid))[1]
    if first != item.nodeid:
        report.longrepr = (
            f"a shared fixture failed before this test ran, in {first} (its traceback is "
            f"reported there): {call.excinfo.exconly().splitlines()[0][:300]}"
        )
    return report


@pytest.fixture(scope="session")
def drawbench_csv() -> Path:
    """A small prompts file inside tests/: no test needs a copy of DrawBench beside the repo."""
    return PROMPTS


@pytest.fixture(scope="session")
def _prefect_api():
    """One temporary Prefect API (SQLite) for every in-process flow run of the session."""
    from prefect.testing.utilities import prefect_test_harness

    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    # Unit tests call ingest (which submits Prefect tasks) outside a flow run.
    os.environ["PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW"] = "ignore"
    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(autouse=True)
def prefect_harness(request):
    """Start the session's Prefect API on first use by a test that is not a unit test.

    Unit tests (`make test-fast`: neither `integration` nor `e2e`) never pay its start-up.
    """
    if request.node.get_closest_marker("integration") or request.node.get_closest_marker("e2e"):
        request.getfixturevalue("_prefect_api")


@pytest.fixture(scope="session")
def demo_src(tmp_path_factory) -> Path:
    """60 demo files (5 planted bad) in the imagefolder layout; shared, so never modify it."""
    from kiln_demo.data import write_demo_dataset

    out = tmp_path_factory.mktemp("demo") / "src"
    write_demo_dataset(out, n=60, seed=0)
    return out


@pytest.fixture
def landing_src(tmp_path, demo_src):
    """(source, land): a copy of the demo data whose last 15 good images are held back until
    `land()` puts them (and their captions) into the source, as new data landing."""
    import json
    import shutil

    src, later = tmp_path / "landing-src", tmp_path / "landing-later"
    shutil.copytree(demo_src, src)
    later.mkdir()
    rows = [json.loads(x) for x in (src / "metadata.jsonl").read_text().splitlines()]
    late = {
        r["file_name"]
        for r in rows
        if r["file_name"][:5].isdigit() and int(r["file_name"][:5]) >= 40
    }
    for name in late:
        shutil.move(src / name, later / name)

    def write(rs):
        (src / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))

    write([r for r in rows if r["file_name"] not in late])

    def land() -> int:
        for name in late:
            shutil.move(later / name, src / name)
        write(rows)
        return len(late)

    return src, land


TEST_STAGES = [
    {
        "resolution": 32,
        "batch_size": 8,
        "learning_rate": 5.0e-4,
        "max_steps": 12,
        "warmup_steps": 2,
    },
    {"resolution": 48, "batch_size": 8, "learning_rate": 3.0e-4, "max_steps": 8},
    {
        "resolution": 64,
        "batch_size": 4,
        "learning_rate": 2.0e-4,
        "max_steps": 8,
        "gradient_accumulation_steps": 2,
    },
]


def _write_tiny_config(
    path: Path, root: Path, source: Path | str, prompts: Path, **overrides
) -> Path:
    """configs/tiny.yaml with root, source and prompts pointed at test folders."""
    cfg = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    cfg["storage"]["root"] = str(root)
    cfg["ingest"]["source"] = str(source)
    cfg["evaluate"]["prompts_csv"] = str(prompts)
    cfg["launch"]["accelerate_config"] = str(REPO / "configs" / "accelerate" / "single.yaml")
    # The VAE fit is per root (about 50 CPU-seconds at the preset's 800 steps, paid again by
    # every test that trains in a root of its own): 30 steps give a VAE that works, and no test
    # here judges image quality (the learning test runs the preset's own fit).
    cfg["train"]["model"]["vae"]["fit"]["steps"] = 30
    # The tests check mechanics, not what the model draws: a few steps per stage (the preset
    # trains long enough for its samples to follow their captions; tests/test_newcomer.py
    # runs it as `make demo` does).
    cfg["train"] |= {
        "stages": TEST_STAGES,
        "checkpoint_every": 10,
        "eval_every": 10,
        "log_every": 5,
    }
    cfg["evaluate"]["num_inference_steps"] = 4
    # The preset's content rules load Lingua (about 2 s and 600 MB a process) and NudeNet:
    # tests/tasks/quality/test_content_rules.py and the newcomer's `make demo` test run them.
    cfg["quality"] |= {"max_unsafe": None, "allowed_languages": None}
    for dotted, value in overrides.items():
        node = cfg
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@pytest.fixture(scope="session")
def make_config(drawbench_csv):
    """make_config(path, root, source, **{"dotted.key": value}) writes a tiny pipeline YAML."""

    def make(path: Path, root: Path, source: Path | str, **overrides) -> Path:
        return _write_tiny_config(path, root, source, drawbench_csv, **overrides)

    return make


@pytest.fixture
def tiny_config(tmp_path, demo_src, make_config) -> Path:
    return make_config(tmp_path / "tiny.yaml", tmp_path / "root", demo_src)


@pytest.fixture(scope="session")
def tiny_shards(tmp_path_factory, demo_src, make_config):
    """Validated demo catalog sharded for the tiny stages: (config path, root, dataset version)."""
    from kiln_config import load_config
    from tasks.ingest.run import ingest_source
    from tasks.quality.validate import validate_catalog
    from tasks.shards.write import write_shards

    base = tmp_path_factory.mktemp("shards")
    cfg_path = make_config(base / "tiny.yaml", base / "root", demo_src)
    cfg = load_config(cfg_path)
    root = cfg.storage.root
    ing = ingest_source(cfg.ingest, root)  # source: demo_src; workers: 2
    validate_catalog.fn(root, ing.ingest_id, cfg.quality)
    res = write_shards.fn(
        cfg.shards,
        root,
        ing.ingest_id,
        [s.resolution for s in cfg.train.stages],
        tokenizer=cfg.train.model.tokenizer.model_dump(),  # as the shard flow does by default
    )
    return cfg_path, Path(root), res.dataset_version


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server on 127.0.0.1: a real HTTP endpoint, not an in-process mock."""
    from moto.server import ThreadedMotoServer

    # Here, not at the top: tests/test_conftest_hooks.py runs this file outside the repository.
    from tests.servers import free_port

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint):
    """A fresh bucket on the moto server; returns (bucket name, boto3 client)."""
    import uuid

    import boto3

    client = boto3.client("s3", endpoint_url=s3_endpoint)
    name = f"kiln-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=name)
    return name, client


@pytest.fixture
def upload_dir():
    """upload_dir(client, bucket, prefix, folder): copy a local folder into the bucket."""

    def upload(client, bucket: str, prefix: str, folder: Path) -> None:
        for p in sorted(folder.rglob("*")):
            if p.is_file():
                client.upload_file(str(p), bucket, f"{prefix}/{p.relative_to(folder).as_posix()}")

    return upload


# -- source corpora --------------------------------------------------------------------------


def _jpeg(size=(64, 48), color=(200, 30, 30), **save) -> bytes:
    import io

    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, color)
    ImageDraw.Draw(img).ellipse((4, 4, size[0] // 2, size[1] // 2), fill=(20, 20, 220))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90, **save)
    return buf.getvalue()


def _png(img) -> bytes:
    import io

    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


SAMPLES = [  # (stem, caption, size, colour): the same six images in every layout
    ("a", "a red field with a blue disc", (64, 48), (200, 30, 30)),
    ("b", "a green field with a blue disc", (48, 64), (30, 200, 30)),
    ("c", "a yellow field with a blue disc", (72, 72), (230, 200, 20)),
    ("d", "a grey field with a blue disc", (80, 40), (128, 128, 128)),
    ("e", "a purple field with a blue disc", (40, 40), (140, 60, 170)),
    ("f", "an orange field with a blue disc", (96, 64), (240, 130, 30)),
]


def write_layout(kind: str, dest: Path) -> dict[str, str]:
    """SAMPLES in one of the three layouts; returns {catalog key: caption}."""
    import io
    import json
    import tarfile

    dest.mkdir(parents=True, exist_ok=True)
    keys = {}
    if kind == "imagefolder":
        with open(dest / "metadata.jsonl", "w") as f:
            for stem, cap, size, color in SAMPLES:
                (dest / f"{stem}.jpg").write_bytes(_jpeg(size, color))
                f.write(json.dumps({"file_name": f"{stem}.jpg", "text": cap, "license": "cc0"}))
                f.write("\n")
                keys[f"{stem}.jpg"] = cap
    elif kind == "img2dataset":
        for i, (stem, cap, size, color) in enumerate(SAMPLES):
            part = dest / f"{i // 3:05d}"
            part.mkdir(exist_ok=True)
            (part / f"{stem}.jpg").write_bytes(_jpeg(size, color))
            (part / f"{stem}.txt").write_text(cap)
            (part / f"{stem}.json").write_text(json.dumps({"license": "cc0", "url": "x"}))
            keys[f"{i // 3:05d}/{stem}.jpg"] = cap
    else:
        for t in range(2):
            with tarfile.open(dest / f"{t:05d}.tar", "w") as tf:
                for stem, cap, size, color in SAMPLES[t * 3 : t * 3 + 3]:
                    for ext, data in (
                        ("jpg", _jpeg(size, color)),
                        ("txt", cap.encode()),
                        ("json", json.dumps({"license": "cc0"}).encode()),
                    ):
                        info = tarfile.TarInfo(f"{stem}.{ext}")
                        info.size = len(data)
                        tf.addfile(info, io.BytesIO(data))
                    keys[f"{t:05d}.tar/{stem}"] = cap
    return keys


def write_hostile(dest: Path) -> dict[str, str]:
    """An imagefolder of hostile and awkward files; returns {key: expected outcome}.

    The outcome is a quarantine reason code, or "ok:<conversion>" for accepted images.
    """
    import json
    import struct
    import zlib

    from PIL import Image

    dest.mkdir(parents=True, exist_ok=True)
    (dest.parent / "outside.jpg").write_bytes(_jpeg())  # must never be read
    good = _jpeg((64, 64))
    files = {
        "ok.jpg": (good, "a plain photo", "ok:"),
        "truncated.jpg": (_jpeg((256, 256))[:700], "cut short", "decode_error"),
        "empty.jpg": (b"", "nothing", "empty_file"),
        "text.jpg": (b"hello, not an image\n" * 5, "text", "not_an_image"),
        "tiny.jpg": (_jpeg((16, 16)), "a tiny photo", "too_small"),
        "wide.jpg": (_jpeg((400, 40)), "a very wide photo", "extreme_aspect"),
        "blank.jpg": (_jpeg((60, 60), (1, 2, 3)), "   ", "caption_blank"),
        "nocap.jpg": (_jpeg((60, 61)), None, "caption_missing"),
        "long.jpg": (_jpeg((60, 62)), "word " * 400, "caption_too_long"),
        "cmyk.jpg": (None, "a cmyk photo", "ok:CMYK->RGB"),
        "palette.png": (None, "a palette image with transparency", "ok:P->RGB(alpha on white)"),
        "la.png": (None, "grey with alpha", "ok:LA->RGB(alpha on white)"),
        "rgba.png": (None, "colour with alpha", "ok:RGBA->RGB(alpha on white)"),
        "deep.png": (None, "a 16-bit greyscale scan", "ok:I;16->RGB(16-bit scaled)"),
        "rotated.jpg": (None, "a photo taken sideways", "ok:exif:6"),
        "bomb.png": (None, "a decompression bomb", "too_many_pixels"),
        "notes.txt": (b"just notes", None, "unsupported_extension"),
    }
    cmyk = Image.new("CMYK", (50, 40), (0, 255, 255, 0))
    import io

    buf = io.BytesIO()
    cmyk.save(buf, format="JPEG")
    files["cmyk.jpg"] = (buf.getvalue(), *files["cmyk.jpg"][1:])
    pal = Image.new("P", (40, 40), 0)
    pal.putpalette([255, 0, 0, 0, 255, 0] + [0] * 762)
    pal.info["transparency"] = 0
    files["palette.png"] = (_png(pal), *files["palette.png"][1:])
    files["la.png"] = (_png(Image.new("LA", (40, 40), (90, 128))), *files["la.png"][1:])
    files["rgba.png"] = (_png(Image.new("RGBA", (40, 40), (9, 9, 9, 0))), *files["rgba.png"][1:])
    files["deep.png"] = (_png(Image.new("I;16", (40, 40), 40000)), *files["deep.png"][1:])
    rot = Image.new("RGB", (80, 40), (10, 200, 10))
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    rot.save(buf, format="JPEG", exif=exif.tobytes())
    files["rotated.jpg"] = (buf.getvalue(), *files["rotated.jpg"][1:])
    # A PNG header claiming 40000 x 40000 pixels: rejected from the header, never decoded.
    ihdr = struct.pack(">IIBBBBB", 40000, 40000, 8, 0, 0, 0, 0)
    chunk = lambda t, d: (  # noqa: E731
        struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)
    )
    bomb = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
    files["bomb.png"] = (bomb, *files["bomb.png"][1:])

    expected = {}
    lines = []
    for name, (data, caption, outcome) in files.items():
        (dest / name).write_bytes(data)
        expected[name] = outcome
        if caption is not None and not name.endswith(".txt"):
            lines.append(json.dumps({"file_name": name, "text": caption}).encode())
    lines += [
        b"{this is not json",
        json.dumps({"file_name": "gone.jpg", "text": "no such file"}).encode(),
        json.dumps({"file_name": "../outside.jpg", "text": "escape"}).encode(),
        b'{"file_name": "ok.jpg", "text": "\xff\xfe not utf-8"}',
    ]
    (dest / "metadata.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    n = len(lines)
    expected.update(
        {
            f"metadata.jsonl:{n - 3}": "manifest_bad_json",
            "gone.jpg": "manifest_missing_file",
            "../outside.jpg": "manifest_unsafe_key",
            f"metadata.jsonl:{n}": "manifest_not_utf8",
        }
    )
    return expected


@pytest.fixture
def layouts():
    """layouts(kind, dest): write SAMPLES in a layout; returns {key: caption}."""
    return write_layout


@pytest.fixture
def hostile_src(tmp_path) -> tuple[Path, dict[str, str]]:
    src = tmp_path / "hostile" / "src"
    return src, write_hostile(src)


@pytest.fixture(autouse=True)
def _free_streaming_shared_memory():
    """After a test, close the shared memory its StreamingDatasets left open.

    Streaming keeps every dataset's /dev/shm blocks (about a hundred open files for a
    dataset that was read) alive until the process exits, even after the dataset is garbage.
    The product's long-lived processes release theirs (`MDSReader.release`,
    `release_shared_memory`); a test session builds hundreds of datasets in one process and
    ran out of file descriptors (20,000). No dataset outlives its test here (none is module-
    or session-scoped), so what is left after a test is safe to close.
    """
    yield
    if len(os.listdir("/proc/self/fd")) < 2000:  # a cheap check; sweep only when it matters
        return
    import gc
    from multiprocessing import shared_memory

    from streaming.base.shared import SharedMemory

    for obj in gc.get_objects():
        try:
            if isinstance(obj, SharedMemory):
                obj.cleanup()
            elif isinstance(obj, shared_memory.SharedMemory):
                obj.close()
        except ReferenceError:  # a weakref.proxy whose object is gone: nothing to close
            continue


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A real two-node SLURM cluster on loopback (tests/slurm_cluster.py), for the session.

    `make test` installs Debian's SLURM and munge packages; without them (or without root)
    the tests that need the cluster fail with the reason, never skip."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "slurm_cluster", REPO / "tests" / "slurm_cluster.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    why = mod.slurm_available()
    if why:
        pytest.fail(f"no SLURM cluster can start here: {why}")
    with mod.SlurmCluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


def _postgres_bin() -> Path:
    """Debian's PostgreSQL programs (the newest installed version)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]))
    if not found:
        pytest.fail("PostgreSQL is not installed: `make test` installs Debian's postgresql")
    return found[-1].parent


@pytest.fixture(scope="session")
def postgres():
    """A private PostgreSQL server for the session: Debian's, started with `initdb` and
    `pg_ctl` in a folder of its own (as the `postgres` user when the tests run as root, which
    PostgreSQL refuses to run as), listening on a Unix socket in that folder only (no TCP: its
    trust authentication reaches no other user). Yields `create(name) -> SQLAlchemy URL`,
    which makes a database of its own for a test."""
    import shutil
    import subprocess
    import tempfile

    import psycopg

    bin_dir = _postgres_bin()
    # Not under pytest's tmp_path: its folders are the test user's alone, and the server runs
    # as `postgres`.
    base = Path(tempfile.mkdtemp(prefix="kiln-postgres-"))
    as_postgres = []
    if os.geteuid() == 0:
        shutil.chown(base, "postgres", "postgres")
        as_postgres = ["runuser", "-u", "postgres", "--"]
    data = base / "data"
    subprocess.run(
        [*as_postgres, str(bin_dir / "initdb"), "-D", str(data), "-U", "kiln", "--auth=trust"],
        check=True,
        capture_output=True,
    )
    options = f"-k {base} -c listen_addresses='' -c fsync=off"
    start = [str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(base / "server.log"), "-w"]
    subprocess.run([*as_postgres, *start, "-o", options, "start"], check=True, capture_output=True)

    def create(name: str) -> str:
        with psycopg.connect(host=str(base), user="kiln", dbname="postgres", autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql+psycopg://kiln@/{name}?host={base}"

    try:
        yield create
    finally:
        stop = [str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"]
        subprocess.run([*as_postgres, *stop], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)
