import pytest

from tasks.storage.objects import Storage


def test_local_roundtrip_and_listing(tmp_path):
    st = Storage(str(tmp_path))
    st.write_text("a/b.txt", "hello")
    st.write_bytes("c.bin", b"\x00\x01")
    assert st.read_text("a/b.txt") == "hello"
    assert [o.key for o in st.list()] == ["a/b.txt", "c.bin"]
    assert st.exists("c.bin") and not st.exists("nope")
    assert not list(tmp_path.rglob(".*")), "atomic writes leave no temporary files"


def test_local_refuses_escaping_keys(tmp_path):
    st = Storage(str(tmp_path / "root"))
    for key in ("../evil.txt", "/etc/passwd", "a/../../x"):
        with pytest.raises(ValueError, match="escapes"):
            st.write_text(key, "x")
    assert not (tmp_path / "evil.txt").exists()


def test_s3_roundtrip_through_moto_server(s3_bucket, s3_endpoint):
    bucket, client = s3_bucket
    st = Storage(f"s3://{bucket}/prefix", endpoint_url=s3_endpoint)
    st.write_text("x/1.txt", "one")
    st.write_bytes("2.bin", b"two")
    client.put_object(Bucket=bucket, Key="other/3.txt", Body=b"outside the prefix")
    listed = st.list()
    assert [o.key for o in listed] == ["2.bin", "x/1.txt"]
    assert all(o.version for o in listed), "S3 listing carries ETags"
    assert st.read_text("x/1.txt") == "one"
    assert st.exists("2.bin") and not st.exists("missing")


def test_bad_uris():
    with pytest.raises(ValueError, match="scheme"):
        Storage("gs://bucket/x")
    with pytest.raises(ValueError, match="bucket"):
        Storage("s3:///nobucket")


@pytest.fixture
def flaky_s3(s3_endpoint):
    """An HTTP proxy in front of moto that answers the first two GETs of every object with
    503 SlowDown and 500 InternalError, as a throttled or failing store would."""
    import http.client
    import threading
    from collections import Counter
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from urllib.parse import urlparse

    upstream = urlparse(s3_endpoint)
    seen: Counter = Counter()
    failures: list[int] = []

    class Proxy(BaseHTTPRequestHandler):
        def _forward(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            is_object_get = self.command == "GET" and "?" not in self.path
            if is_object_get and seen[self.path] < 2:
                seen[self.path] += 1
                code, name = (503, "SlowDown") if seen[self.path] == 1 else (500, "InternalError")
                failures.append(code)
                err = f"<Error><Code>{name}</Code><Message>injected</Message></Error>".encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(err)))
                self.end_headers()
                self.wfile.write(err)
                return
            conn = http.client.HTTPConnection(upstream.hostname, upstream.port)
            conn.request(self.command, self.path, body=body, headers=dict(self.headers))
            resp = conn.getresponse()
            data = resp.read()
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_PUT = do_HEAD = do_POST = _forward

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", failures
    server.shutdown()


@pytest.mark.integration
def test_reads_retry_throttling_and_5xx_with_backoff(tmp_path, flaky_s3, s3_bucket, layouts):
    from kiln_config import IngestConfig
    from tasks.ingest.run import ingest_source

    endpoint, failures = flaky_s3
    bucket, client = s3_bucket
    src = tmp_path / "src"
    keys = layouts("img2dataset", src)
    for p in sorted(src.rglob("*")):
        if p.is_file():
            client.upload_file(str(p), bucket, f"raw/{p.relative_to(src).as_posix()}")
    st = Storage(f"s3://{bucket}/raw", endpoint)
    assert st.read_bytes("00000/a.txt") == b"a red field with a blue disc"
    assert failures == [503, 500], "one object read survived a 503 and a 500"
    res = ingest_source(
        IngestConfig(source=f"s3://{bucket}/raw"), str(tmp_path / "root"), endpoint_url=endpoint
    )
    assert res.accepted == len(keys) and res.quarantined == 0
    assert failures.count(503) == 18, "every image and sidecar was throttled once, then read"
