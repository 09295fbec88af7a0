"""Near-duplicate search over 64-bit perceptual hashes in near-linear time.

Scheme: multi-index hashing with the generalised pigeonhole principle, as in Manku, Jain & Das
Sarma, "Detecting Near-Duplicates for Web Crawling" (WWW 2007); its one-block-per-table case is
Norouzi, Punjani & Fleet, "Fast Search in Hamming Space with Multi-Index Hashing" (CVPR 2012).

- Tables. Cut the 64 bits into `m > d` contiguous blocks. Two hashes within Hamming distance
  `d` differ in at most `d` blocks, so they agree exactly on at least `m - d` of them. A table
  is keyed on a set of `j <= m - d` blocks; if every set of `m - d` blocks contains one table's
  set, every pair within `d` shares a key in at least one table, and comparing only rows that
  share a key is exact. `m = d + 1, j = 1` is the plain pigeonhole; `j = m - d` needs all
  `C(m, j)` sets (Manku et al. use both); `j < m - d` needs fewer: a covering design (Turán
  system), which `_cover` finds greedily. For `d = 4`, 9 blocks and keys of 3 (21 bits) need 12
  tables, where 6 blocks and keys of 2 (21 bits too) need 15.
- Choice of `(m, j)`. A key has `64 j / m` bits, so with uniform hashes a bucket holds about
  `N / 2**(64 j / m)` rows: a fixed design goes quadratic as `N` grows. `_choose_blocks` models
  the cost (rows sorted per table against pairs compared in buckets) and takes longer keys as
  `N` grows, which keeps buckets at a few rows: for `d = 4` it picks 9 tables of 18-bit keys
  from 16k distinct hashes, 12 of 21 bits from 200k, 21 of 26 bits from 3.1M and 32 of 28 bits
  from 50M.
- A table sorts the rows by a 32-bit hash of their key (a collision only adds pairs to check)
  with two stable 16-bit radix passes, so it costs O(N) and each bucket is a run with its rows
  in priority order. Pairs are compared one offset into the buckets at a time. The rows are first
  split into cache-sized parts by a hash of the key's first block, one split shared by all the
  tables with that first block; a bucket lies in one part.
- Skewed buckets. A bucket of more than `HOT_BUCKET_CAP` rows (a shared prefix, say) is indexed
  again on the bits outside its key, cut into `d + 1` sub-blocks: two of its rows within `d`
  differ in at most `d` of those bits, so (pigeonhole again) they agree on a sub-block, and this
  step is exact too.
- Hot buckets, the one approximation. Rows of a sub-bucket still over the cap agree on almost
  every bit: copies of a blank or placeholder image with a few bits flipped. Each is compared
  only with the first `HOT_PEERS` rows of its table bucket (priority order) and keeps its first
  two matches there, so a table costs `O(N * HOT_BUCKET_CAP * d)` at worst, whatever the skew.
  Such a row can miss a match, or get a later one than the first, when its matches in that
  bucket are all past those first rows and no other table or sub-bucket finds them. Identical
  hashes are never missed (below). Results are exact whenever no sub-bucket is over the cap.

Few new rows against many old ones (`near_duplicates_against`, an incremental validate's
search of 10k new rows in a 10M-row catalog). An old row can only match if it shares a key
with a new row in one table of a covering design, so first each table's keys of the new rows
go into a bitmap (a 12- to 22-bit hash of the key: a collision only lets a row through), and
the old rows whose keys miss every bitmap are dropped before the search: a multiply, a shift
and a lookup per table and row, against a sort per table. `_filter_design` picks the design
with the fewest tables for the share of rows it lets through, and the filter stays off where
it would not pay (old rows under 4x the new, or distances where no design is selective).
`near_filter` builds the bitmaps once for a search whose old rows come in batches.
Measured at distance 4 with 10k new rows: 1M uniform old rows in 0.08 s instead of 0.58 s.

Why not faiss. faiss's binary indexes (`IndexBinaryMultiHash`, `IndexBinaryFlat`) give the same
exact answer and were measured against this module on the same rows (benchmarks/near_dup_faiss.py,
docs/benchmarks.md): 24-37x slower on uniform hashes at 0.1-1M rows in their best layout, and
over 100x on skewed ones, since a range search probes a hash map per flipped key and per query
and scans hot buckets whole. Hand-writing it is the measured choice.

Exact duplicates first: rows are collapsed to distinct hash values, and the search runs over
those, so any number of identical blank images costs one row. Each value keeps two
representative rows: its first row, and its first row whose group differs from that one's. The
earliest row of another group than a given row's, among a value's rows, is one of those two, so a
row's answer is the smallest representative, of a value within `d` (its own included), whose
group differs from its own. Each value keeps a running best and best of another group than the
best's, which answers every row of it.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from itertools import combinations, groupby
from math import comb

import numpy as np
import pandas as pd

__all__ = [
    "HOT_BUCKET_CAP",
    "HOT_PEERS",
    "near_duplicates",
    "NearFilter",
    "near_candidates",
    "near_duplicates_against",
    "near_filter",
    "phash_to_uint64",
]

HOT_BUCKET_CAP = 64  # rows above which a bucket is re-indexed, then a sub-bucket is hot
HOT_PEERS = 16  # first rows of its table bucket that a row of a hot sub-bucket is compared with
_PART_ROWS = 1 << 18  # rows a table handles at once (see `_partitions`)
_BATCH = 1 << 18  # pairs found before they are folded into the answers
_FEW = 1024  # positions below which `_compare` stops going offset by offset
_MAX_EXTRA = 8  # blocks beyond `d` that `_choose_blocks` tries
_MAX_COVER_WORK = 500_000  # largest covering problem `_cover` is given (its time)
# Cost model of `_choose_blocks`, in units of one row sorted in one table.
_TABLE_OVERHEAD = 1000.0  # fixed cost of a table (numpy calls), in rows
_PAIR_COST = 1.5  # one candidate pair compared (with its share of run bookkeeping)
_FILTER_BITS = (12, 22)  # table key widths `near_candidates` uses (bitmaps of 4 KB to 4 MB)
# Searching one old row, in units of one filter table's work on it: at distance 4 with 10k
# new rows, 1M uniform old rows took 0.58 s to search and 0.06 s to filter with 12 tables (a
# ratio near 115); 90 errs toward leaving the filter off.
_SEARCH_COST = 90.0
_MIX = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: the product's top bits mix all bits


def near_duplicates(
    hashes: np.ndarray,
    groups: np.ndarray,
    max_distance: int,
    *,
    hot_bucket_cap: int = HOT_BUCKET_CAP,
    blocks: tuple[int, int] | None = None,
) -> np.ndarray:
    """For each row, the index of the first earlier row within `max_distance`, else -1.

    Args:
        hashes: uint64 pHashes, one per row, in priority order (earlier rows are kept).
        groups: an integer label per row; rows with the same label are exact duplicates, which
            another rule handles, so they are never reported as near-duplicates of each other.
        max_distance: largest Hamming distance that counts as a match, 0 to 63.
        hot_bucket_cap: rows above which a bucket is re-indexed, then capped (module doc).
        blocks: `(m, j)`, cut the hashes into `m` blocks and key tables on `j` of them; None
            picks the cheapest for the row count (module doc).

    Returns:
        int64 array: for row `j`, the smallest `i < j` with `popcount(hashes[i] ^ hashes[j]) <=
        max_distance` and `groups[i] != groups[j]`, or -1.
    """
    h, g = _check_rows(hashes, groups, "hashes", "groups")
    d, cap = _check_params(max_distance, hot_bucket_cap, blocks)
    n = len(h)
    if n < 2:
        return np.full(n, -1, dtype=np.int64)
    return _near_within(h, g, d, cap, blocks)


def _near_within(h, g, d: int, cap: int, blocks=None, table=None) -> np.ndarray:
    """`near_duplicates` of at least two checked rows; `table` (a key mask) searches that one
    table only (the partitioned search runs one table per task)."""
    n = len(h)
    value_of, first = _distinct(h)
    second = _second(value_of, first, g)
    values = h if value_of is None else h[first]
    best, other = first.copy(), second.copy()
    m, j = blocks or _choose_blocks(d, len(first), 0)
    for target, source in _near_pairs(values, None, d, m, j, cap, table=table):
        cand = np.concatenate([first[source], second[source]])
        _offer(best, other, np.concatenate([target, target]), cand, g)
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
    blocks: tuple[int, int] | None = None,
    prefilter: bool = True,
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
        hot_bucket_cap: rows above which a bucket is re-indexed, then capped (module doc).
        blocks: `(m, j)`, cut the hashes into `m` blocks and key tables on `j` of them; None
            picks the cheapest for the row counts (module doc).
        prefilter: drop the old rows that `near_candidates` rules out first (False: the
            caller already did).

    Returns:
        int64 array, one per new row: the smallest old index `i` with `popcount(old_hashes[i] ^
        hashes[j]) <= max_distance` and `old_groups[i] != groups[j]`, or -1.
    """
    h, g = _check_rows(hashes, groups, "hashes", "groups")
    old_h, old_g = _check_rows(old_hashes, old_groups, "old_hashes", "old_groups")
    d, cap = _check_params(max_distance, hot_bucket_cap, blocks)
    if len(h) == 0 or len(old_h) == 0:
        return np.full(len(h), -1, dtype=np.int64)
    keep = near_candidates(h, old_h, d) if prefilter else None
    if keep is None:
        return _against(h, g, old_h, old_g, d, cap, blocks)
    # search only the old rows that share a table key with a new row
    at = np.flatnonzero(keep)
    if not len(at):
        return np.full(len(h), -1, dtype=np.int64)
    found = _against(h, g, old_h[at], old_g[at], d, cap, blocks)
    return np.where(found >= 0, at[np.maximum(found, 0)], -1)


