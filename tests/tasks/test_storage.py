import pytest

from tasks.storage import Storage


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
