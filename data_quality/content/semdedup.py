"""SemDeDup (Abbas et al., 2023) on normalised CLIP image embeddings: k-means (faiss), then
cosine similarity between the members of each cluster.

A row is a semantic duplicate of the first earlier row of its cluster whose embedding has at
least `similarity` cosine with its own; rows come in the catalog's priority order (earliest
ingest first), so of each group of near-copies the earliest ingested is kept, as for exact and
pHash duplicates, and a later ingest never changes an earlier verdict. (SemDeDup's paper keeps
the member farthest from the centroid; Kiln keeps the earliest so that verdicts are stable as
a catalog grows.) A pair that k-means splits between two clusters is not found: SemDeDup's
trade for comparing within clusters only.

Incremental: `fit_centroids` runs once, on the first catalog it sees (or when the row count
has grown past `refit_growth` times the fit's); later runs assign their new rows to those
centroids and compare each only with the earlier members of its cluster (`duplicates`), so
the work per run follows the new rows. Each cluster is one task (`cluster_duplicates`): the
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
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The semantic duplicates among one cluster's members: `embeddings` in priority order,
    at catalog `positions`; only members at positions >= `first_new` are judged (the others
    were judged before). Members with the same `keys` (content hashes: exact copies, which the
    exact-duplicate rule names) never match each other. Returns (positions judged duplicate,
    the position of the first earlier member each matches, the cosine), a block of rows at a
    time."""
    x = np.ascontiguousarray(embeddings, np.float32)
    new = np.flatnonzero(positions >= first_new)
    hit, of, cos = [], [], []
    for s in range(0, len(new), 1024):
        q = new[s : s + 1024]
        sims = x[q] @ x[: q[-1]].T if q[-1] else np.zeros((len(q), 0), np.float32)
        # only earlier members count: mask each row's own and later columns
        cols = np.arange(sims.shape[1])
        ok = (sims >= similarity) & (cols[None, :] < q[:, None])
        if keys is not None:
            ok &= keys[: sims.shape[1]][None, :] != keys[q][:, None]
        any_ = ok.any(axis=1)
        first = ok.argmax(axis=1)
        rows = np.flatnonzero(any_)
        hit.append(positions[q[rows]])
        of.append(positions[first[rows]])
        cos.append(sims[rows, first[rows]])
    if not hit:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32)
    return np.concatenate(hit), np.concatenate(of), np.concatenate(cos).astype(np.float32)
