"""Near-duplicate search over 64-bit perceptual hashes, without comparing every pair.

Multi-index hashing: split each hash into `d + 1` bit blocks. Two hashes within Hamming
distance `d` differ in at most `d` bits, so (pigeonhole) they agree exactly on at least one
block. Only rows that share a block value are compared, which keeps the work near-linear for
real photo collections instead of quadratic.
"""

from __future__ import annotations

import numpy as np

__all__ = ["near_duplicates"]

_CHUNK = 2048  # rows compared at once inside one bucket (bounds memory for huge buckets)


def near_duplicates(hashes: list[str], groups: list[str], max_distance: int) -> list[int | None]:
    """For each row, the index of the first earlier row within `max_distance`, else None.

    Args:
        hashes: 16-hex-digit pHashes, in priority order (earlier rows are kept).
        groups: a label per row (the sha256); rows with the same label are exact duplicates,
            which another rule handles, so they are never reported as near-duplicates.
        max_distance: largest Hamming distance that counts as a match.
    """
    n = len(hashes)
    if n < 2:
        return [None] * n
    h = np.array([int(x, 16) for x in hashes], dtype=np.uint64)
    label = np.unique(np.asarray(groups), return_inverse=True)[1]
    best = np.full(n, n, dtype=np.int64)  # n means "no match"
    blocks = max_distance + 1
    edges = np.linspace(0, 64, blocks + 1).astype(int)
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        part = (h >> np.uint64(lo)) & np.uint64((1 << (hi - lo)) - 1)
        order = np.argsort(part, kind="stable")
        bounds = np.flatnonzero(np.diff(part[order])) + 1
        for idx in np.split(order, bounds):
            if len(idx) > 1:
                _match_bucket(np.sort(idx), h, label, max_distance, best)
    return [int(b) if b < n else None for b in best]


def _match_bucket(idx, h, label, d, best) -> None:
    # idx is sorted, so "earlier" is "smaller index".
    for start in range(0, len(idx), _CHUNK):
        cols = idx[start : start + _CHUNK]
        dist = np.bitwise_count(h[idx][:, None] ^ h[cols][None, :])
        ok = (dist <= d) & (idx[:, None] < cols[None, :])
        ok &= label[idx][:, None] != label[cols][None, :]
        hit = ok.any(axis=0)
        first = idx[np.argmax(ok, axis=0)]
        best[cols[hit]] = np.minimum(best[cols[hit]], first[hit])
