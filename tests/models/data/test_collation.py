"""Collation (`models.data.collation`) and pixel decoding (`models.data.images`), in-process on tiny
images and arrays: the batch layout the trainer relies on, and the clear wrong-size error."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from kiln_config import TokenizerConfig
from models.components.factory import build_tokenizer
from models.data.collation import KilnCollate, device_pixels
from models.data.images import decode_pixels, decode_uint8, normalize_pixels
from models.data.tokenization import CaptionTokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(TokenizerConfig(builtin="bytes", model_max_length=16))


def _encoded(arr: np.ndarray, fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buf.getvalue()


def _images(n: int, w: int, h: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for _ in range(n)]


def _samples(images: list[bytes], **columns) -> list[dict]:
    return [
        {
            "image": img,
            "caption": f"caption {i}",
            "key": f"k{i}",
            "drop": False,
            **{k: v[i] for k, v in columns.items()},
        }
        for i, img in enumerate(images)
    ]


def test_collate_tokenizes_like_the_tokenizer(tok):
    """Batch tokenization in the collate gives the ids the model's tokenizer gives."""
    assert tok.is_fast
    captions = [
        "a photo of a cat",
        "",
        "  spaced   out  ",
        "Crème brûlée, 日本の写真!",
        "long " * 200,
        "UPPER and lower",
    ]
    want = tok(
        captions,
        padding="max_length",
        truncation=True,
        max_length=tok.model_max_length,
        return_tensors="np",
    ).input_ids
    got = KilnCollate(tok, 32).ids(captions)
    assert got.dtype == torch.int64 and tuple(got.shape) == want.shape
    assert np.array_equal(got.numpy(), want)


def test_image_batch_is_a_channels_last_view_of_the_decoded_pixels(tok):
    """PNG and JPEG bytes (and memoryviews of them, as the reader hands out) decode into one
    uint8 (B, 3, H, W) batch with channels-last strides; captions become the tokenizer's ids."""
    arrays = _images(4, w=6, h=4)
    data = [
        _encoded(arrays[0], "PNG"),
        memoryview(_encoded(arrays[1], "PNG")),
        _encoded(arrays[2], "JPEG"),
        memoryview(_encoded(arrays[3], "JPEG")),
    ]
    samples = _samples(data)
    out = KilnCollate(tok, (6, 4))(samples)

    px = out["pixel_values"]
    assert px.dtype == torch.uint8 and tuple(px.shape) == (4, 3, 4, 6)
    assert px.is_contiguous(memory_format=torch.channels_last) and not px.is_contiguous()
    for i in (0, 1):  # lossless: exactly the stored pixels
        assert torch.equal(px[i], torch.from_numpy(arrays[i]).permute(2, 0, 1))
    for i in (2, 3):  # JPEG: exactly what the one-image decoder gives
        assert torch.equal(px[i], decode_uint8(data[i], (6, 4)))
    want_ids = CaptionTokenizer(tok)([s["caption"] for s in samples])
    assert out["input_ids"].dtype == torch.int64 and torch.equal(out["input_ids"], want_ids)
    assert out["key"] == ["k0", "k1", "k2", "k3"]
    assert "flip" not in out and "drop" not in out


def test_normalize_pixels_maps_uint8_to_minus_one_one():
    got = normalize_pixels(torch.tensor([[[[0, 51, 255]]]], dtype=torch.uint8))
    assert got.dtype == torch.float32 and tuple(got.shape) == (1, 1, 1, 3)
    assert torch.allclose(got.flatten(), torch.tensor([-1.0, 51 / 127.5 - 1, 1.0]))
    arr = _images(1, w=5, h=3)[0]
    arr[0, 0], arr[-1, -1] = 0, 255
    png = _encoded(arr, "PNG")
    pixels = decode_pixels(png, (5, 3))
    assert torch.equal(pixels, normalize_pixels(decode_uint8(png, (5, 3))))
    assert pixels.min() == -1.0 and pixels.max() == 1.0


