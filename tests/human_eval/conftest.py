"""Tiny studies on disk, in the layout `kiln evaluate` writes (models/study_images.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

PROMPTS = [
    ("A red circle above a blue square.", "Positional"),
    ("Two red circles.", "Counting"),
    ("A yellow colored circle.", "Colors"),
    ("A sign that says 'Kiln'.", "Text"),
]


def write_study(
    root: Path,
    study_id: str,
    prompts=PROMPTS,
    seeds=(0,),
    size: int = 32,
    colour=(200, 40, 40),
    model: str = "run-a",
) -> Path:
    """A study folder with one PNG per (prompt, seed) and its study.json."""
    folder = root / "eval" / study_id
    (folder / "images").mkdir(parents=True, exist_ok=True)
    items = []
    for i, (prompt, category) in enumerate(prompts):
        for seed in seeds:
            rel = f"images/{i:04d}-s{seed}.png"
            shade = tuple((c + 13 * i + seed) % 256 for c in colour)
            Image.new("RGB", (size, size), shade).save(folder / rel)
            items.append(
                {"index": i, "prompt": prompt, "category": category, "seed": seed, "path": rel}
            )
    study = {
        "study_id": study_id,
        "model": {"pipeline": f"/models/{model}/final", "ref": model},
        "prompts_csv": "prompts.csv",
        "settings": {
            "seeds": list(seeds),
            "num_inference_steps": 2,
            "guidance_scale": 7.5,
            "resolution": size,
        },
        "items": items,
    }
    (folder / "study.json").write_text(json.dumps(study))
    return folder


def many_prompts(n: int) -> list[tuple[str, str]]:
    cats = ["Colors", "Counting", "Positional", "Text", "Rare Words"]
    return [(f"prompt number {i} with {cats[i % 5].lower()}", cats[i % 5]) for i in range(n)]


@pytest.fixture
def two_studies(tmp_path) -> tuple[Path, Path, Path]:
    """(root, study A folder, study B folder): 4 prompts x 2 seeds each."""
    root = tmp_path / "root"
    a = write_study(root, "run-a-1111", seeds=(0, 1), model="run-a")
    b = write_study(root, "run-b-2222", seeds=(0, 1), colour=(40, 40, 200), model="run-b")
    return root, a, b


REPO = Path(__file__).resolve().parents[2]


def wait_until_up(url: str, proc, timeout: float = 60.0) -> None:
    """Poll /healthz until the server answers; fail (with its output) after `timeout`."""
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            proc.log.seek(0)
            raise RuntimeError(f"server exited with {proc.returncode}: {proc.log.read()[-4000:]}")
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise TimeoutError(f"server at {url} not up after {timeout}s")


def serve_argv(root: Path, port: int, config: str | None = None) -> list[str]:
    """`kiln rate serve` on 127.0.0.1:port over `config`'s ratings store (default tiny.yaml's:
    the root's SQLite file)."""
    config = config or str(REPO / "configs" / "tiny.yaml")
    return [
        "kiln_cli",
        "rate",
        "serve",
        "--config",
        config,
        "--root",
        str(root),
        "--port",
        str(port),
    ]


def start_server(argv: list[str], port: int):
    """A real server process on 127.0.0.1:port (argv after `python -m`)."""
    import os
    import subprocess
    import sys
    import tempfile

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # Output to a file, not a pipe nobody reads: under load, an access log filling a 64 KB
    # pipe would block the server.
    log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed in stop)
    proc = subprocess.Popen(
        [sys.executable, "-m", *argv],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    proc.log = log
    url = f"http://127.0.0.1:{port}"
    wait_until_up(url, proc)
    return proc, url


def stop(proc) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except Exception:
            proc.kill()
            proc.wait(timeout=15)
    log = getattr(proc, "log", None)
    if log is not None:
        log.close()
