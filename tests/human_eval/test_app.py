"""The rating app on a real uvicorn process on 127.0.0.1: access, blindness, idempotency."""

from __future__ import annotations

import re
import socket

import httpx
import pytest

from human_eval.store import RatingStore, sqlite_url
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
