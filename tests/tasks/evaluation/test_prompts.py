"""DrawBench without a local copy: fetched through huggingface_hub from a fake Hub on loopback.

The fake Hub is a real HTTP server on 127.0.0.1 that answers huggingface_hub's HEAD and GET for
the parquet file, so the real download, cache and conversion code runs, offline.
"""

from __future__ import annotations

import hashlib
import http.server
import io
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from models.evaluation.generate import read_prompts
from tasks.evaluation.prompts import (
    DRAWBENCH_CATEGORIES,
    DRAWBENCH_FILE,
    DRAWBENCH_REPO,
    PromptsUnavailable,
    fetch_drawbench,
    prompt_set_name,
    resolve_prompts,
)


def _parquet(n_per_cat: list[int]) -> bytes:
    rows = [
        {"prompts": f"prompt {c} {i}", "category": c}
        for c, n in enumerate(n_per_cat)
        for i in range(n)
    ]
    buf = io.BytesIO()
    pd.DataFrame(rows).to_parquet(buf)
    return buf.getvalue()


# 200 prompts over the 11 categories (DrawBench's own counts), labels as ClassLabel indices.
COUNTS = [25, 10, 19, 20, 20, 10, 10, 20, 7, 38, 21]


@pytest.fixture
def fake_hub():
    """Serve one parquet file at the Hub's resolve URL; `state["body"]` can be swapped."""
    state = {"body": _parquet(COUNTS), "requests": []}
    path = f"/datasets/{DRAWBENCH_REPO}/resolve/refs%2Fconvert%2Fparquet/{DRAWBENCH_FILE}"

    class Handler(http.server.BaseHTTPRequestHandler):
        def _head(self) -> bool:
            state["requests"].append((self.command, self.path))
            if self.path != path:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return False
            body = state["body"]
            self.send_response(200)
            self.send_header("X-Repo-Commit", "a" * 40)
            self.send_header("ETag", f'"{hashlib.sha256(body).hexdigest()}"')
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            return True

        def do_HEAD(self):  # noqa: N802
            self._head()

        def do_GET(self):  # noqa: N802
            if self._head():
                self.wfile.write(state["body"])

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", state
    server.shutdown()
    server.server_close()


def test_fetched_once_cached_and_read_as_drawbench(tmp_path, fake_hub, monkeypatch):
    endpoint, state = fake_hub
    monkeypatch.delenv("KILN_DRAWBENCH_CSV", raising=False)
    kw = {"cache_dir": tmp_path / "kiln", "endpoint": endpoint, "hf_cache": str(tmp_path / "hf")}
    path = resolve_prompts(None, **kw)
    rows = read_prompts(path)
    assert len(rows) == 200
    assert {r["category"] for r in rows} == set(DRAWBENCH_CATEGORIES)
    assert rows[0] == {"prompt": "prompt 0 0", "category": "Colors"}
    assert any(m == "GET" for m, _ in state["requests"])
    # Second use: from Kiln's cache, no request at all (offline from now on).
    state["requests"].clear()
    assert resolve_prompts(None, **kw) == path
    assert state["requests"] == []


def test_an_explicit_path_and_the_env_copy_win(tmp_path, fake_hub, monkeypatch):
    endpoint, state = fake_hub
    own = tmp_path / "mine.csv"
    own.write_text("Prompts,Category\na cat,Animals\n")
    monkeypatch.setenv("KILN_DRAWBENCH_CSV", str(own))
    assert resolve_prompts(str(own), endpoint=endpoint) == own
    assert resolve_prompts(None, endpoint=endpoint, cache_dir=tmp_path / "c") == own
    assert state["requests"] == []
    with pytest.raises(FileNotFoundError, match="evaluate.prompts_csv: file not found"):
        resolve_prompts(str(tmp_path / "missing.csv"))


@pytest.mark.integration
def test_offline_with_no_cache_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("KILN_DRAWBENCH_CSV", raising=False)
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    t0 = time.monotonic()
    with pytest.raises(PromptsUnavailable) as e:
        fetch_drawbench(tmp_path / "kiln", endpoint=dead, hf_cache=str(tmp_path / "hf"))
    msg = str(e.value)
    assert "evaluate.prompts_csv" in msg and "network access" in msg
    # One refused connect, not huggingface_hub's five retries with backoff (about 23 s): a
    # fail-fast check before any flow runs must not stall an offline machine.
    assert time.monotonic() - t0 < 10


def test_a_copy_that_is_not_drawbench_is_refused(tmp_path, fake_hub):
    endpoint, state = fake_hub
    state["body"] = _parquet([5] * 11)
    with pytest.raises(ValueError, match="expected 200 prompts"):
        fetch_drawbench(tmp_path / "kiln", endpoint=endpoint, hf_cache=str(tmp_path / "hf"))
    assert not (tmp_path / "kiln" / "drawbench.csv").exists()


def test_a_prompt_set_is_named_drawbench_only_when_it_is(tmp_path, fake_hub, monkeypatch):
    """Reports name a study's prompts as the config chose them: DrawBench's 200, or a file."""
    endpoint, _ = fake_hub
    monkeypatch.delenv("KILN_DRAWBENCH_CSV", raising=False)
    kw = {"cache_dir": tmp_path / "kiln", "endpoint": endpoint, "hf_cache": str(tmp_path / "hf")}
    assert prompt_set_name(resolve_prompts(None, **kw)) == "DrawBench"
    tiny = Path(__file__).resolve().parents[3] / "configs" / "prompts" / "tiny.csv"
    assert prompt_set_name(tiny) == "tiny.csv"
    assert prompt_set_name(tmp_path / "gone.csv") == "gone.csv"
