"""The training loader (`models.data.loader`): streams mixed by proportion, stored token ids,
hflip, S3 remotes, and batches through shared buffers in worker processes."""

import json
from collections import Counter

import pytest

from kiln_config import load_config
from models.components.factory import build_tokenizer
from models.data.loader import build_loader
from models.measure_throughput import write_synthetic_shards


def test_streams_mix_by_proportion(tmp_path, tiny_shards):
    cfg_path, root, version = tiny_shards
    cfg = load_config(cfg_path).train
    other = tmp_path / "last-year"
    write_synthetic_shards(other, 32, 40)  # keys s0..s39
    tok = build_tokenizer(cfg.model.tokenizer)
    main = str(root / "shards" / version / "32")
    counts: Counter = Counter()
    for seed in range(3):
        train = cfg.model_copy(update={"shuffle_seed": seed, "shuffle_algo": "py1s"})
        loader = build_loader(train, main, tok, 32, 4, mix=[(str(other), 0.2)])
        for batch in loader:
            counts.update(
                "other" if k.startswith("s") and k[1:].isdigit() else "main" for k in batch["key"]
            )
    share = counts["other"] / sum(counts.values())
    assert abs(share - 0.2) < 0.05, counts


def test_stored_token_ids_give_the_batches_tokenizing_gives(tiny_shards, caplog):
    """Shards written with token ids (the shard flow's default) give exactly the batches the
    loader makes by tokenizing their captions, caption dropout included; pixels decoded into
    the batch are torchvision's decode; ids made by another tokenizer are not used."""
    import torch

    from models.data.collation import KilnCollate
    from models.data.images import decode_uint8
    from models.data.loader import ImageCaptionDataset

    cfg_path, root, version = tiny_shards
    cfg = load_config(cfg_path).train
    tok = build_tokenizer(cfg.model.tokenizer)
    path = str(root / "shards" / version / "32")

    def batches(tokenizer, **kw):
        train = cfg.model_copy(update={"shuffle_seed": 1, "seed": 2, "caption_dropout": 0.3})
        loader = build_loader(train, path, tokenizer, 32, 4, **kw)
        return loader.dataset.columns, list(loader)

    cols, stored = batches(tok)
    assert "input_ids" in cols
    cols, tokenized = batches(tok, token_ids=False)
    assert "input_ids" not in cols
    assert len(stored) == len(tokenized) > 3
    for a, b in zip(stored, tokenized, strict=True):
        assert a["key"] == b["key"]
        assert torch.equal(a["input_ids"], b["input_ids"])
        assert torch.equal(a["pixel_values"], b["pixel_values"])
    empty = KilnCollate(tok, 32).ids([""])[0]
    dropped = sum(bool(torch.equal(row, empty)) for b in stored for row in b["input_ids"])
    assert 0 < dropped < 4 * len(stored)
    ref = ImageCaptionDataset(local=path, batch_size=1, shuffle=False)
    images = {s["key"]: s["image"] for s in map(ref.read_sample, range(ref.num_samples))}
    for b in stored:
        assert b["pixel_values"].shape == (4, 3, 32, 32)
        for key, px in zip(b["key"], b["pixel_values"], strict=True):
            assert torch.equal(px, decode_uint8(images[key], 32))
    other = build_tokenizer(cfg.model.tokenizer.model_copy(update={"model_max_length": 16}))
    with caplog.at_level("WARNING", logger="kiln.data"):
        cols, short = batches(other)
    assert "input_ids" not in cols and "not this tokenizer's" in caplog.text
    assert short[0]["input_ids"].shape == (4, 16)


