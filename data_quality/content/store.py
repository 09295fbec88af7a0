"""The content store: scores and embeddings once per image content hash and per caption.

Two Delta tables beside the catalog's (`<root>/catalog/tables/`):

- `content_images`: `key` (the image's sha256), `scorer`, `score`, `embedding`;
- `content_captions`: `key` (the caption's sha256), `scorer`, `score`, `label`, `embedding`.

`scorer` names what computed the row (the detector and its version, or `clip-<digest of the
CLIP folder>`), so a new model scores again and an old one's rows stay for the verdicts that
used them. Rows only ever append: the same image under two keys or in two sources is scored
once, and a changed threshold re-decides from the stored score. Delta (not Lance) because
the catalog already is Delta, DuckDB and Polars read it as it is, and a validate reads the
rows of its keys by a filtered scan (docs/benchmarks.md, "Content rules": read cost per
million rows against the embedding cost).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["CAPTIONS", "IMAGES", "append", "caption_keys", "read", "table_dir"]

IMAGES = "content_images"
CAPTIONS = "content_captions"
SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("scorer", pa.string()),
        ("score", pa.float32()),
        ("label", pa.string()),
        ("embedding", pa.list_(pa.float32())),
    ]
)


def table_dir(catalog_folder: Path, table: str) -> Path:
    """Where `table` lives for the catalog folder `<root>/catalog`."""
    return catalog_folder / "tables" / table


def caption_keys(captions) -> np.ndarray:
    """The sha256 of each caption's UTF-8 (None for a missing caption)."""
    return np.array(
        [hashlib.sha256(c.encode()).hexdigest() if isinstance(c, str) else None for c in captions],
        dtype=object,
    )


def read(path: Path, scorer: str, keys=None) -> pd.DataFrame:
    """The stored rows of `scorer` (of `keys` only, when given), one per key: key, score,
    label and embedding (an (n, D) float32 array in `.attrs["embedding"]` when any)."""
    from deltalake import DeltaTable

    empty = pd.DataFrame({"key": [], "score": [], "label": []})
    empty.attrs["embedding"] = None
    if not (path / "_delta_log").is_dir():
        return empty
    flt = pc.field("scorer") == scorer
    if keys is not None:
        keys = pa.array(pd.unique(np.asarray(keys, dtype=object)), pa.string())
        if not len(keys):
            return empty
        flt = flt & pc.field("key").isin(keys)
    t = DeltaTable(str(path)).to_pyarrow_dataset().to_table(filter=flt)
    if not t.num_rows:
        return empty
    df = t.drop(["embedding"]).to_pandas()
    first = ~df["key"].duplicated().to_numpy()  # a row appended twice (a retried commit)
    out = df[first].drop(columns="scorer").reset_index(drop=True)
    emb = t["embedding"].combine_chunks()
    if emb.null_count < len(emb):
        flat = emb.flatten().to_numpy(zero_copy_only=False).astype(np.float32)
        out.attrs["embedding"] = flat.reshape(len(emb), -1)[first]
    else:
        out.attrs["embedding"] = None
    return out


def append(
    path: Path,
    keys,
    scorer: str,
    *,
    scores=None,
    labels=None,
    embeddings: np.ndarray | None = None,
) -> int:
    """Append one row per key; returns the rows written."""
    from deltalake import write_deltalake

    n = len(keys)
    if not n:
        return 0
    emb = (
        pa.nulls(n, SCHEMA.field("embedding").type)
        if embeddings is None
        else pa.array(list(np.asarray(embeddings, np.float32)), SCHEMA.field("embedding").type)
    )
    table = pa.table(
        {
            "key": pa.array(list(keys), pa.string()),
            "scorer": pa.array([scorer] * n, pa.string()),
            "score": pa.array(
                None if scores is None else np.asarray(scores, np.float32), pa.float32()
            )
            if scores is not None
            else pa.nulls(n, pa.float32()),
            "label": pa.array(list(labels), pa.string())
            if labels is not None
            else pa.nulls(n, pa.string()),
            "embedding": emb,
        },
        schema=SCHEMA,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    write_deltalake(str(path), table, mode="append")
    return n
