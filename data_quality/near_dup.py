"""Near-duplicate search over 64-bit perceptual hashes in near-linear time.

Scheme: multi-index hashing with the generalised pigeonhole principle, as in Manku, Jain & Das
Sarma, "Detecting Near-Duplicates for Web Crawling" (WWW 2007), and Norouzi, Punjani & Fleet,
"Fast Search in Hamming Space with Multi-Index Hashing" (CVPR 2012), whose one-block-per-table
form is the `k = 1` case below.

- Split the 64 bits into `m = d + k` contiguous blocks. Two hashes within Hamming distance `d`
  differ in at most `d` blocks, so they agree exactly on at least `k` of them. A *table* is
  keyed on one choice of `k` blocks; with all `C(m, k)` tables, every pair within `d` shares a
  key in at least one table, so comparing only rows that share a key is exact.
- Larger `k` means longer keys (`64 k / m` bits) and so smaller buckets, at the price of more
  tables. With uniform hashes a bucket holds about `N / 2**(64 k / m)` rows, so a fixed `k`
  goes quadratic as `N` grows. `_choose_k` picks `k` from the row counts with a cost model
  (sorting per table against comparisons in buckets), which moves to a larger `k` as `N`
  grows and keeps the expected bucket size bounded: for `d = 4` it picks 5 tables of 12-13 bits
  up to tens of thousands of rows, 15 tables of 20-22 bits up to several million, and 35
  tables of 27-28 bits beyond.
- A table is one in-place sort of `key << b | id` (ids in priority order), so each bucket is a
  run of the sorted array with its rows in priority order. Candidate pairs are expanded in
  chunks of at most `_PAIR_CHUNK` and kept if their true distance is at most `d`.

Exact duplicates first: rows are collapsed to distinct hash values (`pandas.factorize`, in order
of first appearance), and the search runs over distinct values. Each value keeps two
representative rows: its first row, and its first row whose group differs from that first row's.
For any row, the earliest earlier row with another group among a value's rows is one of those
two, so a row's answer is the smallest representative of a value within `d` (its own value
included) whose group differs from its own. Each value keeps a running "best" and "best with a
group other than best's", which is enough to answer every row of it.

Hot buckets (the approximation): blank and placeholder images give a few key values that a large
share of rows hold. A row compares only with the first `HOT_BUCKET_CAP` rows of its bucket in
priority order, so the work is at most `N * HOT_BUCKET_CAP` per table whatever the skew. Results
are exact whenever no bucket is larger than the cap. In a bigger bucket a row that is within
`d` only of rows past the cap's first rows can be missed or matched to a later row than the
first. Such a bucket is almost always copies of one blank image: identical hashes are caught by
the exact-duplicate step, whatever the cap, and near-identical ones by the bucket's first rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import combinations
from math import comb

import numpy as np
import pandas as pd

__all__ = ["HOT_BUCKET_CAP", "near_duplicates", "near_duplicates_against", "phash_to_uint64"]

HOT_BUCKET_CAP = 1024  # rows of a bucket, in priority order, that each of its rows compares with
_PAIR_CHUNK = 1 << 20  # candidate pairs expanded and compared at once (bounds temporary memory)
_MAX_K = 4  # most blocks per table key
# Cost model of `_choose_k`, in units of one row sorted in one table.
_TABLE_OVERHEAD = 2000.0  # fixed cost of a table (numpy calls), in rows
_PAIR_COST = 0.3  # one candidate pair compared
_MIX = np.uint64(0x9E3779B97F4A7C15)  # odd (Fibonacci hashing): equal keys stay equal


def near_duplicates(
    hashes: np.ndarray,
    groups: np.ndarray,
    max_distance: int,
    *,
    hot_bucket_cap: int = HOT_BUCKET_CAP,
    blocks_per_key: int | None = None,
) -> np.ndarray:
    """For each row, the index of the first earlier row within `max_distance`, else -1.

    Args:
        hashes: uint64 pHashes, one per row, in priority order (earlier rows are kept).
        groups: an integer label per row; rows with the same label are exact duplicates, which
            another rule handles, so they are never reported as near-duplicates of each other.
        max_distance: largest Hamming distance that counts as a match, 0 to 63.
        hot_bucket_cap: rows of a bucket each row compares with (see the module docstring).
        blocks_per_key: `k`, the blocks in one table's key; None picks it from the row count.

    Returns:
        int64 array: the smallest index `i < j` with `popcount(hashes[i] ^ hashes[j]) <=
        max_distance` and `groups[i] != groups[j]`, or -1.
    """
    h, g = _check_rows(hashes, groups, "hashes", "groups")
    d, cap = _check_params(max_distance, hot_bucket_cap, blocks_per_key)
    n = len(h)
    codes, uniq = pd.factorize(h)
    first, second = _representatives(codes, g, len(uniq))
    best, other = first.copy(), second.copy()
    k = blocks_per_key or _choose_k(d, len(uniq), len(uniq), cap, self_join=True)
    for q, r in _near_pairs(uniq, None, d, k, cap):
        # Both directions: an earlier value can still be the answer for later rows of a value.
        target = np.concatenate([q, r, q, r])
        cand = np.concatenate([first[r], first[q], second[r], second[q]])
        _offer(best, other, target, cand, g)
    return _answer(best[codes], other[codes], g, g, upto=np.arange(n))


def near_duplicates_against(
    hashes: np.ndarray,
    groups: np.ndarray,
    old_hashes: np.ndarray,
    old_groups: np.ndarray,
    max_distance: int,
    *,
    hot_bucket_cap: int = HOT_BUCKET_CAP,
    blocks_per_key: int | None = None,
) -> np.ndarray:
    """For each new row, the index of the first old row within `max_distance`, else -1.

    Old rows all come before the new ones in priority order, so new rows are not matched with
    each other here (run `near_duplicates` on the new rows for that). The work is linear in the
    old rows and needs only the rows given, so old rows may come in batches: take the minimum
    over batches of each batch's answer plus its offset, ignoring -1.

    Args:
        hashes: uint64 pHashes of the new rows.
        groups: an integer label per new row (see `near_duplicates`).
        old_hashes: uint64 pHashes of the old rows, in priority order.
        old_groups: an integer label per old row, comparable with `groups`.
        max_distance: largest Hamming distance that counts as a match, 0 to 63.
        hot_bucket_cap: old rows of a bucket each new row compares with.
        blocks_per_key: `k`, the blocks in one table's key; None picks it from the row counts.

    Returns:
        int64 array, one per new row: the smallest old index `i` with `popcount(old_hashes[i] ^
        hashes[j]) <= max_distance` and `old_groups[i] != groups[j]`, or -1.
    """
    h, g = _check_rows(hashes, groups, "hashes", "groups")
    old_h, old_g = _check_rows(old_hashes, old_groups, "old_hashes", "old_groups")
    d, cap = _check_params(max_distance, hot_bucket_cap, blocks_per_key)
    if len(h) == 0 or len(old_h) == 0:
        return np.full(len(h), -1, dtype=np.int64)
    codes, uniq = pd.factorize(h)
    old_codes, old_uniq = pd.factorize(old_h)
    first, second = _representatives(old_codes, old_g, len(old_uniq))
    # A new value's own value may occur among the old rows: that is distance 0, found as a pair.
    none = np.full(len(uniq), len(old_h), dtype=np.int64)
    best, other = none, none.copy()
    k = blocks_per_key or _choose_k(d, len(uniq), len(old_uniq), cap, self_join=False)
    for q, r in _near_pairs(uniq, old_uniq, d, k, cap):
        target = np.concatenate([q, q])
        cand = np.concatenate([first[r], second[r]])
        _offer(best, other, target, cand, old_g)
    return _answer(best[codes], other[codes], old_g, g, upto=None)


def phash_to_uint64(hex_strings) -> np.ndarray:
    """Parse 16-hex-digit pHashes (a list, array or Series of str) into uint64, vectorised."""
    try:
        raw = np.asarray(hex_strings, dtype="S17")  # one byte more, to see overlong strings
    except (UnicodeEncodeError, TypeError, ValueError) as e:
        raise ValueError(f"hex_strings: expected 16-hex-digit strings ({e})") from e
    if raw.ndim != 1:
        raise ValueError(f"hex_strings: expected a 1-D sequence, got shape {raw.shape}")
    chars = raw.view(np.uint8).reshape(len(raw), 17)
    nibble = _HEX_VALUE[chars[:, :16]]
    bad = (nibble > 15).any(axis=1) | (chars[:, 16] != 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"hex_strings[{i}]: expected 16 hex digits, got {raw[i]!r}")
    packed = (nibble[:, 0::2] << 4) | nibble[:, 1::2]  # 8 bytes per row, most significant first
    return np.ascontiguousarray(packed).view(">u8").ravel().astype(np.uint64)


def _hex_table() -> np.ndarray:
    """ASCII byte -> hex digit value, 255 for anything that is not a hex digit."""
    table = np.full(256, 255, dtype=np.uint8)
    for i, c in enumerate("0123456789abcdef"):
        table[ord(c)] = table[ord(c.upper())] = i
    return table


_HEX_VALUE = _hex_table()


def _check_rows(hashes, groups, hashes_name: str, groups_name: str):
    if not isinstance(hashes, np.ndarray) or hashes.dtype != np.uint64 or hashes.ndim != 1:
        got = getattr(hashes, "dtype", type(hashes).__name__)
        raise ValueError(f"{hashes_name}: expected a 1-D uint64 numpy array, got {got}")
    groups = np.asarray(groups)
    if not np.issubdtype(groups.dtype, np.integer) or groups.shape != hashes.shape:
        raise ValueError(
            f"{groups_name}: expected integer labels of shape {hashes.shape}, "
            f"got {groups.dtype} of shape {groups.shape}"
        )
    if len(hashes) >= 1 << 40:
        raise ValueError(f"{hashes_name}: at most 2**40 rows, got {len(hashes)}")
    return hashes, groups


def _check_params(max_distance, hot_bucket_cap, blocks_per_key) -> tuple[int, int]:
    if isinstance(max_distance, bool) or not isinstance(max_distance, int | np.integer):
        raise ValueError(f"max_distance: expected an int, got {max_distance!r}")
    if not 0 <= max_distance <= 63:
        raise ValueError(f"max_distance: expected 0 to 63, got {max_distance}")
    if int(hot_bucket_cap) < 1:
        raise ValueError(f"hot_bucket_cap: expected at least 1, got {hot_bucket_cap}")
    if blocks_per_key is not None and not 1 <= blocks_per_key <= 64 - max_distance:
        raise ValueError(
            f"blocks_per_key: expected None or 1 to {64 - max_distance}, got {blocks_per_key}"
        )
    return int(max_distance), int(hot_bucket_cap)


def _representatives(codes: np.ndarray, groups: np.ndarray, n_values: int):
    """Per distinct value: its first row, and its first row of another group than that (or n)."""
    n = len(codes)
    rows = np.arange(n)
    first = np.full(n_values, n, dtype=np.int64)
    np.minimum.at(first, codes, rows)
    differs = np.flatnonzero(groups != groups[first[codes]])
    second = np.full(n_values, n, dtype=np.int64)
    np.minimum.at(second, codes[differs], differs)
    return first, second


def _offer(best, other, target, cand, groups) -> None:
    """Fold candidate rows into each target value's (best, best of another group than best).

    Order-independent, so repeated targets within one call are fine: `other` is rebuilt from
    the previous pair (the old best if the best changed group, else the old other) and then
    lowered by the new candidates whose group differs from the new best's.
    """
    keep = cand < len(groups)  # a value with one group has no second representative
    target, cand = target[keep], cand[keep]
    prev_best, prev_other = best[target], other[target]
    np.minimum.at(best, target, cand)
    new_best = best[target]
    new_group = groups[new_best]
    changed = groups.take(prev_best, mode="clip") != new_group
    other[target] = np.where(changed, prev_best, prev_other)
    ok = groups[cand] != new_group
    np.minimum.at(other, target[ok], cand[ok])


def _answer(best, other, ref_groups, groups, upto) -> np.ndarray:
    """Per row: `best` unless it shares the row's group (then `other`); -1 when none."""
    ans = np.where(ref_groups.take(best, mode="clip") != groups, best, other)
    limit = len(ref_groups) if upto is None else upto
    return np.where(ans < limit, ans, -1)