def test_hflip_mirrors_the_images_its_seed_picks_every_run(tiny_shards):
    import torch

    from models.data.collation import device_pixels
    from models.data.images import decode_uint8
    from models.data.loader import ImageCaptionDataset, _uniform

    cfg_path, root, version = tiny_shards
    cfg = load_config(cfg_path).train.model_copy(update={"shuffle_seed": 1, "seed": 2})
    tok = build_tokenizer(cfg.model.tokenizer)
    path = str(root / "shards" / version / "32")
    ref = ImageCaptionDataset(local=path, batch_size=1, shuffle=False)
    stored = [ref.read_sample(i) for i in range(ref.num_samples)]
    want = {s["key"] for i, s in enumerate(stored) if _uniform(2, i, 1) < 0.5}
    images = {s["key"]: decode_uint8(s["image"], 32) for s in stored}

    def flipped_keys() -> tuple[set[str], set[str]]:
        seen, out = set(), set()
        loader = build_loader(cfg.model_copy(update={"hflip": 0.5}), path, tok, 32, 4)
        for batch in loader:
            assert batch["flip"].dtype == torch.bool and batch["flip"].shape == (4,)
            pixels = device_pixels(batch, "cpu")  # the trainer's view: mirrored where flagged
            assert pixels.is_contiguous()
            for key, raw, px, flip in zip(
                batch["key"], batch["pixel_values"], pixels, batch["flip"].tolist(), strict=True
            ):
                seen.add(key)
                assert torch.equal(raw, images[key])  # the loader itself only flags
                assert torch.equal(px, torch.flip(images[key], [2]) if flip else images[key])
                if flip:
                    out.add(key)
        return seen, out

    seen, got = flipped_keys()
    assert 0 < len(got) < len(seen)
    assert got == want & seen  # exactly the seed's picks among the samples served
    assert flipped_keys() == (seen, got)  # and the same every run
    unflipped = next(iter(build_loader(cfg.model_copy(update={"hflip": 0.0}), path, tok, 32, 4)))
    assert "flip" not in unflipped
    with pytest.raises(ValueError, match=r"hflip is a probability in \[0, 1\], got 1.5"):
        build_loader(cfg.model_copy(update={"hflip": 1.5}), path, tok, 32, 4)


def test_loader_streams_from_s3_like_local(
    tmp_path, tiny_shards, s3_bucket, s3_endpoint, upload_dir, monkeypatch
):
    """A loader over an `s3://` remote (moto's server, with a cache limit that forces
    evictions) yields the same batches, in the same order, as the local dataset."""
    import json

    import torch

    cfg_path, _, _ = tiny_shards
    cfg = load_config(cfg_path).train.model_copy(update={"shuffle_seed": 3})
    tok = build_tokenizer(cfg.model.tokenizer)
    local = tmp_path / "mds"
    write_synthetic_shards(local, 32, 48, size_limit=1 << 13)
    bucket, client = s3_bucket
    upload_dir(client, bucket, "mds", local)
    monkeypatch.setenv("S3_ENDPOINT_URL", s3_endpoint)  # streaming's S3 endpoint setting
    shards = json.loads((local / "index.json").read_text())["shards"]
    assert len(shards) > 6
    biggest = max(s["raw_data"]["bytes"] for s in shards)

    def batches(train=cfg, **kw):
        loader = build_loader(train, tokenizer=tok, resolution=32, batch_size=4, **kw)
        return [(b["key"], b["pixel_values"], b["input_ids"]) for b in loader]

    want = batches(local=str(local))
    limited = cfg.model_copy(update={"cache_limit": str(4 * biggest)})
    got = batches(limited, local=str(tmp_path / "cache"), remote=f"s3://{bucket}/mds")
    assert len(list((tmp_path / "cache").glob("*.mds"))) < len(shards)  # some were evicted
    assert [k for k, _, _ in got] == [k for k, _, _ in want]
    for (_, p1, i1), (_, p2, i2) in zip(got, want, strict=True):
        assert torch.equal(p1, p2) and torch.equal(i1, i2)