def _against(h, g, old_h, old_g, d: int, cap: int, blocks) -> np.ndarray:
    """`near_duplicates_against` on checked, non-empty rows."""
    value_of, new_first = _distinct(h)
    old_value_of, first = _distinct(old_h)
    second = _second(old_value_of, first, old_g)
    # Best old row for each distinct new value; a new value equal to an old one is a pair too.
    best = np.full(len(new_first), len(old_h), dtype=np.int64)
    other = best.copy()
    m, j = blocks or _choose_blocks(d, len(new_first), len(first))
    for target, source in _near_pairs(h[new_first], old_h[first], d, m, j, cap):
        cand = np.concatenate([first[source], second[source]])
        _offer(best, other, np.concatenate([target, target]), cand, old_g)
    if value_of is not None:
        best, other = best[value_of], other[value_of]
    return _answer(best, other, old_g, g, upto=None)


def _filter_design(d: int, n_new: int) -> tuple[int, int, float] | None:
    """The `(m, j)` blocks of the cheapest bitmap filter for `n_new` distinct new values and
    the share of old rows it lets through, or None when no filter beats searching every old
    row. Costs in units of one table's filter work per old row; searching a row costs
    `_SEARCH_COST` of them."""
    best = None
    for m in range(d + 1, d + _MAX_EXTRA + 1):
        for j in range(1, m - d + 1):
            bits = 64 * j // m  # the narrowest table's key
            if not _FILTER_BITS[0] <= bits <= _FILTER_BITS[1]:
                continue
            if comb(m, j) * comb(m, m - d) > _MAX_COVER_WORK:
                continue
            tables = len(_cover(m, j, d))
            through = 1.0 - (1.0 - min(1.0, n_new / 2.0**bits)) ** tables
            cost = tables + _SEARCH_COST * through
            if cost < _SEARCH_COST * 0.7 and (best is None or cost < best[0]):
                best = (cost, m, j, through)
    return None if best is None else best[1:]


