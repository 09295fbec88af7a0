"""The takedown list: images and contributors withdrawn from every future dataset.

The list lives under the storage root (`Layout.takedowns()`), one Parquet file per addition,
named by its UTC time and a random suffix, written to a temporary name and renamed into
place; no file is ever edited or removed, so the list is its own audit log. Each row holds
what is taken down, either one image (`source`, `key`) or a whole `contributor`, with the
addition's `reason`, `by` (the user) and `at` (UTC time).

The next validate quarantines the listed rows (reason `takedown`, data_quality/terms.py);
`tasks.registry.model_lineage.tag_takedowns` tags every registered version whose dataset
holds one.
"""

from __future__ import annotations

import getpass
import secrets
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd

from data_quality.terms import Takedowns
from kiln_config.errors import InputError
from tasks.storage.layout import Layout

__all__ = ["TAKEDOWN_COLUMNS", "add_takedown", "read_keys_file", "read_takedowns", "takedown_set"]

TAKEDOWN_COLUMNS = ["id", "at", "by", "reason", "source", "key", "contributor"]


def add_takedown(
    root: str | Path,
    reason: str,
    *,
    images: list[tuple[str, str]] | None = None,
    contributor: str | None = None,
    by: str | None = None,
) -> pd.DataFrame:
    """Append one addition to the takedown list: some images, or one contributor.

    Args:
        root: The storage root.
        reason: Why (a contract's end, a court order): required, recorded on every row.
        images: (source, key) pairs of catalog rows.
        contributor: A contributor whose every image, present and future, is taken down.
        by: Who asked; default the current user.

    Returns:
        The rows written.

    Raises:
        ValueError: no reason, or not exactly one of images and contributor.
    """
    if not (reason or "").strip():
        raise InputError("takedown reason: a reason is required (received an empty one)")
    if bool(images) == bool(contributor):
        raise InputError(
            "takedown: give either images or a contributor, exactly one of them "
            f"(received images={images!r}, contributor={contributor!r})"
        )
    at = datetime.now(UTC)
    ident = f"{at.strftime('%Y%m%dT%H%M%S%fZ')}-{secrets.token_hex(4)}"
    rows = (
        [{"source": s, "key": k, "contributor": None} for s, k in images]
        if images
        else [{"source": None, "key": None, "contributor": contributor}]
    )
    df = pd.DataFrame(rows).assign(
        id=ident,
        at=at.isoformat(timespec="seconds"),
        by=by or getpass.getuser(),
        reason=reason.strip(),
    )[TAKEDOWN_COLUMNS]
    folder = Layout(Path(root)).takedowns()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{ident}.parquet"
    tmp = folder / f".{ident}.parquet.tmp"
    df.astype(object).to_parquet(tmp, index=False)
    tmp.rename(path)  # the name is new: nothing already on the list is replaced
    return df


def read_takedowns(root: str | Path) -> pd.DataFrame:
    """Every addition to the takedown list, oldest first (empty with the columns when none)."""
    folder = Layout(Path(root)).takedowns()
    files = sorted(folder.glob("*.parquet")) if folder.is_dir() else []
    frames = [pd.read_parquet(f) for f in files]
    if not frames:
        return pd.DataFrame(columns=TAKEDOWN_COLUMNS)
    return pd.concat(frames, ignore_index=True)[TAKEDOWN_COLUMNS]


def takedown_set(root: str | Path) -> Takedowns:
    """The takedown list as the validate step matches it."""
    df = read_takedowns(root)
    img = df[df["key"].notna()]
    return Takedowns(
        images=frozenset(zip(img["source"].astype(str), img["key"].astype(str), strict=True)),
        contributors=frozenset(df["contributor"].dropna().astype(str)),
    )


def read_keys_file(path: str | Path) -> list[str]:
    """The keys (or `<source>/<key>` paths) of a takedown file: a CSV whose `key` column
    holds them, or one per line without a header.

    Raises:
        ValueError: the file holds no key.
    """
    text = Path(path).read_text().splitlines()
    if text and text[0].strip().lower() == "key":
        keys = pd.read_csv(path, dtype=str)["key"].dropna().tolist()
    else:
        keys = [line.split(",")[0].strip() for line in text]
    keys = [k for k in keys if k]
    if not keys:
        raise InputError(f"takedown --file {path}: no key in the file")
    return keys
