"""Data-path throughput: Kiln's streaming loader against the decode-only limit, an
ImageFolder-style baseline, and the precomputed-latents path; plus the shard step against a
naive single-process conversion. All measured in one run on the same 256-px images.

1. `loader`: MDS through `models.data.loader.build_loader` (read, JPEG decode into the batch, the
   token ids the shard step stored, collate), `--workers` DataLoader workers, at the batch
   per process that `configs/sd2-base.yaml` trains the stage with; samples/s per worker
   ("per core"). Steady state over 3 epochs of `--passes` passes over the images (streaming's
   `epoch_size`), each from its first batch to its last; what each epoch pays once is
   reported apart: worker start-up (`startup_s`) and shutdown (`teardown_s`). A real epoch
   is hours long. `loader_tokenizing` is the same loader tokenizing the
   captions itself (`token_ids=False`, as for shards written without ids); `loader_hflip`
   also flags half the images for mirroring (`hflip=0.5`). The mirror itself is done by the
   trainer on the device (`device_pixels`); `device_pixels_us_per_image` times it, and the
   transpose out of the decoder's layout, with this CPU as the device, for reference.
   `loader_in_process` is the loader with no workers (one core, nothing handed over), and
   `budget_us_per_sample` times each of its steps in this process on the same shards.
   `loader_512` / `decode_only_512` repeat the loader and its limit at 512 px.
2. `decode_only`: the limit. The loader's decoder (libjpeg-turbo through simplejpeg) on the
   same JPEG bytes, which each of `--workers` warm processes already holds in memory,
   decoding into one reused buffer of the loader's batch size, one batch per task, as
   often as the loader's epoch holds each image: nothing is read, sent, tokenized or
   collated.
   `decode_only_torchvision` and `decode_only_pil` decode the bytes into fresh images in a
   process pool (bytes sent with each call), for reference. The loader and the limit are
   measured in 5 alternating rounds and reported as the median round.
3. `imagefolder_local` / `imagefolder_s3`: the original files read one by one (local disk or
   one GET each from moto's S3 server), decoded, resized to 256 and centre-cropped: what a
   torchvision ImageFolder pipeline does. The loader from S3 streams the MDS shards from the
   same server into a local cache.
4. `latents`: precomputed SD2-shaped latents (4x32x32 mean and std, fp16) with token ids,
   through the same loader; `latents_text` carries the text encoder's states (77x1024 fp16)
   instead of ids.
5. `shard_step` vs `shard_naive`: Kiln's partitioned shard task against one process that
   fully decodes, resizes and re-encodes each image. What the shard step imports once per
   process where it first writes (streaming, and torch, transformers and diffusers for the
   tokenizer: seconds, whatever the image count) is timed apart (`import_s`).

    python benchmarks/loader.py --out benchmarks/results/loader.json
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import multiprocessing as mp
import os
import platform
import shutil
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

RES = 256


def _decode(data: bytes) -> tuple[int, int]:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        img.load()
        return img.size


def _naive_render(path: str) -> bytes:
    """The naive shard conversion: full decode, Lanczos resize, centre crop, JPEG encode."""
    from PIL import Image

    from tasks.ingest.render import resize_center_crop

    with Image.open(path) as img:
        crop, _ = resize_center_crop(img.convert("RGB"), RES)
    buf = io.BytesIO()
    crop.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _imagefolder_item(path: str):
    """One ImageFolder-style sample: read, decode, resize, centre-crop, to tensor."""
    from PIL import Image

    from tasks.ingest.render import resize_center_crop

    with Image.open(path) as img:
        crop, _ = resize_center_crop(img.convert("RGB"), RES)
    return np.asarray(crop, dtype=np.float32).mean()


_S3 = None


def _imagefolder_s3_item(job: tuple[str, str, str]):
    global _S3
    from PIL import Image

    from tasks.ingest.render import resize_center_crop

    endpoint, bucket, key = job
    if _S3 is None:
        import boto3

        _S3 = boto3.client("s3", endpoint_url=endpoint)
    data = _S3.get_object(Bucket=bucket, Key=key)["Body"].read()
    with Image.open(io.BytesIO(data)) as img:
        crop, _ = resize_center_crop(img.convert("RGB"), RES)
    return np.asarray(crop, dtype=np.float32).mean()


def _shard_step(
    src: str, root: str, workers: int, tokenizer: dict
) -> tuple[str, float, str, float]:
    """Ingest, validate and shard `src` (in a Prefect test harness); time the shard step, and
    its one-off imports apart. Also shards a 512 px version (not timed) for the loader at the
    next stage's size."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    from prefect.testing.utilities import prefect_test_harness

    from kiln_config import IngestConfig, QualityConfig, ShardsConfig
    from tasks.ingest.run import ingest_source
    from tasks.quality.validate import validate_catalog
    from tasks.shards.write import write_shards

    shutil.rmtree(root, ignore_errors=True)
    with prefect_test_harness(server_startup_timeout=120):
        ing = ingest_source(IngestConfig(source=src, workers=workers), root)
        rules = QualityConfig(min_side=32, max_reject_fraction=1.0)
        validate_catalog.fn(root, ing.ingest_id, rules)
        # What the shard step imports where it first writes and tokenizes, once per process.
        t = time.perf_counter()
        import streaming  # noqa: F401

        import models.components.factory  # noqa: F401

        import_s = time.perf_counter() - t
        t = time.perf_counter()
        shard = write_shards.fn(
            ShardsConfig(workers=workers, partition_size=250),
            root,
            ing.ingest_id,
            [RES],
            tokenizer=tokenizer,
        )  # ids stored: the shard flow's default
        seconds = time.perf_counter() - t
        big = write_shards.fn(
            ShardsConfig(workers=workers, partition_size=250),
            root,
            ing.ingest_id,
            [2 * RES],
            tokenizer=tokenizer,
        )
        return shard.dataset_version, seconds, big.dataset_version, import_s


