"""The rating app on a real uvicorn process on 127.0.0.1: access, blindness, idempotency."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import httpx
import pytest

from human_eval.store import RATER_RECHECK_S, RatingStore, sqlite_url
from human_eval.studies import create_comparison, load_study
from tasks.storage.layout import Layout
from tests.servers import free_port

from .conftest import PROMPTS, serve_argv, start_server, stop, write_study

pytestmark = pytest.mark.integration

XSS = '<img src=x onerror=alert(1)>"; DROP TABLE votes;--'


@pytest.fixture(scope="module")
def app_server(tmp_path_factory):
    """A server over a store with one comparison (an XSS prompt among its prompts)."""
    root = tmp_path_factory.mktemp("app") / "root"
    prompts = [(XSS, "Misspellings"), *PROMPTS]
    a = write_study(root, "run-alpha-1111", prompts=prompts, model="run-alpha")
    b = write_study(root, "run-beta-2222", prompts=prompts, colour=(0, 90, 200), model="run-beta")
    url = sqlite_url(Layout(root).ratings_db())
    store = RatingStore(url)
    cid, _ = create_comparison(store, load_study(a), load_study(b), raters_per_pair=2, gold=1)
    tokens = [t for _, t in store.add_raters(cid, 3)]
    port = free_port()
    proc, base = start_server(serve_argv(root, port), port)
    yield {"base": base, "store": store, "tokens": tokens, "cid": cid, "root": root}
    stop(proc)
    store.close()


def _raw_get(base: str, target: str) -> tuple[int, bytes]:
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(f"GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1]), data


def _task(client, base, token):
    page = client.get(f"{base}/rate/{token}")
    assert page.status_code == 200, page.text
    m = re.search(r'name="task_id" value="(\d+)"', page.text)
    return page, (int(m.group(1)) if m else None)


def test_unknown_or_missing_token_is_403(app_server):
    base = app_server["base"]
    for path in [
        "/rate/nope",
        "/rate/",
        "/rate",
        "/rate/nope/image/abc",
        "/admin/nope",
        "/admin/",
        "/admin",
    ]:
        assert httpx.get(base + path).status_code == 403, path
    r = httpx.post(f"{base}/rate/nope/vote", data={"task_id": "1", "quality": "left"})
    assert r.status_code == 403


def test_admin_page_needs_the_admin_token(app_server):
    base, store = app_server["base"], app_server["store"]
    rater = app_server["tokens"][0]
    assert httpx.get(f"{base}/admin/{rater}").status_code == 403
    admin = store.new_admin_token(rotate=True)
    assert admin not in app_server["tokens"]
    page = httpx.get(f"{base}/admin/{admin}")
    assert page.status_code == 200
    assert app_server["cid"] in page.text and "gold correct" in page.text
    assert admin not in httpx.get(f"{base}/rate/{rater}").text


def test_page_is_blind_and_escapes_the_prompt(app_server):
    base, token = app_server["base"], app_server["tokens"][1]
    seen_xss = False
    with httpx.Client() as client:
        for _ in range(8):
            page, task_id = _task(client, base, token)
            text = page.text
            if task_id is None:
                assert "Thank you" in text
                break
            # Image ids are HMAC hex digests: any digit run may occur in them by chance.
            ids_hidden = re.sub(r"/[0-9a-f]{24,}\b", "/<image id>", text.replace(token, "<t>"))
            for secret in ["run-alpha", "run-beta", "1111", "2222", "/models/", "eval/"]:
                assert secret not in ids_hidden
            assert "<img src=x" not in text
            seen_xss |= "&lt;img src=x onerror=alert(1)&gt;" in text
            assert "Which image better represents the text caption?" in text
            assert page.headers["content-security-policy"].startswith("default-src 'none'")
            form = {"task_id": task_id, "quality": "tie", "alignment": "tie"}
            client.post(f"{base}/rate/{token}/vote", data=form)
    assert seen_xss


def test_images_by_id_only(app_server):
    base = app_server["base"]
    token = app_server["tokens"][2]
    page = httpx.get(f"{base}/rate/{token}").text
    ids = re.findall(rf"/rate/{token}/image/([\w-]+)", page)
    assert len(ids) == 2
    img = httpx.get(f"{base}/rate/{token}/image/{ids[0]}")
    assert img.status_code == 200 and img.content[:4] == b"\x89PNG"
    probes = [
        "..%2F..%2F..%2Fetc%2Fpasswd",
        "%2Fetc%2Fpasswd",
        "%2E%2E",
        "%2E%2E%2Fstudy.json",
        "images%2F0000-s0.png",
        str(app_server["root"] / "eval"),
    ]
    for probe in probes:
        r = httpx.get(f"{base}/rate/{token}/image/{probe}")
        assert r.status_code == 404, (probe, r.status_code)
        assert b"root:" not in r.content
    # Raw dot segments on the wire (an HTTP client would normalise them away).
    for target in [
        f"/rate/{token}/image/../../../../etc/passwd",
        f"/rate/{token}/image/..%2f..%2f..%2f..%2fetc%2fpasswd",
    ]:
        status, body = _raw_get(base, target)
        assert status == 404, (target, status)
        assert b"root:" not in body
    # An image id is its task's: another rater of the same comparison gets nothing with it.
    other = app_server["tokens"][0]
    assert httpx.get(f"{base}/rate/{other}/image/{ids[1]}").status_code == 404


def test_duplicate_submission_is_a_no_op(app_server):
    base, store = app_server["base"], app_server["store"]
    token = app_server["tokens"][0]
    before = store.count_votes()
    with httpx.Client() as client:
        page, task_id = _task(client, base, token)
        assert re.search(r"\d+ of \d+", page.text)
        form = {"task_id": task_id, "quality": "left", "alignment": "right"}
        first = client.post(f"{base}/rate/{token}/vote", data=form)
        again = client.post(f"{base}/rate/{token}/vote", data=form)
        assert first.status_code == again.status_code == 303
        bad = client.post(f"{base}/rate/{token}/vote", data={"task_id": task_id, "quality": "A"})
        assert bad.status_code == 400
        other = app_server["tokens"][1]
        assert client.post(f"{base}/rate/{other}/vote", data=form).status_code == 404
    assert store.count_votes() == before + 2


def test_a_vote_body_past_its_bounds_is_refused_and_counts_nothing(app_server):
    """A vote is a task id and two answers: a body over 4 KiB is 413 (with or without a
    Content-Length), a form with more fields than a vote has is 400, and neither votes."""
    base, store = app_server["base"], app_server["store"]
    token = app_server["tokens"][2]
    url = f"{base}/rate/{token}/vote"
    form_type = {"Content-Type": "application/x-www-form-urlencoded"}
    before = store.count_votes()
    with httpx.Client() as client:
        _, task_id = _task(client, base, token)
        vote = f"task_id={task_id}&quality=left&alignment=right"
        big = client.post(url, content=vote + "&pad=" + "x" * 8192, headers=form_type)
        assert big.status_code == 413 and "at most 4096 bytes" in big.text

        def chunks():  # no Content-Length: the server must stop reading by itself
            yield vote.encode()
            for _ in range(64):
                yield b"&pad=" + b"x" * 1024

        streamed = client.post(url, content=chunks(), headers=form_type)
        assert streamed.status_code == 413
        many = client.post(url, content=vote + "".join(f"&f{i}=1" for i in range(40)))
        assert many.status_code == 400 and "not a vote" in many.text
    assert store.count_votes() == before


def test_a_revoked_link_stops_and_unknown_links_are_bounded_without_the_write_lock(tmp_path):
    """`kiln rate revoke` stops one rater's link on a running app within seconds and keeps
    their answers; links point at `human_eval.public_url`; an unknown link is checked while
    another process holds the database's write lock (a token check takes none), and past
    `bad_links_per_minute` an address gets 429 with Retry-After, its good links included."""
    import sqlite3
    import subprocess
    import sys
    import time

    root = tmp_path / "root"
    a = write_study(root, "run-alpha-1111", model="run-alpha")
    b = write_study(root, "run-beta-2222", colour=(0, 90, 200), model="run-beta")
    db = Layout(root).ratings_db()
    with RatingStore(sqlite_url(db)) as store:
        cid, _ = create_comparison(store, load_study(a), load_study(b), raters_per_pair=2, gold=1)
    config = tmp_path / "c.yaml"
    config.write_text(
        "base: " + str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml") + "\n"
        "human_eval:\n  bad_links_per_minute: 4\n  public_url: https://rate.example.com/\n"
    )

    def kiln(*args):
        common = ["--config", str(config), "--root", str(root)]
        return subprocess.run(
            [sys.executable, "-m", "kiln_cli", "rate", *args, *common],
            capture_output=True,
            text=True,
            timeout=120,
        )

    links = kiln("invite", "--comparison", cid, "--raters", "2").stdout.split()
    assert links[0] == "r001" and links[1].startswith("https://rate.example.com/rate/")
    tokens = [links[1].rsplit("/", 1)[1], links[3].rsplit("/", 1)[1]]
    port = free_port()
    proc, base = start_server(serve_argv(root, port, str(config)), port)
    try:
        with httpx.Client(timeout=10) as client:
            _, task_id = _task(client, base, tokens[0])
            voted = client.post(
                f"{base}/rate/{tokens[0]}/vote",
                data={"task_id": task_id, "quality": "left", "alignment": "tie"},
            )
            assert voted.status_code == 303, voted.text
            done = kiln("revoke", "--comparison", cid, "--rater", "r001")
            assert done.returncode == 0, done.stderr
            assert done.stdout == "r001: link revoked; their 2 answers are kept\n"
            again = kiln("revoke", "--comparison", cid, "--rater", "r001")
            assert again.returncode == 1 and again.stderr.startswith(
                f"kiln: error: comparison {cid} has no rater r001 with a working link"
            )
            deadline = time.monotonic() + RATER_RECHECK_S + 10
            while client.get(f"{base}/rate/{tokens[0]}").status_code == 200:
                assert time.monotonic() < deadline, "the revoked link still works"
                time.sleep(0.5)
            with RatingStore(sqlite_url(db)) as store:
                assert len(store.votes(cid)) == 2, "the revoked rater's answers are kept"

            holder = sqlite3.connect(db, timeout=0)
            holder.execute("BEGIN IMMEDIATE")  # another process holds the write lock
            try:
                t0 = time.monotonic()
                assert client.get(f"{base}/rate/nope").status_code == 403
                assert time.monotonic() - t0 < 5, "an unknown link waited for the write lock"
            finally:
                holder.rollback()
                holder.close()
            # The revoked link's 403 and `nope` were two: two more reach the limit of 4.
            codes = [client.get(f"{base}/rate/nope-{i}").status_code for i in range(2)]
            assert codes == [403, 403]
            refused = client.get(f"{base}/rate/{tokens[1]}")
            assert refused.status_code == 429 and 0 < int(refused.headers["Retry-After"]) <= 61
    finally:
        stop(proc)
