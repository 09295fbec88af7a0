"""Near-duplicate search over 64-bit perceptual hashes in near-linear time.

Scheme: multi-index hashing with the generalised pigeonhole principle, as in Manku, Jain & Das
Sarma, "Detecting Near-Duplicates for Web Crawling" (WWW 2007); its one-block-per-table case is
Norouzi, Punjani & Fleet, "Fast Search in Hamming Space with Multi-Index Hashing" (CVPR 2012).

- Tables. Split the 64 bits into `m = d + k` contiguous blocks. Two hashes within Hamming
  distance `d` differ in at most `d` blocks, so they agree exactly on at least `k`. A table is
  keyed on one choice of `k` blocks, and there are `C(m, k)` tables, so every pair within `d`
  shares a key in at least one table: comparing only rows that share a key is exact.
- Choice of `k`. A key has `64 k / m` bits, so with uniform hashes a bucket holds about
  `N / 2**(64 k / m)` rows: a fixed `k` goes quadratic as `N` grows. `_choose_k` models the cost
  (a sort per table against the comparisons in its buckets) and moves to a larger `k` as `N`
  grows, which keeps buckets small: for `d = 4` it picks 5 tables of 12-13 bit keys up to about
  50k distinct hashes, 15 tables of 20-22 bits up to about 25M, then 35 tables of 27-28 bits.
- A table is one in-place sort of `hash(key) | id`, ids in priority order, so a bucket is a run
  of the sorted array with its rows in priority order; pairs are compared in chunks.
- Skewed buckets. A bucket of more than `HOT_BUCKET_CAP` rows (a shared prefix, say) is indexed
  again on the bits outside its key, cut into `d + 1` sub-blocks: two of its rows within `d`
  differ in at most `d` of those bits, so (pigeonhole again) they agree on a sub-block, and this
  step is exact too.
- Hot buckets, the one approximation. Rows of a sub-bucket still over the cap are rows that agree
  on almost every bit: copies of a blank or placeholder image. Each of them is compared only with
  the first `HOT_BUCKET_CAP` rows of its table bucket (priority order) and takes the first two
  matches there, so a table costs at most `O(N * HOT_BUCKET_CAP * d)` whatever the skew. Such a
  row can miss a match, or get a later match than the first, when its matches in that bucket are
  all past its first rows and no other table or sub-bucket finds them; identical hashes are
  never missed (see below). Results are exact whenever no sub-bucket is over the cap.

Exact duplicates first: rows are collapsed to distinct hash values, and the search runs over
those. Each value keeps two representative rows: its first row, and its first row whose group
differs from that first row's. For any row, the earliest row with another group among a value's
rows is one of those two, so a row's answer is the smallest representative, of a value within `d`
(its own value included), whose group differs from its own. A value keeps a running best and best
of another group than the best's, which answers every row of it.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import combinations
from math import comb

import numpy as np
import pandas as pd

__all__ = ["HOT_BUCKET_CAP", "near_duplicates", "near_duplicates_against", "phash_to_uint64"]

HOT_BUCKET_CAP = 64  # bucket size above which a bucket is re-indexed, then capped (see above)
_PAIR_CHUNK = 1 << 19  # candidate pairs compared at once (bounds temporary memory)
_MAX_K = 4  # most blocks in one table key
# Cost model of `_choose_k`, in units of one row sorted in one table.
_TABLE_OVERHEAD = 5000.0  # fixed cost of a table (numpy calls), in rows
_PAIR_COST = 0.4  # one candidate pair compared
_MIX = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: the product's top bits mix all bits


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
        hot_bucket_cap: bucket size above which buckets are re-indexed, then capped.
        blocks_per_key: `k`, the blocks in one table's key; None picks it from the row count.

    Returns:
        int64 array: for row `j`, the smallest `i < j` with `popcount(hashes[i] ^ hashes[j]) <=
        max_distance` and `groups[i] != groups[j]`, or -1.
    """
    h, g = _check_rows(hashes, groups, "hashes", "groups")
    d, cap = _check_params(max_distance, hot_bucket_cap, blocks_per_key)
    n = len(h)
    value_of, first = _distinct(h)
    second = _second(value_of, first, g)
    values = h[first]
    best, other = first.copy(), second.copy()
    k = blocks_per_key or _choose_k(d, len(first), 0)
    for q, r, both_ways in _near_pairs(values, None, d, k, cap):
        if both_ways:  # an earlier value can still be the answer for later rows of a value
            q, r = np.concatenate([q, r]), np.concatenate([r, q])
        _offer(best, other, np.concatenate([q, q]), np.concatenate([first[r], second[r]]), g)
    if value_of is not None:
        best, other = best[value_of], other[value_of]
    return _answer(best, other, g, g, upto=np.arange(n))


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

    Old rows all come before the new ones in priority order, and new rows are not matched with
    each other here (`near_duplicates` on the new rows does that). The work is linear in the old
    rows and needs only the rows given, so old rows may come in batches: the answer is the
    minimum over batches of each batch's answer plus its offset, ignoring -1.

    Args:
        hashes: uint64 pHashes of the new rows.
        groups: an integer label per new row (see `near_duplicates`).
        old_hashes: uint64 pHashes of the old rows, in priority order.
        old_groups: an integer label per old row, comparable with `groups`.
        max_distance: largest Hamming distance that counts as a match, 0 to 63.
        hot_bucket_cap: bucket size above which buckets are re-indexed, then capped.
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
    value_of, new_first = _distinct(h)
    old_value_of, first = _distinct(old_h)
    second = _second(old_value_of, first, old_g)
    # Best old row for each distinct new value; a new value equal to an old one is a pair too.
    best = np.full(len(new_first), len(old_h), dtype=np.int64)
    other = best.copy()
    k = blocks_per_key or _choose_k(d, len(new_first), len(first))
    for q, r, _ in _near_pairs(h[new_first], old_h[first], d, k, cap):
        _offer(best, other, np.concatenate([q, q]), np.concatenate([first[r], second[r]]), old_g)
    if value_of is not None:
        best, other = best[value_of], other[value_of]
    return _answer(best, other, old_g, g, upto=None)


