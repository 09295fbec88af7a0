"""The evaluation prompts: a given CSV, or DrawBench fetched once from the Hugging Face Hub.

`evaluate.prompts_csv` names a local CSV (columns `Prompts,Category`): the tiny preset's own
prompts (`configs/prompts/tiny.csv`, shipped with Kiln), or a team's file. Kiln does not ship
the 200 DrawBench prompts (Saharia et al. 2022); when `evaluate.prompts_csv` is unset, Kiln
reads `KILN_DRAWBENCH_CSV` if that names a file (the Makefile points it at a copy beside the
checkout when there is one), and otherwise fetches the parquet conversion of the public
dataset `shunk031/DrawBench` with `huggingface_hub` on first use. The hub's cache keeps the
download; the CSV Kiln reads is written once under the user's cache folder
(`$XDG_CACHE_HOME/kiln`, default `~/.cache/kiln`). Every copy is checked on the way in: 200
prompts in the 11 DrawBench categories.
"""

from __future__ import annotations

import csv
import logging
import os
import socket
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

from kiln_config.errors import InputError, KilnError, MissingInput

__all__ = [
    "DRAWBENCH_CATEGORIES",
    "DRAWBENCH_REPO",
    "PromptsUnavailable",
    "check_drawbench",
    "fetch_drawbench",
    "prompt_set_name",
    "resolve_prompts",
]

log = logging.getLogger(__name__)

DRAWBENCH_REPO = "shunk031/DrawBench"
# The Hub's automatic parquet conversion of that dataset (its loading script reads a sheet).
DRAWBENCH_REVISION = "refs/convert/parquet"
DRAWBENCH_FILE = "default/test/0000.parquet"
# The dataset's ClassLabel names, in label order (its `category` column holds the index).
DRAWBENCH_CATEGORIES = [
    "Colors",
    "Conflicting",
    "Counting",
    "DALL-E",
    "Descriptions",
    "Gary Marcus et al.",
    "Misspellings",
    "Positional",
    "Rare Words",
    "Reddit",
    "Text",
]
ENV_CSV = "KILN_DRAWBENCH_CSV"


class PromptsUnavailable(KilnError, RuntimeError):
    """No prompts could be had: no local file, and the Hub could not be reached."""


def _is_drawbench(rows: list[tuple[str, str]]) -> bool:
    """Whether (prompt, category) `rows` are 200 prompts in DrawBench's 11 categories."""
    return len(rows) == 200 and {c for _, c in rows} == set(DRAWBENCH_CATEGORIES)


def check_drawbench(rows: list[tuple[str, str]], source: str) -> None:
    """Raise ValueError unless `rows` are the 200 DrawBench prompts in its 11 categories."""
    if not _is_drawbench(rows):
        cats = Counter(c for _, c in rows)
        raise InputError(
            f"{source} is not DrawBench: expected 200 prompts in the 11 categories "
            f"{DRAWBENCH_CATEGORIES}, got {len(rows)} prompts in {sorted(cats)}"
        )


def prompt_set_name(path: str | Path) -> str:
    """What reports call a study's prompts: "DrawBench" when the file holds DrawBench's 200
    prompts in its 11 categories, else the file's name (the tiny preset's `tiny.csv`)."""
    path = Path(path)
    if not path.is_file():  # removed since the study: its name is what is left
        return path.name
    with open(path, newline="", encoding="utf-8") as f:
        rows = [
            (r.get("Prompts") or "", r.get("Category") or "")
            for r in csv.DictReader(f)
            if (r.get("Prompts") or "").strip()
        ]
    return "DrawBench" if _is_drawbench(rows) else path.name


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kiln"


def _reachable(endpoint: str | None, timeout: float = 5.0) -> None:
    """One TCP connect to the Hub before huggingface_hub's download, which retries a dead
    network five times with backoff (about 23 s) before it gives up.

    Skipped behind a proxy (the Hub is reached through it) and in huggingface_hub's offline
    mode (which fails at once by itself).

    Raises:
        OSError: The Hub's host does not resolve or does not accept a connection.
    """
    from huggingface_hub import constants

    proxies = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
    proxied = any(os.environ.get(k) for k in proxies)
    if proxied or constants.HF_HUB_OFFLINE:
        return
    url = urlsplit(endpoint or constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    socket.create_connection((url.hostname, port), timeout=timeout).close()


def fetch_drawbench(
    cache_dir: str | Path | None = None, *, endpoint: str | None = None, hf_cache: str | None = None
) -> Path:
    """The DrawBench CSV in Kiln's cache, fetched from the Hub on first use.

    Args:
        cache_dir: Where Kiln keeps its CSV; default `$XDG_CACHE_HOME/kiln`.
        endpoint: The Hub's base URL; default huggingface_hub's (`HF_ENDPOINT`).
        hf_cache: huggingface_hub's cache folder; default its own.

    Raises:
        PromptsUnavailable: Offline with nothing cached, naming both fixes.
    """
    out = Path(cache_dir) if cache_dir else _cache_dir()
    path = out / "drawbench.csv"
    if path.is_file():
        return path
    import pandas as pd
    from huggingface_hub import hf_hub_download

    try:
        _reachable(endpoint)
        parquet = hf_hub_download(
            DRAWBENCH_REPO,
            DRAWBENCH_FILE,
            repo_type="dataset",
            revision=DRAWBENCH_REVISION,
            endpoint=endpoint,
            cache_dir=hf_cache,
        )
    except Exception as e:  # network, proxy, offline mode, missing repo: one message for all
        raise PromptsUnavailable(
            f"the DrawBench prompts could not be fetched from the Hugging Face Hub "
            f"(dataset {DRAWBENCH_REPO}: {type(e).__name__}: {str(e).splitlines()[0][:200]}). "
            "Either set evaluate.prompts_csv (or KILN_DRAWBENCH_CSV) to a local CSV with columns "
            "Prompts,Category, or run once with network access so that the copy is cached"
        ) from e
    df = pd.read_parquet(parquet)
    cats = df["category"]
    if pd.api.types.is_integer_dtype(cats):  # ClassLabel indices
        cats = cats.map(lambda i: DRAWBENCH_CATEGORIES[int(i)])
    rows = list(zip(df["prompts"].astype(str).str.strip(), cats.astype(str), strict=True))
    check_drawbench(rows, f"{DRAWBENCH_REPO} ({DRAWBENCH_FILE})")
    out.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["Prompts", "Category"])
        w.writerows(rows)
    tmp.replace(path)  # atomic: a half-written cache is never read
    log.info("cached the DrawBench prompts from %s at %s", DRAWBENCH_REPO, path)
    return path


def resolve_prompts(prompts_csv: str | None, **fetch) -> Path:
    """The prompts file to use: the configured one, `KILN_DRAWBENCH_CSV`, or the Hub's copy.

    Args:
        prompts_csv: `evaluate.prompts_csv`; an explicit path always wins.
        **fetch: Passed to :func:`fetch_drawbench` (cache folder, endpoint).

    Raises:
        FileNotFoundError: The configured file does not exist.
        PromptsUnavailable: Nothing configured and the Hub unreachable with nothing cached.
    """
    if prompts_csv:
        path = Path(prompts_csv)
        if not path.is_file():
            raise MissingInput(f"evaluate.prompts_csv: file not found: {path}")
        return path
    env = os.environ.get(ENV_CSV)
    if env and Path(env).is_file():
        return Path(env)
    return fetch_drawbench(**fetch)