def _choose_k(d: int, n_query: int, n_ref: int, cap: int, *, self_join: bool) -> int:
    """Blocks per table key that minimise the modelled cost (see the module docstring)."""
    best_k, best_cost = 1, float("inf")
    for k in range(1, min(_MAX_K, 64 - d) + 1):
        tables = comb(d + k, k)
        pairs = n_query * n_ref / 2.0 ** (64 * k / (d + k)) / (2 if self_join else 1)
        pairs = min(pairs, n_query * cap)
        rows = n_query if self_join else n_query + n_ref
        cost = tables * (_TABLE_OVERHEAD + rows + _PAIR_COST * pairs)
        if cost < best_cost:
            best_k, best_cost = k, cost
    return best_k


def _table_masks(d: int, k: int) -> list[np.uint64]:
    """The bit mask of every choice of `k` of the `d + k` contiguous blocks."""
    m = d + k
    edges = [64 * i // m for i in range(m + 1)]
    blocks = [((1 << (hi - lo)) - 1) << lo for lo, hi in zip(edges, edges[1:], strict=False)]
    return [np.uint64(sum(c)) for c in combinations(blocks, k)]


def _near_pairs(
    values: np.ndarray, ref: np.ndarray | None, d: int, k: int, cap: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield chunks of (query id, ref id) pairs within distance `d`.

    Self join (`ref` None): pairs of distinct ids of `values`, the ref id being the earlier one
    in its bucket. Otherwise: pairs of a `values` id with a `ref` id. Pairs may repeat.
    """
    self_join = ref is None
    if self_join and d == 0:
        return  # distinct values are never within distance 0
    ref = values if self_join else ref
    bits = max(len(values), len(ref), 2) - 1
    id_bits = bits.bit_length() + (0 if self_join else 1)  # cross join: one bit for the side
    id_mask = (1 << id_bits) - 1
    if self_join:
        both, tag = values, np.arange(len(values), dtype=np.uint64)
    else:  # ref rows sort before query rows in a bucket
        both = np.concatenate([ref, values])
        side = np.uint64(1 << (id_bits - 1))
        tag = np.concatenate(
            [np.arange(len(ref), dtype=np.uint64), np.arange(len(values), dtype=np.uint64) | side]
        )
    high = np.uint64(~id_mask & ((1 << 64) - 1))
    buf = np.empty(len(both), dtype=np.uint64)
    for mask in _table_masks(d, k):
        np.bitwise_and(both, mask, out=buf)
        np.multiply(buf, _MIX, out=buf)
        buf &= high
        buf |= tag
        s = buf.view(np.int64)
        s.sort()
        key = s >> id_bits
        # Query positions: rows that are not first in their bucket.
        pos = np.flatnonzero(key[1:] == key[:-1]) + 1
        del key
        if len(pos) == 0:
            continue
        run = np.concatenate([[True], np.diff(pos) != 1])
        start = (pos[run] - 1)[np.cumsum(run) - 1]
        if self_join:
            count = np.minimum(pos - start, cap)
        else:
            is_query = ((s >> (id_bits - 1)) & 1).astype(bool)
            refs_before = np.concatenate([[0], np.cumsum(~is_query)])
            keep = is_query[pos]
            pos, start = pos[keep], start[keep]
            count = np.minimum(refs_before[pos] - refs_before[start], cap)
            keep = count > 0
            pos, start, count = pos[keep], start[keep], count[keep]
            if len(pos) == 0:
                continue
        yield from _compare(s, pos, start, count, values, ref, id_mask >> (not self_join), d)


def _compare(s, pos, start, count, values, ref, id_mask, d):
    """Compare each query position with its `count` partners from `start`, chunk by chunk."""
    total = np.cumsum(count)
    cuts = np.searchsorted(total, np.arange(_PAIR_CHUNK, total[-1], _PAIR_CHUNK), side="right")
    bounds = np.unique(np.concatenate([[0], cuts, [len(pos)]]))
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        c = count[lo:hi]
        n_pairs = int(c.sum())
        offset = np.cumsum(c) - c
        q = s[np.repeat(pos[lo:hi], c)] & id_mask
        r = s[np.repeat(start[lo:hi] - offset, c) + np.arange(n_pairs)] & id_mask
        near = np.bitwise_count(values[q] ^ ref[r]) <= d
        yield q[near], r[near]