def _decode_tv(data: bytes) -> tuple[int, ...]:
    """torchvision's JPEG decoder (libjpeg-turbo) into a fresh tensor, bytes in memory."""
    import torch

    from models.data.images import _decode_jpeg

    return tuple(_decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8)).shape)


def _time_pool(fn, items: list, workers: int, chunksize: int) -> float:
    """Seconds for `fn` over `items` in a warm spawn pool (start-up not counted)."""
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        list(pool.map(fn, items[: workers * chunksize], chunksize=chunksize))  # warm
        t = time.perf_counter()
        list(pool.map(fn, items, chunksize=chunksize))
        return time.perf_counter() - t


_BLOBS: list = []


def _hold(blobs: list) -> None:
    _BLOBS[:] = blobs


def _decode_span(span: tuple[int, int, int]) -> int:
    """Decode blobs [start, stop) of this worker's copy into rows of one batch buffer that the
    worker keeps (as a loader worker reuses its ring slots): the loader's decoder
    (simplejpeg) at its best, nothing else."""
    import numpy as np
    import simplejpeg

    start, stop, batch = span
    h, w, _, _ = simplejpeg.decode_jpeg_header(_BLOBS[0])
    buf = _BUF.get((batch, h, w))
    if buf is None:
        buf = _BUF[(batch, h, w)] = np.zeros((batch, h, w, 3), np.uint8)  # touched once
    for i in range(start, stop):
        simplejpeg.decode_jpeg(_BLOBS[i], colorspace="RGB", buffer=buf[i % batch])
    return stop - start


_BUF: dict = {}


def _time_decode_limit(blobs: list, workers: int, rounds: int, batch: int = 32) -> float:
    """Seconds to decode every blob `rounds` times on `workers` processes that already hold
    the bytes (nothing is sent but index ranges): the decode-only limit."""
    # One batch per task, as a loader worker makes them: the last task leaves one worker
    # idle for one batch's decode at most.
    spans = [(i, min(i + batch, len(blobs)), batch) for i in range(0, len(blobs), batch)]
    with ProcessPoolExecutor(
        workers, mp_context=mp.get_context("spawn"), initializer=_hold, initargs=(blobs,)
    ) as pool:
        list(pool.map(_decode_span, spans[:workers]))  # warm: workers started, code loaded
        t = time.perf_counter()
        assert sum(pool.map(_decode_span, spans * rounds)) == rounds * len(blobs)
        return time.perf_counter() - t


