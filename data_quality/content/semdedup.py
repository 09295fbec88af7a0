"""SemDeDup (Abbas et al., 2023) on normalised CLIP image embeddings: k-means (faiss), then
cosine similarity between the members of each cluster.

A row is a semantic duplicate of the first earlier row of its cluster whose embedding has at
least `similarity` cosine with its own; rows come in the catalog's priority order (earliest
ingest first), so of each group of near-copies the earliest ingested is kept, as for exact and
pHash duplicates, and a later ingest never changes an earlier verdict. (SemDeDup's paper keeps
the member farthest from the centroid; Kiln keeps the earliest so that verdicts are stable as
a catalog grows.) A pair that k-means splits between two clusters is not found: SemDeDup's
trade for comparing within clusters only.

Incremental: `fit_centroids` runs once, on the first catalog it sees (tasks/quality/content.py
keeps the centroids, and fits again when a full validate finds the view grown fourfold);
later runs assign their rows to those centroids and compare each new row only with the
earlier members of its cluster (`cluster_duplicates`), so the search per run follows the new
rows. Each cluster is one task (`cluster_duplicates`): the
driver holds the cluster ids, and a worker holds one cluster's embeddings at a time.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["assign", "cluster_duplicates", "default_clusters", "fit_centroids"]

SAMPLE_PER_CLUSTER = 256  # faiss trains k-means on up to this many points per centroid


def default_clusters(rows: int) -> int:
    """About sqrt(rows / 4) clusters: a few thousand rows per cluster at a hundred million."""
    return max(1, round(math.sqrt(rows / 4)))


def fit_centroids(embeddings: np.ndarray, k: int, seed: int = 0) -> np.ndarray:
    """k-means centroids (spherical: normalised) of `embeddings`, on a sample of at most
    `SAMPLE_PER_CLUSTER * k` rows."""
    import faiss

    x = np.ascontiguousarray(embeddings, np.float32)
    k = max(1, min(k, len(x)))
    if k == 1:
        c = x.mean(axis=0, keepdims=True)
        return c / np.maximum(np.linalg.norm(c, axis=1, keepdims=True), 1e-12)
    km = faiss.Kmeans(
        x.shape[1],
        k,
        niter=20,
        seed=seed,
        spherical=True,
        max_points_per_centroid=SAMPLE_PER_CLUSTER,
        verbose=False,
    )
    km.train(x)
    return np.asarray(km.centroids, np.float32)


def assign(embeddings: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """The nearest centroid (highest inner product) of each embedding."""
    import faiss

    index = faiss.IndexFlatIP(centroids.shape[1])
    index.add(np.ascontiguousarray(centroids, np.float32))
    _, at = index.search(np.ascontiguousarray(embeddings, np.float32), 1)
    return at[:, 0].astype(np.int64)


def cluster_duplicates(
    embeddings: np.ndarray,
    positions: np.ndarray,
    first_new: int,
    similarity: float,
    keys: np.ndarray | None = None,
    eligible: np.ndarray | None = None,
    block: int = 4096,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The semantic duplicates among one cluster's members: `embeddings` in priority order,
    at catalog `positions`; only members at positions >= `first_new` are judged (the others
    were judged before). A member matches an earlier one whose cosine reaches `similarity`,
    except one with the same `keys` (content hash: an exact copy, which the exact-duplicate
    rule names) and one that is not `eligible` (rejected by another rule: a near-copy of a
    rejected image is not its duplicate). Returns (positions judged duplicate, the position of
    the first earlier member each matches, the cosine), `block` x `block` similarities at a
    time, so memory does not grow with the cluster."""
    x = np.ascontiguousarray(embeddings, np.float32)
    n = len(x)
    keys = np.arange(n) if keys is None else np.asarray(keys)
    eligible = np.ones(n, bool) if eligible is None else np.asarray(eligible, bool)
    new = np.flatnonzero(positions >= first_new)
    hit, of, cos = [], [], []
    for s in range(0, len(new), block):
        q = new[s : s + block]
        first = np.full(len(q), -1, np.int64)
        best = np.zeros(len(q), np.float32)
        for c in range(0, int(q[-1]), block):
            cols = np.arange(c, min(c + block, int(q[-1])))
            open_ = first < 0
            if not open_.any():
                break
            sims = x[q[open_]] @ x[cols].T
            ok = (sims >= similarity) & (cols[None, :] < q[open_][:, None])
            ok &= keys[cols][None, :] != keys[q[open_]][:, None]
            ok &= eligible[cols][None, :]
            found = ok.any(axis=1)
            at = ok.argmax(axis=1)
            rows = np.flatnonzero(open_)[found]
            first[rows] = cols[at[found]]
            best[rows] = sims[found, at[found]]
        done = first >= 0
        hit.append(positions[q[done]])
        of.append(positions[first[done]])
        cos.append(best[done])
    if not hit:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32)
    return np.concatenate(hit), np.concatenate(of), np.concatenate(cos).astype(np.float32)
