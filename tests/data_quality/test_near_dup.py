"""near_dup against brute force: the exact contract, the batched form, and the hot-bucket cap."""

from __future__ import annotations

import time

import numpy as np
import pandas as pd
import pytest

from data_quality import near_dup
from data_quality.near_dup import (
    HOT_PEERS,
    near_candidates,
    near_duplicates,
    near_duplicates_against,
    phash_to_uint64,
)


def brute_force(hashes: list[str], groups: list[str], max_distance: int) -> list[int | None]:
    """The contract, pair by pair: for each row, the first earlier row within `max_distance`
    whose group (sha256) differs, else None."""
    h = [int(x, 16) for x in hashes]
    found: list[int | None] = [None] * len(h)
    for j in range(len(h)):
        for i in range(j):
            if groups[i] != groups[j] and (h[i] ^ h[j]).bit_count() <= max_distance:
                found[j] = i
                break
    return found


def brute_force_against(h, g, old_h, old_g, d) -> np.ndarray:
    dist = np.bitwise_count(h[:, None] ^ old_h[None, :])
    ok = (dist <= d) & (g[:, None] != old_g[None, :])
    return np.where(ok.any(axis=1), ok.argmax(axis=1), -1)


def search(hashes: list[str], groups: list[str], d: int, **kw) -> list[int | None]:
    """The new API, called the way the suite calls it (hex strings, sha256 labels)."""
    labels = pd.factorize(pd.Series(groups))[0].astype(np.uint64)
    found = near_duplicates(phash_to_uint64(hashes), labels, d, **kw)
    assert found.dtype == np.int64
    return [None if i < 0 else int(i) for i in found]