def _time_loader(loader, epochs: int = 3) -> dict:
    """Steady-state rate over `epochs` epochs, each from its first batch to its last.

    Paid once per epoch and reported apart: worker start-up up to the first batch (fork,
    partitioning the epoch), `startup_s`, and after the last batch the workers' shutdown,
    `teardown_s`. An epoch is hours long in a real run and a few seconds here.
    """
    n, steady, startups, teardowns = 0, 0.0, [], []
    for _ in range(epochs):
        t = time.perf_counter()
        it = iter(loader)
        next(it)
        first = last = time.perf_counter()
        startups.append(first - t)
        for batch in it:
            n += len(batch["key"])
            last = time.perf_counter()
        teardowns.append(time.perf_counter() - last)
        steady += last - first
    mid = len(startups) // 2
    return {
        "seconds": steady,
        "n": n,
        "startup_s": round(sorted(startups)[mid], 3),
        "teardown_s": round(sorted(teardowns)[mid], 3),
    }


def _device_pixels_cost(loader, batches: int = 8) -> dict:
    """Microseconds per image of `device_pixels` on this CPU (one thread), on the loader's
    own batches: the transpose to (B, 3, H, W), and with the batch's flips applied too."""
    import torch

    from models.data.collation import device_pixels

    torch.set_num_threads(1)
    held = []
    for batch in loader:
        held.append(batch)
        if len(held) == batches:
            break
    out = {}
    for name, keep in (("transpose", ("pixel_values",)), ("transpose_and_flip", None)):
        views = [{k: v for k, v in b.items() if keep is None or k in keep} for b in held]
        device_pixels(views[0], "cpu")  # warm
        t = time.perf_counter()
        n = sum(len(device_pixels(v, "cpu")) for v in views)
        out[name] = round((time.perf_counter() - t) / n * 1e6, 1)
    out["flipped_share"] = round(sum(int(b["flip"].sum()) for b in held) / n, 3)
    return out


