"""Near-duplicate search: Kiln's multi-index hashing (`data_quality/near_dup.py`) against
faiss's binary indexes, on the same pHashes, for the answer validate needs.

The answer: for each row, the first earlier row within Hamming distance `d` whose group (exact
duplicate class) differs, else -1 (`near_duplicates`). Both sides get the same rows, already
in priority order, and are timed from the hashes to that answer:

* `kiln`: `near_duplicates(hashes, groups, d)`;
* `faiss_multihash`: exact copies collapsed to distinct values (as Kiln does), an
  `IndexBinaryMultiHash` over them (`nhash` tables of `b` bits, `nflip` bit flips probed per
  table, chosen so that every pair within `d` shares a probed key: exact), a `range_search` of
  every value against all (faiss's radius is strict, so `d + 1`), then the pairs folded into
  the earliest other-group row with numpy;
* `faiss_flat`: the same over `IndexBinaryFlat` (brute force, SIMD popcount), at the sizes
  where it finishes.

Data: `uniform` pHashes, and `skewed` ones as benchmarks/catalog_scale.py makes them (5% of rows
within one bit of one of three placeholder hashes, 20% sharing one 16-bit block). Every faiss
answer is checked equal to Kiln's.

    # faiss-cpu is a dependency of Kiln for SemDeDup's k-means (data_quality/content/semdedup.py)
    python benchmarks/near_dup_faiss.py --out benchmarks/results/near_dup_faiss.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_quality.near_dup import near_duplicates  # noqa: E402

HOT = np.array([0x0, 0xFFFFFFFFFFFFFFFF, 0x5555555555555555], dtype=np.uint64)


def synth(n: int, kind: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """n pHashes (uint64) and group labels; 1% of rows exact copies of earlier rows."""
    rng = np.random.default_rng(seed)
    ph = rng.integers(0, 2**63, n, dtype=np.int64).astype(np.uint64) << np.uint64(1)
    if kind == "skewed":
        hot = rng.random(n)
        near = hot < 0.05
        flips = np.uint64(1) << rng.integers(0, 64, n).astype(np.uint64)
        ph[near] = HOT[rng.integers(0, 3, near.sum())] ^ flips[near]
        block = (hot >= 0.05) & (hot < 0.25)
        ph[block] = (ph[block] & ~np.uint64(0xFFFF)) | np.uint64(0x1234)
    groups = np.arange(n, dtype=np.int64)
    dup = np.flatnonzero(rng.random(n) < 0.01)
    dup = dup[dup > 0]
    src = (rng.random(len(dup)) * dup).astype(np.int64)  # an earlier row
    ph[dup] = ph[src]
    groups[dup] = groups[src]
    return ph, groups


def layouts(d: int) -> list[tuple[int, int, int]]:
    """Exact (nhash, b, nflip) layouts for a multi-hash search within `d`: `nhash` blocks of
    `b` bits, each probed with up to `nflip` flipped bits. Of a pair's at most `d` differing
    bits, some block holds at most `d // nhash` (pigeonhole), so `nflip = d // nhash` finds
    every pair; bits outside the blocks only make that bound looser."""
    return [(k, min(64 // k, 24), d // k) for k in range(2, d + 2) if d // k <= 2]


def _fold(n: int, q: np.ndarray, i: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """For each of n rows, the smallest i < row with another group among the pairs (q, i)."""
    keep = (i < q) & (groups[i] != groups[q])
    best = np.full(n, n, dtype=np.int64)
    np.minimum.at(best, q[keep], i[keep])
    best[best == n] = -1
    return best


def faiss_answer(hashes, groups, d: int, layout) -> tuple[np.ndarray, float]:
    """Kiln's answer computed with a faiss binary index (`layout`: multi-hash
    `(nhash, b, nflip)`, or None for brute force); also the seconds of faiss's own index
    build and range search within the whole."""
    import faiss

    values, first, inverse = np.unique(hashes, return_index=True, return_inverse=True)
    # A value's two representatives: its first row, and its first row of another group.
    order = np.lexsort((np.arange(len(hashes)), inverse))
    inv_sorted, rows = inverse[order], order
    second = np.full(len(values), -1, dtype=np.int64)
    other = groups[rows] != groups[first[inv_sorted]]
    cand_rows = rows[other]
    cand_vals = inv_sorted[other]
    uniq, at = np.unique(cand_vals, return_index=True)
    second[uniq] = cand_rows[at]
    x = np.ascontiguousarray(values).view(np.uint8).reshape(-1, 8)
    if layout is None:
        index = faiss.IndexBinaryFlat(64)
    else:
        nhash, b, nflip = layout
        index = faiss.IndexBinaryMultiHash(64, nhash, b)
        index.nflip = nflip
    t0 = time.perf_counter()
    index.add(x)
    lims, _, nbr = index.range_search(x, d + 1)
    search_s = time.perf_counter() - t0
    qv = np.repeat(np.arange(len(values)), np.diff(lims).astype(np.int64))
    nbr = nbr.astype(np.int64)
    # A row's answer is the smallest representative (first row, or first row of another group)
    # of a value within d, its own value included, that comes before it in another group.
    n = len(hashes)
    reps = np.stack([first[nbr], second[nbr]], axis=1).ravel()
    owner = np.repeat(qv, 2)
    ok = reps >= 0
    reps, owner = reps[ok], owner[ok]
    order = np.argsort(owner, kind="stable")
    owner, reps = owner[order], reps[order]
    starts = np.searchsorted(owner, np.arange(len(values)))
    counts = np.searchsorted(owner, np.arange(len(values)), side="right") - starts
    row_counts = counts[inverse]
    row_idx = np.repeat(np.arange(n), row_counts)
    offs = np.arange(len(row_idx)) - np.repeat(np.cumsum(row_counts) - row_counts, row_counts)
    cand = reps[np.repeat(starts[inverse], row_counts) + offs]
    answer = _fold(n, row_idx, cand, groups)
    return answer, search_s


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def run(sizes: list[int], d: int, faiss_max: int, skewed_max: int, flat_max: int) -> list[dict]:
    rows = []
    for kind in ("uniform", "skewed"):
        for n in sizes:
            hashes, groups = synth(n, kind)
            ref, kiln_s = timed(near_duplicates, hashes, groups, d)
            row = {
                "data": kind,
                "rows": n,
                "d": d,
                "kiln_s": round(kiln_s, 3),
                "matches": int((ref >= 0).sum()),
            }
            if n > (faiss_max if kind == "uniform" else skewed_max):
                row["faiss_note"] = "multi-hash not run at this size (--faiss-max, --skewed-max)"
            else:
                row["faiss_multihash"] = {}
                for layout in layouts(d):
                    (ans, search_s), s = timed(faiss_answer, hashes, groups, d, layout)
                    assert np.array_equal(ans, ref), f"faiss {layout} differs from Kiln"
                    nhash, b, nflip = layout
                    row["faiss_multihash"][f"{nhash} x {b} bits, {nflip} flips"] = {
                        "total_s": round(s, 3),
                        "search_s": round(search_s, 3),
                    }
                best = min(v["total_s"] for v in row["faiss_multihash"].values())
                row["ratio_best_faiss_over_kiln"] = round(best / kiln_s, 2)
            if n <= flat_max:
                (ans, _), s = timed(faiss_answer, hashes, groups, d, None)
                assert np.array_equal(ans, ref), "faiss flat differs from Kiln"
                row["faiss_flat_s"] = round(s, 3)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--sizes", default="100000,1000000,3000000")
    p.add_argument("--d", type=int, default=4)
    p.add_argument("--faiss-max", type=int, default=1_000_000)
    p.add_argument("--skewed-max", type=int, default=100_000)
    p.add_argument("--flat-max", type=int, default=100_000)
    a = p.parse_args()
    try:
        import faiss
    except ImportError:
        sys.exit("benchmarks/near_dup_faiss.py needs faiss: pip install faiss-cpu==1.15.1")

    sizes = [int(s) for s in a.sizes.split(",")]
    warm = synth(5000, "skewed")  # first calls pay one-off set-up (covering designs, imports)
    near_duplicates(*warm, a.d)
    faiss_answer(*warm, a.d, layouts(a.d)[0])
    rows = run(sizes, a.d, a.faiss_max, a.skewed_max, a.flat_max)
    out = {
        "benchmark": "near_dup_faiss",
        "faiss": faiss.__version__,
        "numpy": np.__version__,
        "machine": platform.processor() or platform.machine(),
        "results": rows,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
