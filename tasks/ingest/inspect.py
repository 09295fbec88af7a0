"""Inspect one ingest item (an image file with its sidecars, or a whole tar shard), and
each image in it: metadata, pHash, and a reason code for anything unusable.

Runs in ingest's worker processes (or on Dask workers), so it imports little. Every outcome is
a list of records, never an exception: each record is either catalog metadata for one image or
a reason code for quarantine. Records point at the bytes they came from with (object, offset,
length), so that the shard step can read a tar member back with one ranged read. Every byte
of an image is decoded (truncation and corruption are caught), and a decompression bomb is
caught from the header alone, before any pixel is decoded.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import warnings
from dataclasses import dataclass
from pathlib import PurePosixPath

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from tasks.ingest.sources import Item, is_unsafe_key
from tasks.storage.images import to_rgb
from tasks.storage.objects import ObjectTooLarge, worker_storage

__all__ = ["InspectOptions", "conversion_steps", "inspect_bytes", "inspect_item", "phash"]


@dataclass(frozen=True)
class InspectOptions:
    """What a decode worker needs from `ingest` settings (picklable, imports nothing)."""

    source: str
    endpoint_url: str | None
    max_pixels: int
    metadata_columns: tuple[str, ...]
    image_extensions: tuple[str, ...]  # `ingest.image_extensions`, e.g. (".jpg", ".png")
    max_bytes: int = 256 * 2**20  # `ingest.max_bytes`: a larger file or member is not read

    @property
    def member_extensions(self) -> tuple[str, ...]:
        """The image extensions as WebDataset member suffixes ("jpg"), in preference order."""
        return tuple(e.lower().lstrip(".") for e in self.image_extensions)


def _orientation(img: Image.Image) -> int:
    try:
        return int(img.getexif().get(0x0112, 1) or 1)
    except Exception:  # noqa: BLE001 - a broken EXIF block is ignored, as exif_transpose does
        return 1


# DCT basis for the perceptual hash: the 8 lowest frequencies of a 32-point DCT-II.
_N = 32
_DCT = np.sqrt(2 / _N) * np.cos(
    np.pi * (2 * np.arange(_N)[None, :] + 1) * np.arange(8)[:, None] / (2 * _N)
)


def phash(img: Image.Image) -> str:
    """64-bit perceptual hash (pHash): the sign of the 8x8 lowest DCT frequencies of a 32x32
    greyscale thumbnail against their median, as 16 hex digits. Hamming distance between two
    hashes measures visual difference, robust to resizing and recompression."""
    small = img.convert("L").resize((_N, _N), Image.LANCZOS)
    low = _DCT @ np.asarray(small, dtype=np.float64) @ _DCT.T
    bits = (low > np.median(low)).flatten()
    return f"{int(''.join('1' if b else '0' for b in bits), 2):016x}"


def inspect_bytes(data: bytes, max_pixels: int) -> dict:
    """Metadata of one image from its bytes, or {reason, detail} for quarantine.

    Every byte of the compressed stream is decoded, so truncation and corruption are caught.
    For JPEG the decode runs in DCT-scaling draft mode: libjpeg still entropy-decodes every
    block (where truncation and bad Huffman data show up) but skips most of the full-size
    inverse DCT, which is the bulk of a full decode. The header is checked against
    `max_pixels` before any pixel is decoded, so a decompression bomb costs nothing.
    """
    rec: dict = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if not data:
        return {**rec, "reason": "empty_file", "detail": "0 bytes"}
    # We enforce our own pixel limit, so PIL's bomb check must not pre-empt it with an error.
    Image.MAX_IMAGE_PIXELS = None
    try:
        with Image.open(io.BytesIO(data)) as img:
            w, h = img.size
            if w * h > max_pixels:
                return {**rec, "reason": "too_many_pixels", "detail": f"{w}x{h} > {max_pixels}"}
            fmt, mode = img.format, img.mode
            orientation = _orientation(img)
            if fmt == "JPEG" and min(w, h) >= 256:
                img.draft(mode, (w // 8, h // 8))
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a truncated-file warning is a failure too
                img.load()
            if orientation in (5, 6, 7, 8):  # EXIF rotations by 90 degrees swap the sides
                w, h = h, w
            conversion = conversion_steps(img, orientation)
            rgb = to_rgb(ImageOps.exif_transpose(img))
            ph = phash(rgb)
    except UnidentifiedImageError:
        return {**rec, "reason": "not_an_image", "detail": "bytes are not a known image format"}
    except (OSError, SyntaxError, ValueError, Warning) as e:
        return {**rec, "reason": "decode_error", "detail": f"{type(e).__name__}: {e}"}
    except Exception as e:  # noqa: BLE001 - hostile input must never crash the worker
        return {**rec, "reason": "decode_error", "detail": f"{type(e).__name__}: {e}"}
    return {
        **rec,
        "width": w,
        "height": h,
        "format": fmt,
        "mode": mode,
        "phash": ph,
        "conversion": conversion,
    }


def conversion_steps(img: Image.Image, orientation: int = 1) -> str:
    """What normalisation to RGB will do to this image, e.g. `exif:6,CMYK->RGB`."""
    steps = [f"exif:{orientation}"] if orientation not in (1, 0) else []
    mode = img.mode
    if mode in ("RGBA", "LA", "PA") or (mode == "P" and "transparency" in img.info):
        steps.append(f"{mode}->RGB(alpha on white)")
    elif mode in ("I;16", "I;16B", "I;16L", "I"):
        steps.append(f"{mode}->RGB(16-bit scaled)")
    elif mode != "RGB":
        steps.append(f"{mode}->RGB")
    return ",".join(steps)


def _caption(raw: bytes | None) -> tuple[str | None, dict | None]:
    """Caption text from a `.txt` sidecar, or a quarantine reason when it is not UTF-8."""
    if raw is None:
        return None, None
    try:
        return raw.decode("utf-8").strip(), None
    except UnicodeDecodeError as e:
        return None, {"reason": "caption_not_utf8", "detail": str(e)}


def _meta(raw: bytes | None, columns: tuple[str, ...]) -> tuple[dict, dict | None]:
    """Pass-through columns from a `.json` sidecar, or a quarantine reason when unreadable."""
    if raw is None:
        return {c: None for c in columns}, None
    try:
        doc = json.loads(raw.decode("utf-8"))
        if not isinstance(doc, dict):
            raise ValueError(f"expected a JSON object, got {type(doc).__name__}")
    except (UnicodeDecodeError, ValueError) as e:
        return {}, {"reason": "sidecar_bad_json", "detail": f"{type(e).__name__}: {e}"[:500]}
    return {c: _flat(doc.get(c)) for c in columns}, None


def _flat(v):
    return json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else v


def _record(base: dict, image: bytes, opts: InspectOptions, problem: dict | None) -> dict:
    rec = {**base, **inspect_bytes(image, opts.max_pixels)}
    if problem and "reason" not in rec:
        rec.update(problem)  # the image is fine, but its caption or metadata is not
    return rec


def _inspect_file(item: Item, opts: InspectOptions) -> list[dict]:
    store = worker_storage(opts.source, opts.endpoint_url)
    base = {"key": item.key, "object": item.key, "offset": -1}
    cap = opts.max_bytes
    try:
        data = store.read_bytes(item.key, cap)
        txt = store.read_bytes(item.txt, cap) if item.txt else None
        side = store.read_bytes(item.json, cap) if item.json else None
    except ObjectTooLarge as e:
        return [{**base, "reason": "too_large", "detail": str(e)}]
    except Exception as e:  # noqa: BLE001 - any read failure is a quarantine reason
        return [{**base, "reason": "read_error", "detail": f"{type(e).__name__}: {e}"[:500]}]
    base["length"] = len(data)
    if item.txt is not None or item.json is not None:  # img2dataset sidecars
        caption, problem = _caption(txt)
        meta, meta_problem = _meta(side, opts.metadata_columns)
        problem = problem or meta_problem
    else:  # imagefolder: caption and metadata came from the manifest
        caption, meta, problem = item.caption, dict(item.meta), None
    return [_record({**base, "caption": caption, **meta}, data, opts, problem)]


def _split_member(name: str) -> tuple[str, str]:
    # WebDataset convention: the key is the path up to the first dot of the file name.
    p = PurePosixPath(name)
    stem, _, ext = p.name.partition(".")
    parent = str(p.parent)
    return (stem if parent == "." else f"{parent}/{stem}"), ext.lower()


def _finish_sample(
    tar_key: str, sample: str, members: dict, opts: InspectOptions, seen: set[str]
) -> dict:
    key = f"{tar_key}/{sample}"
    base = {"key": key, "object": tar_key, "offset": -1, "length": 0}
    names = ", ".join(sorted(m["name"] for m in members.values()))
    if any(is_unsafe_key(m["name"]) for m in members.values()):
        return {**base, "reason": "unsafe_key", "detail": f"tar member path escapes: {names}"}
    if key in seen:
        return {**base, "reason": "duplicate_key", "detail": f"sample key repeated in {tar_key}"}
    seen.add(key)
    big = [m for m in members.values() if m["data"] is None]
    if big:  # never read: a header can claim any size, a gzip member can expand to it
        return {
            **base,
            "reason": "too_large",
            "detail": f"member {big[0]['name']} is {big[0]['size']} bytes, over "
            f"{opts.max_bytes} (ingest.max_bytes)",
        }
    img_ext = next((e for e in opts.member_extensions if e in members), None)
    if img_ext is None:
        return {**base, "reason": "no_image", "detail": f"sample has no image member: {names}"}
    img = members[img_ext]
    base.update(offset=img["offset"], length=img["size"])
    caption, problem = _caption(members["txt"]["data"] if "txt" in members else None)
    meta, meta_problem = _meta(
        members["json"]["data"] if "json" in members else None, opts.metadata_columns
    )
    return _record({**base, "caption": caption, **meta}, img["data"], opts, problem or meta_problem)


def _inspect_tar(item: Item, opts: InspectOptions) -> list[dict]:
    """Stream a tar once, member by member (never extracted to disk, never held whole)."""
    out: list[dict] = []
    seen: set[str] = set()
    current, members = None, {}
    try:
        with (
            worker_storage(opts.source, opts.endpoint_url).open_stream(item.key) as raw,
            tarfile.open(fileobj=raw, mode="r|*") as tf,
        ):
            for m in tf:
                if m.isdir():
                    continue
                sample, ext = _split_member(m.name)
                if not m.isfile():
                    out.append(
                        {
                            "key": f"{item.key}/{m.name}",
                            "object": item.key,
                            "offset": -1,
                            "length": 0,
                            "reason": "unsupported_member",
                            "detail": "links and devices are not read",
                        }
                    )
                    continue
                if sample != current:
                    if current is not None:
                        out.append(_finish_sample(item.key, current, members, opts, seen))
                    current, members = sample, {}
                # Over the cap: skipped unread (the stream reads past it in small blocks).
                data = tf.extractfile(m).read() if m.size <= opts.max_bytes else None
                members[ext] = {
                    "name": m.name,
                    "offset": m.offset_data,
                    "size": m.size,
                    "data": data,
                }
            if current is not None:
                out.append(_finish_sample(item.key, current, members, opts, seen))
    except Exception as e:  # noqa: BLE001 - a broken tar is a reason; what was read counts
        if current is not None and members:
            out.append(_finish_sample(item.key, current, members, opts, seen))
        out.append(
            {
                "key": item.key,
                "object": item.key,
                "offset": -1,
                "length": 0,
                "reason": "tar_error",
                "detail": f"{type(e).__name__}: {e}"[:500],
            }
        )
    if not out:
        out.append(
            {
                "key": item.key,
                "object": item.key,
                "offset": -1,
                "length": 0,
                "reason": "empty_tar",
                "detail": "no samples",
            }
        )
    return out


def inspect_item(job: tuple[InspectOptions, Item]) -> list[dict]:
    """Records for one item; `job` is (options, item). Never raises for bad input."""
    opts, item = job
    recs = _inspect_tar(item, opts) if item.kind == "tar" else _inspect_file(item, opts)
    for r in recs:
        r["unit"], r["unit_version"] = item.key, item.version
    return recs