def _budget(mds: Path, tok, n: int = 1024, batch: int = 32) -> dict:
    """Microseconds per sample of each step of the image loader, in this process, on the
    same shards: read (mapped shard), decode into the batch, the stored token ids into the
    batch, or instead tokenizing the captions."""
    import torch

    from models.data.collation import KilnCollate, _ids_into
    from models.data.images import decode_into
    from models.data.loader import TRAINING_COLUMNS, ImageCaptionDataset

    torch.set_num_threads(1)
    ds = ImageCaptionDataset(local=str(mds), batch_size=1, shuffle=False)
    collate = KilnCollate(tok, RES)
    n = min(n, ds.num_samples) // batch * batch
    dest = torch.empty((batch, RES, RES, 3), dtype=torch.uint8)
    ids = torch.empty((batch, collate.max_length), dtype=torch.int64)
    for _ in range(2):  # the first round warms caches; the second is reported
        out = dict.fromkeys(("read", "decode", "stored_ids", "tokenize"), 0.0)
        for i in range(0, n, batch):
            t0 = time.perf_counter()
            samples = [ds.read_sample(j, TRAINING_COLUMNS) for j in range(i, i + batch)]
            t1 = time.perf_counter()
            decode_into([s["image"] for s in samples], dest)
            t2 = time.perf_counter()
            _ids_into([s["input_ids"] for s in samples], [False] * batch, None, ids)
            t3 = time.perf_counter()
            collate.ids([s["caption"] for s in samples])
            t4 = time.perf_counter()
            for k, a, b in (
                ("read", t0, t1),
                ("decode", t1, t2),
                ("stored_ids", t2, t3),
                ("tokenize", t3, t4),
            ):
                out[k] += b - a
    us = {k: round(v / n * 1e6, 1) for k, v in out.items()}
    # The best loader_vs_decode_only that a loader doing these steps per sample can reach,
    # with token ids stored in the shards and with the loader tokenizing.
    us["decode_share"] = round(us["decode"] / (us["read"] + us["decode"] + us["stored_ids"]), 3)
    us["decode_share_tokenizing"] = round(
        us["decode"] / (us["read"] + us["decode"] + us["tokenize"]), 3
    )
    return us


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=2000, help="Source images (1024 px, generated)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "kiln-bench-loader"))
    p.add_argument("--passes", type=int, default=10, help="Passes over the images per epoch")
    args = p.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    import sys

    from streaming import MDSWriter

    from kiln_config import PROJECT_DIR, load_config
    from models.components.factory import build_tokenizer
    from models.data.loader import build_loader

    # The ingest benchmark's corpus generator, imported by name so that spawned workers can
    # import it too (they inherit sys.path).
    sys.path.insert(0, str(Path(__file__).parent))
    import ingest as bench_ingest

    w = args.workers
    work = Path(args.work)
    src = work / "src"
    bench_ingest._make_corpus(src, args.n, 1024, w)
    files = sorted(str(f) for f in src.rglob("*.jpg"))
    cfg = load_config(PROJECT_DIR / "configs" / "tiny.yaml")
    tok = build_tokenizer(cfg.train.model.tokenizer)
    # The loader's settings: no caption dropout or mirroring unless a measurement says so.
    train = cfg.train.model_copy(
        update={"shuffle_seed": 0, "num_workers": w, "caption_dropout": 0.0, "hflip": 0.0}
    )
    # The batch per process that the production preset trains each stage with.
    prod = load_config(PROJECT_DIR / "configs" / "sd2-base.yaml")
    batch = {s.resolution: s.batch_size for s in prod.train.stages}

    def per(n, s):
        return {
            "seconds": round(s, 3),
            "samples_per_s": round(n / s, 1),
            "samples_per_s_per_core": round(n / s / w, 1),
        }

    res: dict = {}
    # Ingest, validate and shard run in a spawned child: Prefect's background threads must not
    # live in this process, whose DataLoader workers are forked.
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as one:
        version, shard_s, version_512, import_s = one.submit(
            _shard_step, str(src), str(work / "root"), w, cfg.train.model.tokenizer.model_dump()
        ).result()
    res["shard_step"] = {**per(len(files), shard_s), "import_s": round(import_s, 3)}
    # Naive baseline: one process, full decode (no draft), resize, encode.
    sample = files[: max(50, len(files) // 10)]
    t = time.perf_counter()
    for f in sample:
        _naive_render(f)
    naive_s = (time.perf_counter() - t) * len(files) / len(sample)
    res["shard_naive_single_process"] = {
        "seconds": round(naive_s, 3),
        "samples_per_s": round(len(files) / naive_s, 1),
        "samples_per_s_per_core": round(len(files) / naive_s, 1),  # one process
    }
    mds = work / "root" / "shards" / version / str(RES)

    from streaming import StreamingDataset

    # The loader and its limit, measured in alternating rounds so that a slow spell of the
    # machine does not fall on one of them only; each is reported as the median round.
    ds = StreamingDataset(local=str(mds), batch_size=1, shuffle=False)
    blobs = [ds.get_item(i)["image"] for i in range(ds.num_samples)]
    b, epoch = batch[RES], args.passes * ds.num_samples
    loader = build_loader(train, str(mds), tok, RES, b, epoch_size=epoch)
    tokenizing = build_loader(train, str(mds), tok, RES, b, epoch_size=epoch, token_ids=False)
    flipping = build_loader(
        train.model_copy(update={"hflip": 0.5}), str(mds), tok, RES, b, epoch_size=epoch
    )
    assert "input_ids" in loader.dataset.columns and "input_ids" not in tokenizing.dataset.columns
    loaders = {"loader": loader, "loader_tokenizing": tokenizing, "loader_hflip": flipping}
    rounds: dict[str, list] = {name: [] for name in loaders} | {"decode_only": []}
    for ld in loaders.values():
        _time_loader(ld, 1)  # warm the page cache and the workers' imports
    for _ in range(5):
        for name, ld in loaders.items():
            t = _time_loader(ld)
            rounds[name].append(
                {
                    **per(t["n"], t["seconds"]),
                    "startup_s": t["startup_s"],
                    "teardown_s": t["teardown_s"],
                }
            )
        lim = _time_decode_limit(blobs, w, args.passes, b)
        rounds["decode_only"].append(per(args.passes * len(blobs), lim))
    for name, runs in rounds.items():
        runs.sort(key=lambda r: r["samples_per_s"])
        res[name] = {
            **runs[len(runs) // 2],
            "rounds_samples_per_s_per_core": [r["samples_per_s_per_core"] for r in runs],
        }
    one = build_loader(train.model_copy(update={"num_workers": 0}), str(mds), tok, RES, b)
    t = _time_loader(one)
    res["loader_in_process"] = {  # num_workers=0: one core, nothing handed over
        "seconds": round(t["seconds"], 3),
        "samples_per_s": round(t["n"] / t["seconds"], 1),
        "samples_per_s_per_core": round(t["n"] / t["seconds"], 1),
    }
    res["budget_us_per_sample"] = _budget(mds, tok, batch=b)
    res["device_pixels_us_per_image"] = _device_pixels_cost(flipping)
    # Other decoders of the same bytes, for reference: each into a fresh image, the bytes
    # sent to the pool worker with each call.
    res["decode_only_torchvision"] = per(3 * len(blobs), _time_pool(_decode_tv, blobs * 3, w, 64))
    res["decode_only_pil"] = per(3 * len(blobs), _time_pool(_decode, blobs * 3, w, 64))

    # The next stage's size: decoding costs 4x more per image, the rest of a sample's work
    # (read, hand-over) about the same.
    mds_512 = work / "root" / "shards" / version_512 / str(2 * RES)
    ds = StreamingDataset(local=str(mds_512), batch_size=1, shuffle=False)
    blobs_512 = [ds.get_item(i)["image"] for i in range(ds.num_samples)]
    b512, passes_512 = batch[2 * RES], max(1, args.passes // 2)
    loader = build_loader(
        train, str(mds_512), tok, 2 * RES, b512, epoch_size=passes_512 * ds.num_samples
    )
    _time_loader(loader, 1)
    t = _time_loader(loader)
    res["loader_512"] = {
        **per(t["n"], t["seconds"]),
        "startup_s": t["startup_s"],
        "teardown_s": t["teardown_s"],
    }
    lim = _time_decode_limit(blobs_512, w, passes_512, b512)
    res["decode_only_512"] = per(passes_512 * len(blobs_512), lim)
    res["imagefolder_local"] = per(len(files), _time_pool(_imagefolder_item, files, w, 16))

    # Precomputed latents in the two layouts models/precompute.py writes: SD2-shaped latents
    # (4x32x32 mean and std, fp16) with token ids (`shards.precompute_text: false`), and with
    # the text encoder's states (77x1024 fp16, 158 KiB a sample).
    from models.data.tokenization import CaptionTokenizer

    tokenize = CaptionTokenizer(tok)
    rng = np.random.default_rng(0)
    for name, text, count in (
        ("latents", False, 10 * len(files)),
        ("latents_text", True, 4 * len(files)),
    ):
        lat = work / name
        shutil.rmtree(lat, ignore_errors=True)
        cols = {
            "latent_mean": "ndarray:float16",
            "latent_std": "ndarray:float16",
            "key": "str",
            "caption": "str",
            "text_hidden" if text else "input_ids": "ndarray:float16" if text else "ndarray:int32",
        }
        # The ids precompute stores: what the loader's tokenizer makes of each caption.
        ids = tokenize([f"caption {i}" for i in range(count)]).numpy().astype(np.int32)
        with MDSWriter(out=str(lat), columns=cols, size_limit=1 << 27) as wr:
            for i in range(count):
                row = {
                    "latent_mean": rng.standard_normal((4, 32, 32)).astype(np.float16),
                    "latent_std": rng.random((4, 32, 32)).astype(np.float16),
                    "key": f"k{i}",
                    "caption": f"caption {i}",
                }
                if text:
                    row["text_hidden"] = rng.standard_normal((77, 1024)).astype(np.float16)
                else:
                    row["input_ids"] = ids[i]
                wr.write(row)
        lat_loader = build_loader(train, str(lat), tok, RES, 256)
        _time_loader(lat_loader, 1)
        t = _time_loader(lat_loader)
        res[name] = {**per(t["n"], t["seconds"]), "startup_s": t["startup_s"]}

    import boto3
    from moto.server import ThreadedMotoServer

    for k, v in (
        ("AWS_ACCESS_KEY_ID", "x"),
        ("AWS_SECRET_ACCESS_KEY", "x"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
    ):
        os.environ.setdefault(k, v)
    port = bench_ingest._free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        os.environ["S3_ENDPOINT_URL"] = endpoint  # streaming reads it for S3 remotes
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket="bench")
        for f in files:
            client.upload_file(f, "bench", f"raw/{Path(f).relative_to(src).as_posix()}")
        for f in mds.rglob("*"):
            if f.is_file():
                client.upload_file(str(f), "bench", f"mds/{f.relative_to(mds).as_posix()}")
        jobs = [(endpoint, "bench", f"raw/{Path(f).relative_to(src).as_posix()}") for f in files]
        res["imagefolder_s3"] = per(len(files), _time_pool(_imagefolder_s3_item, jobs, w, 16))
        cache = work / "cache"
        shutil.rmtree(cache, ignore_errors=True)
        s3_loader = build_loader(train, str(cache), tok, RES, 32, remote="s3://bench/mds")
        t0 = time.perf_counter()
        n = sum(len(b["key"]) for b in s3_loader)  # cold: shards stream from S3 to the cache
        res["loader_s3_cold"] = per(n, time.perf_counter() - t0)
    finally:
        server.stop()

    r = {k: v["samples_per_s"] for k, v in res.items() if "samples_per_s" in v}
    out = {
        "benchmark": "loader",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "images": len(files),
        "resolution": RES,
        "workers": w,
        "batch_size": {str(k): v for k, v in batch.items() if k <= 2 * RES},
        "epoch_passes": args.passes,
        **res,
        "loader_vs_decode_only": round(r["loader"] / r["decode_only"], 3),
        "loader_tokenizing_vs_decode_only": round(r["loader_tokenizing"] / r["decode_only"], 3),
        "loader_hflip_vs_decode_only": round(r["loader_hflip"] / r["decode_only"], 3),
        "loader_vs_decode_only_torchvision": round(r["loader"] / r["decode_only_torchvision"], 3),
        "loader_vs_decode_only_pil": round(r["loader"] / r["decode_only_pil"], 3),
        "loader_vs_decode_only_512": round(r["loader_512"] / r["decode_only_512"], 3),
        "loader_in_process_vs_decode_only": round(
            res["loader_in_process"]["samples_per_s_per_core"]
            / res["decode_only"]["samples_per_s_per_core"],
            3,
        ),
        "loader_vs_imagefolder_local": round(r["loader"] / r["imagefolder_local"], 3),
        "loader_vs_imagefolder_s3": round(r["loader_s3_cold"] / r["imagefolder_s3"], 3),
        "latents_samples_per_s_per_core": res["latents"]["samples_per_s_per_core"],
        "latents_text_samples_per_s_per_core": res["latents_text"]["samples_per_s_per_core"],
        # Per core: Kiln's step on `workers` processes against the naive one on one.
        "shard_vs_naive": round(
            res["shard_step"]["samples_per_s_per_core"]
            / res["shard_naive_single_process"]["samples_per_s_per_core"],
            3,
        ),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))  # noqa: T201 - a benchmark script reports on stdout


if __name__ == "__main__":
    main()