def near_candidates(
    hashes: np.ndarray, old_hashes: np.ndarray, max_distance: int
) -> np.ndarray | None:
    """A mask of the old rows that could lie within `max_distance` of a new row, or None where
    filtering costs more than it saves (many new rows, or few old ones): `near_filter`'s,
    for one set of old rows."""
    f = near_filter(hashes, max_distance, len(old_hashes))
    return None if f is None else f(old_hashes)


class NearFilter:
    """Bitmaps of the new rows' table keys, one per table of a covering design, built once:
    calling it with old hashes gives the mask of those that could lie within the distance of
    a new row (see `near_filter`). Read-only once built, so threads may share it."""

    def __init__(self, tables: list[tuple[np.uint64, int, np.ndarray]]) -> None:
        self.tables = tables  # (key mask, key bits, bitmap)

    def __call__(self, old_hashes: np.ndarray) -> np.ndarray:
        keep = np.zeros(len(old_hashes), dtype=bool)
        for mask, bits, seen in self.tables:
            keep |= seen[_key(old_hashes, mask, bits)]
        return keep


def near_filter(hashes: np.ndarray, max_distance: int, old_rows: int) -> NearFilter | None:
    """The filter of old rows for a search of `hashes` (the new rows) within `max_distance`
    against `old_rows` old ones, or None where filtering costs more than it saves (old rows
    under 4x the new, or no selective design at this distance and count).

    Two hashes within `d` agree on all blocks of at least one table of a covering design
    (`_cover`), so an old row whose key misses every table's set of new keys has no match.
    Each table's key (a hash of its blocks' bits) indexes a bitmap of the new rows' keys: a
    few vector operations per table and old row, far less than the search itself."""
    h, d = hashes, max_distance
    if old_rows < 4 * len(h):
        return None
    design = _filter_design(d, len(np.unique(h)))
    if design is None:
        return None
    m, j, _ = design
    edges = [64 * i // m for i in range(m + 1)]
    tables = []
    for chosen in _cover(m, j, d):
        mask = np.uint64(
            sum(
                ((1 << (edges[b + 1] - edges[b])) - 1) << edges[b]
                for b in range(m)
                if chosen >> b & 1
            )
        )
        bits = min(_FILTER_BITS[1], mask.bit_count())
        seen = np.zeros(1 << bits, dtype=bool)
        seen[_key(h, mask, bits)] = True
        tables.append((mask, bits, seen))
    return NearFilter(tables)


def _key(vals: np.ndarray, mask: np.uint64, bits: int) -> np.ndarray:
    """A `bits`-bit hash of `vals & mask`: equal masked values hash equal (all the filter
    needs), and different ones rarely collide."""
    key = np.bitwise_and(vals, mask)
    np.multiply(key, _MIX, out=key)
    key >>= np.uint64(64 - bits)
    return key.astype(np.intp)


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


def _check_params(max_distance, hot_bucket_cap, blocks) -> tuple[int, int]:
    if isinstance(max_distance, bool) or not isinstance(max_distance, int | np.integer):
        raise ValueError(f"max_distance: expected an int, got {max_distance!r}")
    if not 0 <= max_distance <= 63:
        raise ValueError(f"max_distance: expected 0 to 63, got {max_distance}")
    if int(hot_bucket_cap) < 1:
        raise ValueError(f"hot_bucket_cap: expected at least 1, got {hot_bucket_cap}")
    if blocks is not None:
        m, j = blocks
        if not (max_distance < m <= 64 and 1 <= j <= m - max_distance):
            raise ValueError(
                f"blocks: expected (m, j) with {max_distance} < m <= 64 and "
                f"1 <= j <= m - {max_distance}, got {blocks}"
            )
        if comb(m, j) * comb(m, m - max_distance) > _MAX_COVER_WORK:
            raise ValueError(f"blocks: {blocks} is too many block sets to choose tables from")
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


def _choose_blocks(d: int, n_query: int, n_ref: int) -> tuple[int, int]:
    """The `(m, j)` with the least modelled cost; `n_ref` 0 for a self join."""
    best, best_cost = (d + 1, 1), float("inf")
    for m in range(d + 1, min(64, d + _MAX_EXTRA) + 1):
        for j in range(1, m - d + 1):
            if comb(m, j) * comb(m, m - d) > _MAX_COVER_WORK:
                continue
            per_bucket = 2.0 ** (-64 * j / m)
            pairs = (
                n_query * n_query / 2 * per_bucket if n_ref == 0 else n_query * n_ref * per_bucket
            )
            rows = n_query + n_ref
            cost = len(_cover(m, j, d)) * (_TABLE_OVERHEAD + rows + _PAIR_COST * pairs)
            if cost < best_cost:
                best, best_cost = (m, j), cost
    return best


@cache
def _cover(m: int, j: int, d: int) -> tuple[int, ...]:
    """Sets of `j` of `m` blocks (bit masks) such that every set of `m - d` blocks contains
    one: a covering design, found greedily (all `j`-sets when `j = m - d`)."""
    need = [sum(1 << b for b in s) for s in combinations(range(m), m - d)]
    sets = [sum(1 << b for b in s) for s in combinations(range(m), j)]
    covers = [sum(1 << i for i, x in enumerate(need) if x & s == s) for s in sets]
    left, chosen = (1 << len(need)) - 1, []
    while left:
        i = max(range(len(sets)), key=lambda i: (covers[i] & left).bit_count())
        chosen.append(sets[i])
        left &= ~covers[i]
    return tuple(sorted(chosen, key=lambda s: (s & -s, s)))  # by first block


def _table_masks(d: int, m: int, j: int) -> Iterator[tuple[np.uint64, np.uint64, list[np.uint64]]]:
    """Each table's first block, its key mask, and the `d + 1` sub-block masks that cut the
    other bits for re-indexing its big buckets (none if there are too few bits). Tables come
    grouped by first block."""
    edges = [64 * i // m for i in range(m + 1)]
    blocks = [((1 << (hi - lo)) - 1) << lo for lo, hi in zip(edges, edges[1:], strict=False)]
    for chosen in _cover(m, j, d):
        picked = [blocks[b] for b in range(m) if chosen >> b & 1]
        mask = sum(picked)
        rest = [b for b in range(64) if not mask >> b & 1]
        subs = []
        if len(rest) >= d + 1:
            subs = [np.uint64(sum(1 << b for b in part)) for part in np.array_split(rest, d + 1)]
        yield np.uint64(picked[0]), np.uint64(mask), subs


def _near_pairs(
    values: np.ndarray,
    ref: np.ndarray | None,
    d: int,
    m: int,
    j: int,
    cap: int,
    table: np.uint64 | None = None,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield batches of (target id, source id) for pairs within distance `d`: the source's
    representatives are candidates for the target's rows. Self join (`ref` None): ids index
    `values`, and a pair goes both ways, as an earlier value can still be the answer for later
    rows of a value (hot rows only look back). Otherwise: targets index `values`, sources
    `ref`. Pairs may repeat. With `table` (a key mask), only that table
    (data_quality/dup_partitions.py runs each table on its own rows)."""
    self_join = ref is None
    if self_join and d == 0:
        return  # distinct values are never within distance 0
    n_ref = 0 if self_join else len(ref)
    both = values if self_join else np.concatenate([ref, values])  # refs sort first in a bucket
    targets, sources = [], []
    # Tables that share a first block share a split of the rows into parts (by that block).
    for first, group in groupby(_table_masks(d, m, j), key=lambda t: t[0]):
        group = [t for t in group if table is None or t[1] == table]
        if not group:
            continue
        for ids, vals in _partitions(both, first):
            for _, mask, subs in group:
                key = _hash32(vals, mask)
                for q, r, both_ways in _table_pairs(ids, vals, key, mask, subs, d, cap, n_ref):
                    targets.append(q - n_ref)
                    sources.append(r)
                    if both_ways and self_join:
                        targets.append(r)
                        sources.append(q)
                if sum(map(len, targets)) >= _BATCH:
                    yield np.concatenate(targets), np.concatenate(sources)
                    targets, sources = [], []
    if targets:
        yield np.concatenate(targets), np.concatenate(sources)


def _hash32(vals: np.ndarray, mask: np.uint64) -> np.ndarray:
    """A 32-bit hash of `vals & mask`: equal keys hash equal, different ones rarely do."""
    key = np.bitwise_and(vals, mask)
    np.multiply(key, _MIX, out=key)
    key >>= np.uint64(32)
    return key.astype(np.uint32)


def _stable_order(key: np.ndarray) -> np.ndarray:
    """Stable argsort of uint32 keys as two 16-bit passes (numpy radix-sorts 16-bit keys)."""
    order = np.argsort(key.astype(np.uint16), kind="stable")
    return order[np.argsort((key >> 16).astype(np.uint16)[order], kind="stable")]


def _partitions(both: np.ndarray, lead: np.uint64):
    """Yield (ids, values) of the rows, in id order, split by a hash of their `lead` block into
    parts of about `_PART_ROWS`. Rows that share a key share its lead block, so a bucket lies in
    one part; a part fits in cache, which keeps the sorts and lookups in it fast at any N."""
    bits = ((len(both) - 1) // _PART_ROWS).bit_length()
    if bits == 0:
        yield np.arange(len(both)), both
        return
    part = (_hash32(both, lead) >> (32 - bits)).astype(np.uint8 if bits <= 8 else np.uint16)
    order = np.argsort(part, kind="stable")
    ends = np.cumsum(np.bincount(part, minlength=1 << bits))
    del part
    vals = both[order]
    for lo, hi in zip(np.concatenate([[0], ends[:-1]]), ends, strict=True):
        yield order[lo:hi], vals[lo:hi]


def _table_pairs(ids, vals, key, mask, subs, d, cap, n_ref):
    """Yield (id, partner id, both_ways) pairs within `d` among rows (in id order) that share
    a key: all pairs in buckets of at most `cap` rows, then bigger buckets re-indexed on each
    sub-block, then hot rows against the first rows of their bucket (see the module doc)."""
    order = _stable_order(key)
    ids, vals = ids[order], vals[order]
    pos, start, count, size = _runs(ids, key[order], n_ref)
    small = size <= cap
    for q, r in _compare(ids, vals, pos[small], start[small], count[small], d):
        yield q, r, True
    big = np.flatnonzero(~small)
    if len(big) == 0:
        return
    # Re-index the rows of big buckets on the bits outside the key, a sub-block at a time.
    members = _members(start[big], size[big])
    members = members[np.argsort(ids[members], kind="stable")]  # id order, for ties
    m_ids, m_vals = ids[members], vals[members]
    hot = np.zeros(len(members), dtype=bool) if subs else np.ones(len(members), dtype=bool)
    for sub in subs:
        key2 = _hash32(m_vals, mask | sub)
        order2 = _stable_order(key2)
        ids2, vals2 = m_ids[order2], m_vals[order2]
        pos2, start2, count2, size2 = _runs(ids2, key2[order2], n_ref)
        small2 = size2 <= cap
        for q, r in _compare(ids2, vals2, pos2[small2], start2[small2], count2[small2], d):
            yield q, r, True
        hot[order2[_members(start2[~small2], size2[~small2])]] = True
    # Hot rows: the first rows of their table bucket, and the first two matches there.
    is_hot = np.zeros(len(ids), dtype=bool)
    is_hot[members[hot]] = True
    sel = big[is_hot[pos[big]]]
    for q, r in _compare(
        ids, vals, pos[sel], start[sel], np.minimum(count[sel], HOT_PEERS), d, first=2
    ):
        yield q, r, False


def _members(start: np.ndarray, size: np.ndarray) -> np.ndarray:
    """All positions of the runs given per position (`start`, `size`, repeats allowed)."""
    new = np.ones(len(start), dtype=bool)
    np.not_equal(start[1:], start[:-1], out=new[1:])
    start, size = start[new], size[new]
    offset = np.cumsum(size) - size
    return np.repeat(start - offset, size) + np.arange(int(size.sum()))


def _compare(ids, vals, pos, start, count, d, first=None):
    """Compare the row at each position in `pos` with the rows at the `count` positions from
    its `start`; yield the (id, partner id) pairs within `d`, or each position's first `first`.

    Buckets are small, so this goes one offset at a time for all positions at once, which needs
    no pair lists; the few positions left after some rounds get all their partners at once.
    """
    found = np.zeros(len(pos), dtype=np.int64)
    offset = 0
    while len(pos) > _FEW:
        partner = start + offset
        near = np.bitwise_count(vals[pos] ^ vals[partner]) <= d
        hit = np.flatnonzero(near)
        if len(hit):
            yield ids[pos[hit]], ids[partner[hit]]
        offset += 1
        keep = count > offset
        if first is not None:
            found += near
            keep &= found < first
        pos, start, count, found = pos[keep], start[keep], count[keep], found[keep]
    if len(pos) == 0:
        return
    left = count - offset
    at = np.repeat(np.arange(len(pos)), left)
    partner = np.repeat(start + offset - (np.cumsum(left) - left), left) + np.arange(len(at))
    hit = np.flatnonzero(np.bitwise_count(vals[pos[at]] ^ vals[partner]) <= d)
    at, partner = at[hit], partner[hit]
    if first is not None:  # rank of each match among its position's matches
        new = np.flatnonzero(np.concatenate([[True], at[1:] != at[:-1]]))
        rank = np.arange(len(at)) - np.repeat(new, np.diff(np.append(new, len(at))))
        keep = rank < first - found[at]
        at, partner = at[keep], partner[keep]
    yield ids[pos[at]], ids[partner]


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
