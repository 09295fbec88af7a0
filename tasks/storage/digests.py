"""Digests of weight files and folders, recorded with what they computed."""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["files_sha256"]


def files_sha256(path: str | Path) -> dict:
    """The sha256 of a weights file, or of each file of a folder plus one digest over them
    (of the sorted `relpath sha256` lines), so a changed file anywhere changes `sha256`."""
    path = Path(path)
    if path.is_file():
        return {"sha256": _file_sha256(path)}
    files = {
        p.relative_to(path).as_posix(): _file_sha256(p)
        for p in sorted(path.rglob("*"))
        if p.is_file() and ".cache" not in p.relative_to(path).parts
    }
    joined = "".join(f"{k} {v}\n" for k, v in files.items())
    return {"sha256": hashlib.sha256(joined.encode()).hexdigest(), "files": files}


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
