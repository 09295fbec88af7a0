"""Ingest throughput against the decode-only limit, from local disk and from moto's S3 server.

Generates N photo-like 1024-px JPEGs once (cached in --work), then measures in one run, with
the same number of worker processes for every path:

* decode-only: PIL open + full load of every file, in a spawn process pool (the limit);
* Kiln's ingest (`tasks.ingest.run.ingest_source`: listing, partition tasks, read, sha256, integrity
  decode, EXIF, pHash, catalog parquet) over the local folder;
* plain GETs of the same objects from moto's S3 server on 127.0.0.1 (the store's own limit:
  moto is a single Python process, far slower than a real object store);
* the same ingest over that S3 server (real HTTP).

Rates are images per second per worker process ("per core"). `ingest_vs_decode_only` is the
local ingest rate over the decode-only rate.

    python benchmarks/ingest.py --out benchmarks/results/ingest.json
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import platform
import shutil
import socket
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path


def _photo(i: int, size: int) -> bytes:
    """A photo-like JPEG: smooth gradients, shapes and sensor-like noise (realistic sizes)."""
    import io

    import numpy as np
    from PIL import Image, ImageDraw, ImageFilter

    rng = np.random.default_rng(i)
    y, x = np.mgrid[0:size, 0:size] / size
    base = np.stack(
        [np.sin(x * rng.uniform(1, 6) + c) * np.cos(y * rng.uniform(1, 6) - c) for c in (0, 2, 4)],
        axis=-1,
    )
    img = Image.fromarray(((base * 0.5 + 0.5) * 255).astype("uint8"))
    draw = ImageDraw.Draw(img)
    for _ in range(12):
        x0, y0 = rng.integers(0, size, 2)
        r = int(rng.integers(20, size // 4))
        draw.ellipse((x0, y0, x0 + r, y0 + r), fill=tuple(int(v) for v in rng.integers(0, 255, 3)))
    img = img.filter(ImageFilter.GaussianBlur(1.5))
    noisy = np.asarray(img).astype(np.int16) + rng.normal(0, 6, (size, size, 3)).astype(np.int16)
    buf = io.BytesIO()
    Image.fromarray(noisy.clip(0, 255).astype("uint8")).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _write_one(job: tuple[str, int, int]) -> int:
    path, i, size = job
    data = _photo(i, size)
    Path(path).write_bytes(data)
    return len(data)


def _decode_only(path: str) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as img:
        img.load()
        return img.size


_CLIENT = None


def _s3_get(job: tuple[str, str, str]) -> int:
    """Read one object from S3 and nothing else (the store's own limit)."""
    global _CLIENT
    endpoint, bucket, key = job
    if _CLIENT is None:
        import boto3

        _CLIENT = boto3.client("s3", endpoint_url=endpoint)
    return len(_CLIENT.get_object(Bucket=bucket, Key=key)["Body"].read())


def _make_corpus(src: Path, n: int, size: int, workers: int) -> None:
    marker = src / f".complete-{n}-{size}"
    if marker.is_file():
        return
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    jobs = [(str(src / f"{i // 1000:05d}" / f"{i:09d}.jpg"), i, size) for i in range(n)]
    for d in {Path(j[0]).parent for j in jobs}:
        d.mkdir(exist_ok=True)
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        list(pool.map(_write_one, jobs, chunksize=16))
    with open(src / "metadata.jsonl", "w") as f:
        for path, i, _ in jobs:
            rel = Path(path).relative_to(src).as_posix()
            f.write(json.dumps({"file_name": rel, "text": f"a generated photo number {i}"}) + "\n")
    marker.write_text("ok")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON output path")
    p.add_argument("--n", type=int, default=2000, help="Images")
    p.add_argument("--size", type=int, default=1024, help="Image side in pixels")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="Processes")
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "kiln-bench-ingest"))
    p.add_argument("--skip-s3", action="store_true", help="Only the local measurements")
    args = p.parse_args()

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    from prefect.testing.utilities import prefect_test_harness

    from kiln_config import IngestConfig
    from tasks.ingest.run import ingest_source

    work = Path(args.work)
    src = work / "src"
    t = time.perf_counter()
    _make_corpus(src, args.n, args.size, args.workers)
    gen_s = time.perf_counter() - t
    files = sorted(str(p) for p in src.rglob("*.jpg"))
    total_bytes = sum(Path(f).stat().st_size for f in files)
    w = args.workers

    def rate(seconds: float) -> dict:
        return {
            "seconds": round(seconds, 3),
            "img_per_s": round(len(files) / seconds, 1),
            "img_per_s_per_core": round(len(files) / seconds / w, 1),
        }

    results: dict = {}
    with prefect_test_harness(server_startup_timeout=120):
        warm = work / "warm"
        shutil.rmtree(warm, ignore_errors=True)
        (warm / "src").mkdir(parents=True)
        shutil.copy(files[0], warm / "src" / "a.jpg")
        # API and imports warm
        ingest_source(IngestConfig(source=str(warm / "src"), workers=1), str(warm / "root"))

        t = time.perf_counter()
        with ProcessPoolExecutor(w, mp_context=mp.get_context("spawn")) as pool:
            list(pool.map(_decode_only, files, chunksize=max(1, len(files) // (w * 16))))
        results["decode_only"] = rate(time.perf_counter() - t)

        root = work / "root-local"
        shutil.rmtree(root, ignore_errors=True)
        t = time.perf_counter()
        res = ingest_source(IngestConfig(source=str(src), workers=w), str(root))
        results["ingest_local"] = rate(time.perf_counter() - t)
        assert res.accepted == len(files), res

        if not args.skip_s3:
            import boto3
            from moto.server import ThreadedMotoServer

            for k, v in (
                ("AWS_ACCESS_KEY_ID", "x"),
                ("AWS_SECRET_ACCESS_KEY", "x"),
                ("AWS_DEFAULT_REGION", "us-east-1"),
            ):
                os.environ.setdefault(k, v)
            logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a log line per request
            port = _free_port()
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
            server.start()
            try:
                endpoint = f"http://127.0.0.1:{port}"
                client = boto3.client("s3", endpoint_url=endpoint)
                client.create_bucket(Bucket="bench")
                for f in [*files, str(src / "metadata.jsonl")]:
                    client.upload_file(f, "bench", f"raw/{Path(f).relative_to(src).as_posix()}")
                keys = [f"raw/{Path(f).relative_to(src).as_posix()}" for f in files]
                t = time.perf_counter()
                with ProcessPoolExecutor(w, mp_context=mp.get_context("spawn")) as pool:
                    jobs = [(endpoint, "bench", k) for k in keys]
                    list(pool.map(_s3_get, jobs, chunksize=max(1, len(jobs) // (w * 16))))
                results["s3_read_only"] = rate(time.perf_counter() - t)
                root = work / "root-s3"
                shutil.rmtree(root, ignore_errors=True)
                t = time.perf_counter()
                res = ingest_source(
                    IngestConfig(source="s3://bench/raw", workers=w),
                    str(root),
                    endpoint_url=endpoint,
                )
                results["ingest_s3"] = rate(time.perf_counter() - t)
                assert res.accepted == len(files), res
            finally:
                server.stop()

    decode = results["decode_only"]["img_per_s"]
    out = {
        "benchmark": "ingest",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "images": len(files),
        "image_px": args.size,
        "mean_file_kb": round(total_bytes / len(files) / 1024, 1),
        "workers": w,
        "corpus_generation_s": round(gen_s, 1),
        **results,
        "ingest_vs_decode_only": round(results["ingest_local"]["img_per_s"] / decode, 3),
    }
    if "ingest_s3" in results:
        s3 = results["ingest_s3"]["img_per_s"]
        out["ingest_s3_vs_decode_only"] = round(s3 / decode, 3)
        out["ingest_s3_vs_s3_read_only"] = round(s3 / results["s3_read_only"]["img_per_s"], 3)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))  # noqa: T201 - a benchmark script reports on stdout


if __name__ == "__main__":
    main()