def phash_to_uint64(hex_strings) -> np.ndarray:
    """Parse 16-hex-digit pHashes (a list, array or Series of str) into uint64, vectorised."""
    try:
        raw = np.asarray(hex_strings, dtype="S17")  # one byte more, to catch overlong strings
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
    packed = (nibble[:, 0::2] << 4) | nibble[:, 1::2]  # 8 bytes a row, most significant first
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


def _distinct(h: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
    """The first row of each distinct value (ascending), and each row's value as an index into
    those (None when all values are distinct, the common case, which then costs one sort)."""
    s = np.sort(h)
    repeated = s[1:][s[1:] == s[:-1]]
    if len(repeated) == 0:
        return None, np.arange(len(h))
    repeated = repeated[np.concatenate([[True], repeated[1:] != repeated[:-1]])]
    code = pd.Index(repeated).get_indexer(h)  # index among repeated values, -1 for the rest
    rows = np.flatnonzero(code >= 0)
    code = code[rows]
    first_of = np.full(len(repeated), len(h), dtype=np.int64)
    np.minimum.at(first_of, code, rows)
    is_first = np.ones(len(h), dtype=bool)
    is_first[rows] = first_of[code] == rows
    value_of = np.cumsum(is_first) - 1
    value_of[rows] = value_of[first_of[code]]
    return value_of, np.flatnonzero(is_first)


def _second(value_of, first, groups) -> np.ndarray:
    """Per distinct value, its first row whose group differs from its first row's, else n."""
    n = len(groups)
    second = np.full(len(first), n, dtype=np.int64)
    if value_of is not None:
        rows = np.flatnonzero(groups != groups[first[value_of]])
        np.minimum.at(second, value_of[rows], rows)
    return second


def _offer(best, other, target, cand, groups) -> None:
    """Fold candidate rows into each target value's (best, best of another group than best).

    Order-independent, so repeated targets within one call are fine: `other` is rebuilt from
    the previous pair (the old best if the best changed group, else the old other), then lowered
    by the new candidates whose group differs from the new best's.
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


def _choose_k(d: int, n_query: int, n_ref: int) -> int:
    """Blocks per table key that minimise the modelled cost; `n_ref` 0 for a self join."""
    best_k, best_cost = 1, float("inf")
    for k in range(1, min(_MAX_K, 64 - d) + 1):
        per_bucket = 2.0 ** (-64 * k / (d + k))
        pairs = n_query * n_query / 2 * per_bucket if n_ref == 0 else n_query * n_ref * per_bucket
        cost = comb(d + k, k) * (_TABLE_OVERHEAD + n_query + n_ref + _PAIR_COST * pairs)
        if cost < best_cost:
            best_k, best_cost = k, cost
    return best_k


def _table_masks(d: int, k: int) -> Iterator[tuple[np.uint64, list[np.uint64]]]:
    """Each table's key mask (`k` of `d + k` contiguous blocks), with the `d + 1` sub-block
    masks that cut the other bits for re-indexing its big buckets (none if too few bits)."""
    m = d + k
    edges = [64 * i // m for i in range(m + 1)]
    blocks = [((1 << (hi - lo)) - 1) << lo for lo, hi in zip(edges, edges[1:], strict=False)]
    for chosen in combinations(blocks, k):
        mask = sum(chosen)
        rest = [b for b in range(64) if not mask >> b & 1]
        subs = []
        if len(rest) >= d + 1:
            subs = [np.uint64(sum(1 << b for b in part)) for part in np.array_split(rest, d + 1)]
        yield np.uint64(mask), subs


def _near_pairs(
    values: np.ndarray, ref: np.ndarray | None, d: int, k: int, cap: int
) -> Iterator[tuple[np.ndarray, np.ndarray, bool]]:
    """Yield chunks of (query id, ref id, both_ways) for pairs within distance `d`.

    Self join (`ref` None): ids index `values`, the ref id is the earlier row of the pair, and
    both_ways says the pair also counts the other way round (it is False for hot rows, which
    only look back). Otherwise: a `values` id and a `ref` id. Pairs may repeat.
    """
    self_join = ref is None
    if self_join and d == 0:
        return  # distinct values are never within distance 0
    n_ref = 0 if self_join else len(ref)
    both = values if self_join else np.concatenate([ref, values])  # refs sort first in a bucket
    all_ids = np.arange(len(both))
    for mask, subs in _table_masks(d, k):
        ids, key = _bucket_sort(both, all_ids, mask)
        pos, start, count, size = _runs(ids, key, n_ref)
        del key
        small = size <= cap
        for q, r in _compare(ids, pos[small], start[small], count[small], both, d):
            yield q - n_ref, r, True
        big = np.flatnonzero(~small)
        if len(big) == 0:
            continue
        # Re-index the rows of big buckets on the bits outside the key, a sub-block at a time.
        members = np.sort(ids[_members(start[big], size[big])])
        hot = np.zeros(len(both), dtype=bool)
        hot[members] = not subs
        for sub in subs:
            ids2, key2 = _bucket_sort(both, members, mask | sub)
            pos2, start2, count2, size2 = _runs(ids2, key2, n_ref)
            small2 = size2 <= cap
            for q, r in _compare(ids2, pos2[small2], start2[small2], count2[small2], both, d):
                yield q - n_ref, r, True
            hot[ids2[_members(start2[~small2], size2[~small2])]] = True
        # Hot rows: the first `cap` rows of their table bucket, and the first two matches there.
        sel = big[hot[ids[pos[big]]]]
        count = np.minimum(count[sel], cap)
        for q, r in _compare(ids, pos[sel], start[sel], count, both, d, first=2):
            yield q - n_ref, r, False


def _bucket_sort(both: np.ndarray, ids: np.ndarray, mask: np.uint64):
    """`ids` (ascending) ordered by a 32-bit hash of `both[ids] & mask`, ties kept in order,
    and the sorted hashes. Two stable 16-bit passes (numpy radix-sorts 16-bit keys): linear,
    and faster than a comparison sort of packed 64-bit words."""
    key = np.bitwise_and(both if len(ids) == len(both) else both[ids], mask)
    np.multiply(key, _MIX, out=key)
    key >>= np.uint64(32)
    key = key.astype(np.uint32)
    order = np.argsort(key.astype(np.uint16), kind="stable")
    order = order[np.argsort((key >> 16).astype(np.uint16)[order], kind="stable")]
    return ids[order], key[order]


def _members(start: np.ndarray, size: np.ndarray) -> np.ndarray:
    """All positions of the runs given per position (`start`, `size`, repeats allowed)."""
    new = np.ones(len(start), dtype=bool)
    np.not_equal(start[1:], start[:-1], out=new[1:])
    start, size = start[new], size[new]
    offset = np.cumsum(size) - size
    return np.repeat(start - offset, size) + np.arange(int(size.sum()))


def _compare(ids, pos, start, count, both, d, first=None):
    """Compare the row at each position of `ids` with the rows at the `count` positions from
    `start`, a chunk at a time; yield the (id, partner id) pairs within `d`, or only the first
    `first` such pairs of each position."""
    if len(pos) == 0:
        return
    total = np.cumsum(count)
    cuts = np.searchsorted(total, np.arange(_PAIR_CHUNK, total[-1], _PAIR_CHUNK), side="right")
    bounds = np.unique(np.concatenate([[0], cuts, [len(pos)]]))
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        c = count[lo:hi]
        offset = np.cumsum(c) - c
        at = np.repeat(pos[lo:hi], c)
        q = ids[at]
        r = ids[np.repeat(start[lo:hi] - offset, c) + np.arange(int(c.sum()))]
        near = np.flatnonzero(np.bitwise_count(both[q] ^ both[r]) <= d)
        if first is not None and len(near):
            at = at[near]
            new = np.flatnonzero(np.concatenate([[True], at[1:] != at[:-1]]))
            rank = np.arange(len(at)) - np.repeat(new, np.diff(np.append(new, len(at))))
            near = near[rank < first]
        yield q[near], r[near]


def _runs(ids, key, n_ref):
    """For each position of the sorted `key` with rows to compare with: its run's (bucket's)
    start, how many rows from the start to compare with, and the run's size. Self join
    (`n_ref` 0): all earlier rows of the run. Otherwise queries (ids >= n_ref) get its refs."""
    pos = np.flatnonzero(key[1:] == key[:-1]) + 1  # not first in their run
    brk = np.empty(len(pos), dtype=bool)
    brk[:1] = True
    np.not_equal(pos[1:], pos[:-1] + 1, out=brk[1:])
    run_of = np.cumsum(brk) - 1
    run_start = pos[brk] - 1
    run_last = np.append(pos[np.flatnonzero(brk)[1:] - 1], pos[-1:])
    start = run_start[run_of]
    size = (run_last - run_start + 1)[run_of]
    if n_ref == 0:
        return pos, start, pos - start, size
    is_ref = ids[pos] < n_ref
    refs = np.add.reduceat(is_ref, np.flatnonzero(brk)) if len(pos) else is_ref
    refs = refs + (ids[run_start] < n_ref)
    count = np.where(is_ref, 0, refs[run_of])
    keep = count > 0
    return pos[keep], start[keep], count[keep], size[keep]
