"""Blindness over HTTP: what a browser gets for an image says nothing of its study or its day.

Two studies with the same pixels, written by different tools on days a day apart (file times,
text, compressed text, international text, time and EXIF chunks, compression level), are
served by a real `kiln rate serve` process on 127.0.0.1. Both images of a task must come back
as the same bytes with the same headers (Date aside), with no Last-Modified or ETag, and with
no metadata chunk in the PNG.
"""

from __future__ import annotations

import io
import os
import re
import struct
import time
import zlib
from collections import Counter

import httpx
import numpy as np
import pytest
from PIL import Image, PngImagePlugin

from human_eval.app import blind_png
from human_eval.store import Pair, RatingStore, Task, sqlite_url
from human_eval.studies import create_comparison, load_study
from tasks.storage.layout import Layout
from tests.servers import free_port

from .conftest import (
    PROMPTS,
    many_prompts,
    serve_argv,
    start_server,
    stop,
    write_study,
)

pytestmark = pytest.mark.integration

DAY = 24 * 3600
METADATA_CHUNKS = {b"tEXt", b"iTXt", b"zTXt", b"tIME", b"eXIf", b"iCCP", b"pHYs"}


def png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """(type, payload) of every chunk of a PNG, checking the signature and each CRC."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    chunks, pos = [], 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, payload = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + payload) == crc, kind
        chunks.append((kind, payload))
        pos += 12 + length
    return chunks


def _tag(folder, model: str, when: float, compress_level: int) -> None:
    """Rewrite a study's PNGs with its model's metadata, and date every file `when`."""
    for png in sorted((folder / "images").glob("*.png")):
        with Image.open(png) as im:
            im.load()
            info = PngImagePlugin.PngInfo()
            info.add_text("model", model)
            info.add_text("parameters", f"{model}, steps 50", zip=True)
            info.add_itxt("Comment", f"made by {model}", lang="en")
            info.add(b"tIME", struct.pack(">HBBBBB", *time.gmtime(when)[:6]))
            exif = Image.Exif()
            exif[0x0131] = model  # Software
            exif[0x0132] = time.strftime("%Y:%m:%d %H:%M:%S", time.gmtime(when))  # DateTime
            im.save(png, pnginfo=info, exif=exif, compress_level=compress_level)
        assert {k for k, _ in png_chunks(png.read_bytes())} >= {
            b"tEXt",
            b"zTXt",
            b"iTXt",
            b"tIME",
            b"eXIf",
        }
    for path in folder.rglob("*"):
        os.utime(path, (when, when))


@pytest.fixture
def two_days(tmp_path):
    """A server over a comparison of an old study (A) with a new one (B), same pixels."""
    root = tmp_path / "root"
    now = time.time()
    old = write_study(root, "study-old-1111", prompts=PROMPTS, size=64, model="run-old")
    new = write_study(root, "study-new-2222", prompts=PROMPTS, size=64, model="run-new")
    _tag(old, "run-old", now - DAY, compress_level=9)
    _tag(new, "run-new", now, compress_level=1)
    assert (old / "images" / "0000-s0.png").stat().st_size != (
        new / "images" / "0000-s0.png"
    ).stat().st_size
    url = sqlite_url(Layout(root).ratings_db())
    store = RatingStore(url)
    cid, _ = create_comparison(store, load_study(old), load_study(new), raters_per_pair=1, gold=0)
    [(_, token)] = store.add_raters(cid, 1)
    port = free_port()
    proc, base = start_server(serve_argv(root, port), port)
    yield {"base": base, "token": token, "old": old, "new": new}
    stop(proc)
    store.close()


def test_both_images_of_a_task_look_the_same_to_the_browser(two_days):
    base, token = two_days["base"], two_days["token"]
    with httpx.Client() as client:
        page = client.get(f"{base}/rate/{token}")
        assert page.status_code == 200
        ids = re.findall(rf'src="/rate/{token}/image/([^"]+)"', page.text)
        assert len(ids) == 2 and ids[0] != ids[1]
        for image_id in ids:  # an opaque random id: no study, model, file name or size
            assert re.fullmatch(r"[0-9a-f]{32}", image_id), image_id
            for part in ["study", "1111", "2222", "run-", "0000", ".png"]:
                assert part not in image_id, image_id
        left, right = (client.get(f"{base}/rate/{token}/image/{i}") for i in ids)

    for r in (left, right):
        assert r.status_code == 200 and r.http_version == left.http_version
        names = {k.lower() for k in r.headers}
        assert not names & {"last-modified", "etag", "content-disposition", "age", "expires"}
        assert r.headers["content-type"] == "image/png"
        assert int(r.headers["content-length"]) == len(r.content)
        kinds = [k for k, _ in png_chunks(r.content)]
        assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND"
        assert set(kinds) == {b"IHDR", b"IDAT", b"IEND"}, kinds
        assert not set(kinds) & METADATA_CHUNKS
        for marker in [b"run-old", b"run-new", b"Exif", b"steps"]:
            assert marker not in r.content

    def without_date(r):
        return [(k.lower(), v) for k, v in r.headers.multi_items() if k.lower() != "date"]

    assert without_date(left) == without_date(right)
    # Same pixels in, same bytes out: nothing but the pixels decides what is sent.
    assert left.content == right.content

    # And the pixels are the study's own: the re-encoding is lossless.
    served = np.asarray(Image.open(io.BytesIO(left.content)))
    sources = [
        np.asarray(Image.open(p).convert("RGB"))
        for p in sorted((two_days["old"] / "images").glob("*.png"))
    ]
    assert any(np.array_equal(served, src) for src in sources)


def test_a_rater_who_walks_every_task_cannot_tell_which_side_is_a(tmp_path):
    """Two studies of 20 prompts, 20 attention checks, one rater who sees every task: no image
    URL comes back in a second task, and the images that do (the same pixels under new ids)
    come from both studies, since each attention check shows a study drawn at random (all 20
    from one study: a chance of one in 2^19)."""
    root = tmp_path / "root"
    prompts = many_prompts(20)
    a = write_study(root, "study-a-1111", prompts=prompts, model="run-a")
    b = write_study(root, "study-b-2222", prompts=prompts, colour=(40, 40, 200), model="run-b")
    store = RatingStore(sqlite_url(Layout(root).ratings_db()))
    cid, _ = create_comparison(store, load_study(a), load_study(b), raters_per_pair=1, gold=20)
    [(_, token)] = store.add_raters(cid, 1)
    study_of = {
        blind_png(path): folder.name
        for folder in (a, b)
        for path in sorted((folder / "images").glob("*.png"))
    }
    port = free_port()
    proc, base = start_server(serve_argv(root, port), port)
    urls, shown = [], Counter()
    try:
        with httpx.Client() as client:
            while True:
                page = client.get(f"{base}/rate/{token}")
                ids = re.findall(rf'src="/rate/{token}/image/([^"]+)"', page.text)
                if not ids:
                    assert "Thank you" in page.text
                    break
                urls += ids
                for image_id in ids:
                    body = client.get(f"{base}/rate/{token}/image/{image_id}").content
                    shown[(study_of[body], body)] += 1
                task_id = re.search(r'name="task_id" value="(\d+)"', page.text).group(1)
                form = {"task_id": task_id, "quality": "tie", "alignment": "tie"}
                client.post(f"{base}/rate/{token}/vote", data=form)
    finally:
        stop(proc)
        store.close()
    assert len(urls) == 2 * 40, "every pair and every attention check, once"
    assert len(set(urls)) == len(urls), "no image URL is served in two tasks"
    again = {study for (study, _), n in shown.items() if n > 1}
    assert again == {"study-a-1111", "study-b-2222"}


def test_gold_positions_come_from_the_stores_secret_not_the_rater_id(tmp_path):
    """The same comparison and the same rater ids in two stores: the attention checks fall at
    other positions (a rater id is sequential, so positions drawn from it were predictable)."""

    def gold_positions(db) -> list[list[int]]:
        root = tmp_path / "root"
        if not (root / "eval").is_dir():
            write_study(root, "study-a-1111", prompts=many_prompts(12), model="run-a")
            write_study(root, "study-b-2222", prompts=many_prompts(12), colour=(9, 9, 9))
        store = RatingStore(sqlite_url(db))
        studies = [load_study(f"study-{x}", root / "eval") for x in ("a-1111", "b-2222")]
        cid, _ = create_comparison(store, *studies, raters_per_pair=3, gold=6)
        out = []
        for rater in (store.rater(t) for _, t in store.add_raters(cid, 3)):
            positions = []
            for i in range(12 + 6):  # every pair, then every attention check
                task = store.next_task(rater)
                with store.session() as s:
                    gold = s.get(Pair, s.get(Task, task.task_id).pair_id).gold
                if gold:
                    positions.append(i)
                store.record_vote(rater, task.task_id, {"quality": "tie", "alignment": "tie"})
            out.append(positions)
        store.close()
        return out

    first, second = gold_positions(tmp_path / "one.db"), gold_positions(tmp_path / "two.db")
    assert all(len(p) == 6 for p in first + second)
    assert first != second
