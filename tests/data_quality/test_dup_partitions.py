"""The partitioned duplicate search against the single-process one (`cross_catalog`) and
brute force: skewed and hot hashes, exact copies, several partitions and hash files."""

from __future__ import annotations

import numpy as np
import pytest

from data_quality.dup_partitions import (
    count_distinct,
    exact_duplicates,
    merge_hits,
    near_duplicates_in,
    near_tables,
    split_by_table,
    write_hash_file,
)
from data_quality.suite import cross_catalog
from kiln_config import QualityConfig


def corpus(rng, n: int, d: int, hot: bool):
    """(hi, lo, ph): random rows with exact copies (same sha256 and pHash), near copies
    (pHash within 0 to d + 1 bits, another sha256), a fifth sharing one 16-bit block, and,
    with `hot`, a blank image and many copies of it a few bits apart."""
    hi = rng.integers(0, 2**64, n, dtype=np.uint64)
    lo = rng.integers(0, 2**64, n, dtype=np.uint64)
    ph = rng.integers(0, 2**64, n, dtype=np.uint64)
    shared = rng.random(n) < 0.2
    ph[shared] = (ph[shared] & np.uint64(0xFFFFFFFFFFFF)) | np.uint64(0xABCD << 48)
    for t in rng.choice(np.arange(1, n), n // 3, replace=False):
        src = int(rng.integers(0, t))
        if rng.random() < 0.3:
            hi[t], lo[t], ph[t] = hi[src], lo[src], ph[src]
            continue
        flips = rng.choice(64, int(rng.integers(0, d + 2)), replace=False)
        ph[t] = ph[src] ^ np.uint64(sum(1 << int(b) for b in flips))
    if hot:
        blank = rng.random(n) < 0.3
        flips = np.zeros(n, dtype=np.uint64)
        for _ in range(2):
            bit = np.uint64(1) << rng.integers(0, 64, n, dtype=np.uint64)
            flips ^= np.where(rng.random(n) < 0.7, bit, np.uint64(0))
        ph[blank] = np.uint64(0xFFFF0000FFFF0000) ^ flips[blank]
    return hi, lo, ph


def partitioned(tmp_path, hashes, d: int, parts: int, cuts: list[int], first: int = 0):
    """The whole partitioned search, in one process: hash files cut at `cuts`, then each
    stage over every partition. Returns dense (duplicate_of, near_duplicate_of) from `first`."""
    n = len(hashes[0])
    files, bounds = [], [0, *cuts, n]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        path = tmp_path / f"h{i}.parquet"
        assert write_hash_file(path, tuple(h[a:b] for h in hashes), parts) == b - a
        files.append((str(path), a))
    dup = np.full(n - first, -1, np.int64)
    for k in range(parts):
        pos, of = exact_duplicates(files, k, first)
        dup[pos - first] = of
    design = near_tables(d, sum(count_distinct(files, k) for k in range(parts)))
    table_files = [[] for _ in design[2]]
    for path, offset in files:
        out = [f"{path}.table{i}" for i in range(len(design[2]))]
        split_by_table(path, out, design[2], parts)
        for i, o in enumerate(out):
            table_files[i].append((o, offset))
    got = [near_duplicates_in(table_files, k, d, design, first) for k in range(parts)]
    pos, of = merge_hits([g[0] for g in got], [g[1] for g in got])
    near = np.full(n - first, -1, np.int64)
    near[pos - first] = of
    return dup, near


@pytest.mark.parametrize(
    ("d", "parts", "hot"), [(4, 1, False), (4, 3, True), (2, 8, True), (0, 5, False), (6, 4, False)]
)
def test_partitions_give_the_single_process_answer(tmp_path, d, parts, hot):
    rng = np.random.default_rng(d * 10 + parts)
    hashes = corpus(rng, 6000, d, hot)
    want = cross_catalog(hashes, QualityConfig(near_duplicate_distance=d))
    dup, near = partitioned(tmp_path, hashes, d, parts, cuts=[1000, 1001, 4500])
    assert (want.duplicate_of >= 0).sum() > 500 and (want.near_duplicate_of >= 0).sum() > 300
    assert dup.tolist() == want.duplicate_of.tolist()
    assert near.tolist() == want.near_duplicate_of.tolist()


def test_new_rows_against_old_ones_match_brute_force(tmp_path):
    rng = np.random.default_rng(7)
    hi, lo, ph = corpus(rng, 3000, 4, hot=False)
    first = 2400
    dup, near = partitioned(tmp_path, (hi, lo, ph), 4, 4, cuts=[800, first], first=first)
    old = (h[:first] for h in (hi, lo, ph))
    want = cross_catalog(
        tuple(h[first:] for h in (hi, lo, ph)),
        QualityConfig(near_duplicate_distance=4),
        [tuple(old)],
        first,
    )
    assert dup.tolist() == want.duplicate_of.tolist()
    assert near.tolist() == want.near_duplicate_of.tolist()
    # Brute force: the first earlier row within 4 bits whose sha256 differs.
    dist = np.bitwise_count(ph[first:, None] ^ ph[None, :])
    ok = (dist <= 4) & (hi[first:, None] != hi[None, :])
    ok &= np.arange(len(ph))[None, :] < np.arange(first, len(ph))[:, None]
    assert near.tolist() == np.where(ok.any(axis=1), ok.argmax(axis=1), -1).tolist()


def test_an_empty_partition_and_bad_parts(tmp_path):
    path = tmp_path / "h.parquet"
    empty = tuple(np.zeros(0, np.uint64) for _ in range(3))
    assert write_hash_file(path, empty, 4) == 0
    pos, of = exact_duplicates([(str(path), 0)], 2)
    assert len(pos) == len(of) == 0 and count_distinct([(str(path), 0)], 1) == 0
    with pytest.raises(ValueError, match="parts: expected a positive int, got 0"):
        write_hash_file(path, empty, 0)


@pytest.mark.parametrize("hot", [False, True])
def test_old_rows_read_in_batches_on_threads_give_the_same_answer(hot):
    """Old rows as many batches (lazily read or in memory, gathered into groups for the
    search), their near candidates filtered by the new rows' table keys, searched on one
    thread or two: without hot buckets the answers of one batch (the search is exact), with
    them the same answers on either thread count."""
    rng = np.random.default_rng(11)
    hi, lo, ph = corpus(rng, 6000, 4, hot=hot)
    first = 5600
    rules = QualityConfig(near_duplicate_distance=4)
    new = tuple(h[first:] for h in (hi, lo, ph))
    cuts = [0, 700, 701, 1200, 2500, 3100, 4000, 4700, 5000, first]
    spans = list(zip(cuts, cuts[1:], strict=False))
    batches = [
        (lambda a=a, b=b: tuple(h[a:b] for h in (hi, lo, ph)))
        if i % 3
        else tuple(h[a:b] for h in (hi, lo, ph))
        for i, (a, b) in enumerate(spans)
    ]
    one, two = (cross_catalog(new, rules, batches, first, workers=w) for w in (1, 2))
    assert (one.near_duplicate_of >= 0).sum() > 20 and (one.duplicate_of >= 0).sum() > 5
    assert two.duplicate_of.tolist() == one.duplicate_of.tolist()
    assert two.near_duplicate_of.tolist() == one.near_duplicate_of.tolist()
    if not hot:
        want = cross_catalog(new, rules, [tuple(h[:first] for h in (hi, lo, ph))], first)
        assert one.duplicate_of.tolist() == want.duplicate_of.tolist()
        assert one.near_duplicate_of.tolist() == want.near_duplicate_of.tolist()


def test_exact_matches_of_a_batch_equal_a_brute_force_look_up():
    """The bitmap of the new rows' top bits only rules out old rows: old rows that share a
    new row's top bits (or its hi alone) but not its pair, and a batch of one label (old rows
    whose sha256 no new row has), are answered as a plain look-up answers them."""
    from data_quality.suite import _first_equal, _NewHi

    rng = np.random.default_rng(3)
    hi = rng.integers(0, 2**63, 500, dtype=np.int64).astype(np.uint64) << np.uint64(1)
    lo = rng.integers(0, 2**63, 500, dtype=np.int64).astype(np.uint64)
    ohi = rng.integers(0, 2**63, 4000, dtype=np.int64).astype(np.uint64)
    olo = rng.integers(0, 2**63, 4000, dtype=np.int64).astype(np.uint64)
    ohi[:300] = hi[:300] ^ np.uint64(1)  # the same top bits, another hi
    ohi[300:600], olo[300:600] = hi[:300], lo[:300] + np.uint64(1)  # the same hi, another lo
    ohi[[900, 1500, 2000]], olo[[900, 1500, 2000]] = hi[[7, 7, 9]], lo[[7, 7, 9]]
    got = _first_equal(hi, lo, _NewHi.of(hi), ohi, olo)
    old = {}
    for i, pair in enumerate(zip(ohi.tolist(), olo.tolist(), strict=True)):
        old.setdefault(pair, i)
    want = [old.get(pair, -1) for pair in zip(hi.tolist(), lo.tolist(), strict=True)]
    assert got.tolist() == want and sum(w >= 0 for w in want) == 2
    label = np.full(4000, 5, np.uint64)
    assert (_first_equal(hi, lo, _NewHi.of(hi), label, olo) == -1).all()