_RING_CHECK = """
import json, sys, torch
from kiln_config import load_config
from models.components.factory import build_tokenizer
from models.data.loader import build_loader

cfg_path, path = sys.argv[1:3]
one = load_config(cfg_path).train.model_copy(update={"shuffle_seed": 5, "num_workers": 0})
two = one.model_copy(update={"num_workers": 2})
tok = build_tokenizer(one.model.tokenizer)
ref = list(build_loader(one, path, tok, 32, 2))
out = {"batches": len(ref)}
for hold in (False, True):
    loader = build_loader(two, path, tok, 32, 2)
    held, same = [], True
    for i, b in enumerate(loader):
        same &= b["key"] == ref[i]["key"] and torch.equal(b["input_ids"], ref[i]["input_ids"])
        same &= torch.equal(b["pixel_values"], ref[i]["pixel_values"])
        if hold:
            held.append(b)
    # Batches kept until the end still hold their own pixels: no slot was reused under them.
    same &= all(torch.equal(b["pixel_values"], r["pixel_values"]) for b, r in zip(held, ref))
    out[f"hold={hold}"] = {"same": bool(same), "from_ring": loader._ring.rebuilt,
                           "slots": len(loader._ring.state)}

def left_after_3(loader):
    it = iter(loader)
    for _ in range(3):
        next(it)
    del it


def epoch(loader, want):
    # Batch by batch against `want`, holding none; how many tensors came through the ring.
    before, n, same = loader._ring.rebuilt if loader._ring else 0, 0, True
    for b, r in zip(loader, want, strict=True):
        same &= b["key"] == r["key"] and torch.equal(b["pixel_values"], r["pixel_values"])
        n += 1
    after = loader._ring.rebuilt if loader._ring else 0
    return {"same": bool(same), "batches": n, "from_ring": after - before}

# An epoch left after 3 batches: batches it prefetched are never read, yet the next epoch's
# workers find every slot free again. In-process, the same steps give the reference.
inproc = build_loader(one, path, tok, 32, 2)
left_after_3(inproc)
want = list(inproc)
loader = build_loader(two, path, tok, 32, 2)
left_after_3(loader)
out["after_left_epoch"] = epoch(loader, want)
# Spawned workers get no ring (it is shared by fork only) and take the fresh path.
loader = build_loader(two, path, tok, 32, 2)
loader.multiprocessing_context = "spawn"
out["spawn"] = epoch(loader, ref)
print(json.dumps(out))
"""


@pytest.mark.integration
def test_worker_batches_reuse_buffers_and_held_ones_stay_intact(tiny_shards):
    """Two loader workers stack image batches into reused shared buffers
    (models/data/shared_batch_buffers.py).
    Run in a child process: this one runs Prefect's threads, which forked workers must not
    inherit."""
    import subprocess
    import sys

    cfg_path, root, version = tiny_shards
    proc = subprocess.run(
        [sys.executable, "-c", _RING_CHECK, str(cfg_path), str(root / "shards" / version / "32")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    # A worker's own traceback comes first; streaming's leak warnings at exit would bury it.
    noise = ("resource_tracker", "warnings.warn(")
    err = [ln for ln in proc.stderr.splitlines() if not any(w in ln for w in noise)]
    assert proc.returncode == 0, "\n".join(err)[-6000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    n, free, held = out["batches"], out["hold=False"], out["hold=True"]
    assert n > 2 * free["slots"], "more batches than slots: slots must be released and reused"
    assert free["same"] and free["from_ring"] == 2 * n, "every batch (pixels, ids) in a slot"
    assert held["same"], "a held batch is never overwritten"
    assert 0 < held["from_ring"] < 2 * n, "with every batch held, workers fall back to fresh"
    left, spawn = out["after_left_epoch"], out["spawn"]
    assert left["same"] and left["batches"] > 2 * free["slots"], out
    assert left["from_ring"] == 2 * left["batches"], "slots prefetched and never read are freed"
    assert spawn == {"same": True, "batches": n, "from_ring": 0}, out