def test_device_pixels_mirrors_exactly_the_flagged_images(tok):
    """The collate only carries the hflip flags; `device_pixels` makes the batch contiguous
    and mirrors the flagged images left to right."""
    arrays = _images(3, w=5, h=3, seed=1)
    flags = [True, False, True]
    out = KilnCollate(tok, (5, 3))(_samples([_encoded(a, "PNG") for a in arrays], flip=flags))
    assert out["flip"].dtype == torch.bool and out["flip"].tolist() == flags
    pixels = device_pixels(out, "cpu")
    assert pixels.is_contiguous() and pixels.dtype == torch.uint8
    for px, arr, flip in zip(pixels, arrays, flags, strict=True):
        want = torch.from_numpy(arr).permute(2, 0, 1)
        assert torch.equal(px, want.flip(-1) if flip else want)
    unflagged = {k: v for k, v in out.items() if k != "flip"}
    assert torch.equal(device_pixels(unflagged, "cpu"), out["pixel_values"].contiguous())


def _stored(arrays: list[np.ndarray]) -> list[np.ndarray]:
    """Read-only, unaligned views of `arrays` in one buffer: what the MDS reader hands out
    (MDS stores arrays at arbitrary offsets)."""
    buf = b"\x00" + b"".join(a.tobytes() for a in arrays)
    out, pos = [], 1
    for a in arrays:
        out.append(np.frombuffer(buf, a.dtype, a.size, pos).reshape(a.shape))
        pos += a.nbytes
    return out


def test_precomputed_columns_stack_into_the_batch(tok):
    """Latents, text states and stored token ids (views of the shard) stack into batch
    tensors of their dtype; a dropped caption's stored ids become the empty caption's."""
    rng = np.random.default_rng(2)
    mean = [rng.standard_normal((4, 2, 2)).astype(np.float16) for _ in range(3)]
    std = [rng.random((4, 2, 2)).astype(np.float16) for _ in range(3)]
    hidden = [rng.standard_normal((16, 8)).astype(np.float16) for _ in range(3)]
    drop = [False, True, False]
    views = zip(_stored(mean), _stored(std), _stored(hidden), drop, strict=True)
    samples = [
        {"latent_mean": m, "latent_std": s, "text_hidden": t, "key": f"k{i}", "drop": d}
        for i, (m, s, t, d) in enumerate(views)
    ]
    assert not samples[0]["latent_mean"].flags.aligned
    out = KilnCollate(tok, 16)(samples)
    for col, want in (("latent_mean", mean), ("latent_std", std), ("text_hidden", hidden)):
        assert out[col].dtype == torch.float16, col
        assert np.array_equal(out[col].numpy(), np.stack(want)), col
    assert out["drop"].tolist() == drop and "input_ids" not in out and "pixel_values" not in out

    ids = CaptionTokenizer(tok)(["one", "two", "three"]).numpy().astype(np.int32)
    views = zip(_stored(mean), _stored(std), _stored(list(ids)), drop, strict=True)
    samples = [
        {"latent_mean": m, "latent_std": s, "input_ids": i, "key": f"k{n}", "drop": d}
        for n, (m, s, i, d) in enumerate(views)
    ]
    out = KilnCollate(tok, 16)(samples)
    assert out["input_ids"].dtype == torch.int64 and tuple(out["input_ids"].shape) == (3, 16)
    empty = CaptionTokenizer(tok)([""])[0]
    assert torch.equal(out["input_ids"][0], torch.from_numpy(ids[0]).long())
    assert torch.equal(out["input_ids"][1], empty)
    assert torch.equal(out["input_ids"][2], torch.from_numpy(ids[2]).long())


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_images_of_the_wrong_size_fail_clearly(tok, fmt):
    """A batch image of another size than the stage's (or than every bucket's) names both."""
    small = _encoded(_images(1, w=6, h=4)[0], fmt)
    square = _encoded(_images(1, w=8, h=8)[0], fmt)
    with pytest.raises(ValueError, match=r"images of \[\(6, 4\)\].*expected one of \[\(8, 8\)\]"):
        KilnCollate(tok, 8)(_samples([square, small]))
    buckets = KilnCollate(tok, [(8, 8), (8, 4)])
    with pytest.raises(ValueError, match=r"images of \[\(6, 4\)\].*\[\(8, 4\), \(8, 8\)\]"):
        buckets(_samples([small]))  # the first image's header picks the bucket
    with pytest.raises(ValueError, match=r"images of \[\(6, 4\)\].*\[\(8, 8\)\]"):
        buckets(_samples([square, small]))  # a later image must match the first one's
    wide = _encoded(_images(1, w=8, h=4)[0], fmt)
    assert tuple(buckets(_samples([wide, wide]))["pixel_values"].shape) == (2, 3, 4, 8)