def planted(rng, n: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    """Random hashes, with rows copied from earlier ones at distances 0 to d + 1 and a few
    exact-duplicate groups (the same label on a copy)."""
    h = rng.integers(0, 2**64, n, dtype=np.uint64)
    g = np.arange(n, dtype=np.uint64)
    for t in rng.choice(np.arange(1, n), n // 2, replace=False):
        src = int(rng.integers(0, t))
        flips = rng.choice(64, int(rng.integers(0, d + 2)), replace=False)
        h[t] = h[src] ^ np.uint64(sum(1 << int(b) for b in flips))
        if rng.random() < 0.2:
            g[t] = g[src]
    return h, g


def hexes(h: np.ndarray) -> list[str]:
    return [f"{x:016x}" for x in h.tolist()]


@pytest.mark.parametrize("d", [0, 1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("extra, j", [(None, None), (1, 1), (2, 2), (3, 3), (4, 2), (5, 3)])
def test_matches_brute_force(d, extra, j):
    # d + 1 blocks, one a key (pigeonhole); d + j blocks, j a key, all C(d + j, j) tables; and
    # covering designs, fewer tables of j blocks than m - d.
    rng = np.random.default_rng(100 * d + (extra or 0))
    h, g = planted(rng, 160, d)
    labels = [f"sha{x}" for x in g.tolist()]
    blocks = None if extra is None else (d + extra, j)
    assert search(hexes(h), labels, d, blocks=blocks) == brute_force(hexes(h), labels, d)


def test_tables_split_into_parts_give_the_same_answer(monkeypatch):
    monkeypatch.setattr(near_dup, "_PART_ROWS", 16)  # parts of a table, normally 2**18 rows
    rng = np.random.default_rng(11)
    n, edges = 300, [0, 10, 21, 32, 42, 53, 64]  # d = 4, k = 2: 6 blocks, keys of 2
    h = rng.integers(0, 2**64, n, dtype=np.uint64)
    for t in range(1, n, 2):  # a bit flipped in 4 of the 6 blocks: one table finds the pair
        blocks = rng.choice(6, 4, replace=False)
        flips = sum(1 << int(rng.integers(edges[b], edges[b + 1])) for b in blocks)
        h[t] = h[int(rng.integers(0, t))] ^ np.uint64(flips)
    g = np.arange(n, dtype=np.uint64)
    labels = [str(x) for x in g.tolist()]
    want = brute_force(hexes(h), labels, 4)
    assert sum(m is not None for m in want) >= n // 2
    assert search(hexes(h), labels, 4, blocks=(6, 2)) == want
    got = near_duplicates_against(h[100:], g[100:], h[:100], g[:100], 4, blocks=(6, 2))
    assert got.tolist() == brute_force_against(h[100:], g[100:], h[:100], g[:100], 4).tolist()


def test_comparing_offset_by_offset_or_all_at_once_agrees(monkeypatch):
    # `_compare` goes offset by offset over many positions and takes the last few at once;
    # force each way on the same rows, hot buckets included (a small cap, a blank cluster).
    rng = np.random.default_rng(5)
    h, g = planted(rng, 600, 4)
    h[::3] = np.uint64(0xFFFF0000FFFF0000) ^ (
        np.uint64(1) << rng.integers(0, 64, 200, dtype=np.uint64)
    )
    answers = []
    for few in (0, 10**9):
        monkeypatch.setattr(near_dup, "_FEW", few)
        answers.append(near_duplicates(h, g, 4, hot_bucket_cap=8).tolist())
        answers.append(near_duplicates_against(h[300:], g[300:], h[:300], g[:300], 4).tolist())
    assert answers[:2] == answers[2:]
    monkeypatch.setattr(near_dup, "_FEW", 0)
    want = brute_force(hexes(h), [str(x) for x in g.tolist()], 4)
    assert near_duplicates(h, g, 4).tolist() == [-1 if m is None else m for m in want]


def test_groups_are_respected():
    a = 0x0123456789ABCDEF
    rows = hexes(np.array([a, a, a ^ 1, a, a ^ 3, a ^ 0xF0], dtype=np.uint64))
    groups = ["x", "y", "x", "x", "y", "z"]
    # Rows 2 and 3 (x) pass over row 0 (x) for row 1, the first row of another group.
    assert search(rows, groups, 2) == [None, 0, 1, 1, 0, None]
    assert search(rows, groups, 2) == brute_force(rows, groups, 2)
    assert search(rows, ["x"] * 6, 8) == [None] * 6
    # Row 2 shares its group with row 0, which is the best match for its value: it falls back
    # to row 1, the first row of its value of another group.
    rows = hexes(np.array([a ^ 1, a, a], dtype=np.uint64))
    assert search(rows, ["y", "x", "y"], 1) == [None, 0, 1]


@pytest.mark.parametrize("d", [1, 4])
def test_matches_brute_force_with_repeated_hashes_and_few_groups(d):
    # Values and groups cross each other: a value has rows of several groups, a group rows of
    # several values.
    rng = np.random.default_rng(d)
    pool, _ = planted(rng, 40, d)
    h = pool[rng.integers(0, len(pool), 300)]
    labels = [f"sha{x}" for x in rng.integers(0, 4, 300).tolist()]
    assert search(hexes(h), labels, d) == brute_force(hexes(h), labels, d)


@pytest.mark.parametrize("d", [0, 2, 4, 7])
def test_against_old_rows_matches_brute_force_and_the_concatenated_run(d):
    rng = np.random.default_rng(d)
    h, g = planted(rng, 400, d)
    n_old = 250
    got = near_duplicates_against(h[n_old:], g[n_old:], h[:n_old], g[:n_old], d)
    assert (
        got.tolist() == brute_force_against(h[n_old:], g[n_old:], h[:n_old], g[:n_old], d).tolist()
    )
    whole = near_duplicates(h, g, d)[n_old:]
    assert got.tolist() == np.where(whole < n_old, whole, -1).tolist()


@pytest.mark.parametrize("d", [0, 1, 2, 4, 6])
def test_few_new_rows_against_many_old_ones_match_brute_force(d):
    """Many old rows for few new ones: the old rows are first filtered by bitmaps of the new
    rows' table keys (`near_candidates`), and the answers stay exact, hot old buckets too."""
    rng = np.random.default_rng(100 + d)
    h, g = planted(rng, 6000, d)
    h[:400] = h[0]  # a hot bucket among the old rows: 400 copies of one value, own labels
    n_old = 5800
    new_h, new_g, old_h, old_g = h[n_old:], g[n_old:], h[:n_old], g[:n_old]
    keep = near_candidates(new_h, old_h, d)
    assert keep is not None and keep.mean() < 0.5  # the filter is on, and it filters
    want = brute_force_against(new_h, new_g, old_h, old_g, d)
    assert (want >= 0).sum() > 20
    assert keep[want[want >= 0]].all()  # it never drops a match
    got = near_duplicates_against(new_h, new_g, old_h, old_g, d)
    assert got.tolist() == want.tolist()


def test_old_rows_in_batches_give_the_same_answer():
    rng = np.random.default_rng(7)
    h, g = planted(rng, 500, 4)
    new_h, new_g, old_h, old_g = h[300:], g[300:], h[:300], g[:300]
    best = np.full(len(new_h), np.iinfo(np.int64).max)
    for lo, hi in [(0, 140), (140, 300)]:
        found = near_duplicates_against(new_h, new_g, old_h[lo:hi], old_g[lo:hi], 4)
        best = np.where(found >= 0, np.minimum(best, found + lo), best)
    best = np.where(best == np.iinfo(np.int64).max, -1, best)
    assert best.tolist() == near_duplicates_against(new_h, new_g, old_h, old_g, 4).tolist()


@pytest.mark.parametrize("k, free_blocks", [(1, 4), (2, 4)])
def test_a_shared_prefix_stays_exact_over_the_cap(k, free_blocks):
    # Every row shares the top blocks, so the table keyed on them has one big bucket, and the
    # planted pairs differ in every other block: only that table finds them. Re-indexing its
    # bucket on the free bits (pigeonhole again) keeps the answer exact.
    d = 4
    edges = [64 * i // (d + k) for i in range(d + k + 1)]
    free_bits = edges[free_blocks]
    rng = np.random.default_rng(k)
    n = 400
    h = rng.integers(0, 2**free_bits, n, dtype=np.uint64) | np.uint64(
        0xB3E9F7A5C1D20000 & ~((1 << free_bits) - 1)
    )
    blocks = list(zip(edges[:free_blocks], edges[1 : free_blocks + 1], strict=True))
    for t in range(1, n, 2):  # a bit flipped in each free block
        src = int(rng.integers(0, t))
        flips = sum(1 << int(rng.integers(lo, hi)) for lo, hi in blocks)
        h[t] = h[src] ^ np.uint64(flips)
    g = np.arange(n, dtype=np.uint64)
    want = [-1 if m is None else m for m in brute_force(hexes(h), [str(x) for x in g], d)]
    assert sum(m >= 0 for m in want) >= n // 2
    assert near_duplicates(h, g, d, hot_bucket_cap=16, blocks=(d + k, k)).tolist() == want
    old = near_duplicates_against(
        h[200:], g[200:], h[:200], g[:200], d, hot_bucket_cap=16, blocks=(d + k, k)
    )
    assert old.tolist() == brute_force_against(h[200:], g[200:], h[:200], g[:200], d).tolist()


def test_a_hot_bucket_is_capped_and_still_flags_rows_near_its_first_rows():
    rng = np.random.default_rng(3)
    n = 60_000
    blank = np.uint64(0xFFFF0000FFFF0000)
    h = rng.integers(0, 2**64, n, dtype=np.uint64)
    hot = rng.random(n) < 0.5  # a blank image and copies of it with up to 3 bits flipped
    hot[0] = True
    flips = np.zeros(n, dtype=np.uint64)
    for _ in range(3):
        bit = np.uint64(1) << rng.integers(0, 64, n, dtype=np.uint64)
        flips ^= np.where(rng.random(n) < 0.6, bit, np.uint64(0))
    h[hot] = blank ^ flips[hot]
    h[0] = blank
    g = np.arange(n, dtype=np.uint64)
    start = time.perf_counter()
    got = near_duplicates(h, g, 4)
    assert time.perf_counter() - start < 10  # quadratic would be hours
    # Identical to the bucket's first row: the exact-duplicate step, whatever the cap.
    same = np.flatnonzero(h == blank)[1:]
    assert len(same) > 1000 and (got[same] == 0).all()
    # Within the distance of the first row: found among the first rows of its buckets.
    near = np.flatnonzero(hot & (np.bitwise_count(h ^ blank) <= 3))[1:]
    assert (got[near] >= 0).all() and (got[near] < HOT_PEERS).mean() > 0.99
    # The same against old rows streamed in.
    old = near_duplicates_against(h[n // 2 :], g[n // 2 :], h[: n // 2], g[: n // 2], 4)
    assert (old[same[same >= n // 2] - n // 2] == 0).all()


def test_phash_to_uint64_round_trips():
    rng = np.random.default_rng(0)
    extremes = np.array([0, 2**64 - 1], dtype=np.uint64)
    h = np.concatenate([rng.integers(0, 2**64, 1000, dtype=np.uint64), extremes])
    assert (phash_to_uint64(hexes(h)) == h).all()
    assert (phash_to_uint64(pd.Series(hexes(h))) == h).all()
    assert phash_to_uint64(["00000000000000FF"]).tolist() == [255]
    assert phash_to_uint64([]).dtype == np.uint64


@pytest.mark.parametrize("bad", ["0123", "0123456789abcdef0", "0123456789abcdeg", "é" * 16])
def test_phash_to_uint64_rejects_anything_but_16_hex_digits(bad):
    with pytest.raises(ValueError, match="hex"):
        phash_to_uint64(["0123456789abcdef", bad])


def test_inputs_are_validated():
    h = np.zeros(3, dtype=np.uint64)
    with pytest.raises(ValueError, match="hashes"):
        near_duplicates(h.astype(np.int64), np.zeros(3, dtype=np.uint64), 4)
    with pytest.raises(ValueError, match="groups"):
        near_duplicates(h, np.zeros(2, dtype=np.uint64), 4)
    with pytest.raises(ValueError, match="max_distance"):
        near_duplicates(h, np.zeros(3, dtype=np.uint64), 64)
    with pytest.raises(ValueError, match="blocks"):
        near_duplicates(h, np.zeros(3, dtype=np.uint64), 4, blocks=(6, 3))
    with pytest.raises(ValueError, match="old_hashes"):
        near_duplicates_against(h, h, [1, 2], h[:2], 4)
    assert near_duplicates(h[:0], h[:0], 4).tolist() == []
    assert near_duplicates_against(h, h, h[:0], h[:0], 4).tolist() == [-1, -1, -1]
