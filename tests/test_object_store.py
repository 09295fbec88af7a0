"""The stack's object store (`python -m deployments.object_store`) as a real process on
loopback: it checks every key, keeps each key to its prefix, verifies presigned URLs itself
and refuses moto's control API. (The whole stack uses it in tests/test_stack.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import boto3
import httpx
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from tests.servers import free_port, wait_for

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
KEYS = {
    "images": ("AKIAIMAGESKEY0001", "images-secret"),
    "artifacts": ("AKIAARTIFACTS0001", "artifacts-secret"),
}


@pytest.fixture(scope="module")
def store():
    port = free_port()
    env = os.environ | {
        "KILN_S3_IMAGES_KEY_ID": KEYS["images"][0],
        "KILN_S3_IMAGES_SECRET": KEYS["images"][1],
        "KILN_S3_ARTIFACTS_KEY_ID": KEYS["artifacts"][0],
        "KILN_S3_ARTIFACTS_SECRET": KEYS["artifacts"][1],
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "deployments.object_store", "--port", str(port)],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"

    def answers():
        try:
            return httpx.get(url, timeout=2)
        except httpx.HTTPError:
            return None

    try:
        wait_for("the object store", answers, 60, [proc], interval=0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _client(url: str, key_id: str, secret: str):
    return boto3.client(
        "s3",
        endpoint_url=url,
        aws_access_key_id=key_id,
        aws_secret_access_key=secret,
        region_name="us-east-1",
        config=Config(signature_version="s3v4"),
    )


def _code(call) -> str:
    with pytest.raises(ClientError) as e:
        call()
    return e.value.response["Error"]["Code"]


def test_every_request_is_signed_by_a_key_within_its_prefix(store):
    images, artifacts = _client(store, *KEYS["images"]), _client(store, *KEYS["artifacts"])
    images.put_object(Bucket="kiln", Key="images/a.jpg", Body=b"pixels")
    artifacts.put_object(Bucket="kiln", Key="mlflow/1/python_model.pkl", Body=b"model")
    assert images.get_object(Bucket="kiln", Key="images/a.jpg")["Body"].read() == b"pixels"
    model = "mlflow/1/python_model.pkl"
    put = lambda c, key: lambda: c.put_object(Bucket="kiln", Key=key, Body=b"evil")  # noqa: E731
    assert _code(put(images, model)) == "AccessDenied", "a member's key cannot rewrite a model"
    assert _code(lambda: images.delete_object(Bucket="kiln", Key=model)) == "AccessDenied"
    assert _code(put(artifacts, "images/b.jpg")) == "AccessDenied"
    wrong = _client(store, KEYS["images"][0], "not-the-secret")
    assert _code(put(wrong, "images/c.jpg")) == "SignatureDoesNotMatch"
    unknown = _client(store, "AKIANOBODY0000001", "x")
    assert _code(put(unknown, "images/c.jpg")) == "InvalidAccessKeyId"
    assert httpx.get(f"{store}/kiln/images/a.jpg").status_code == 403
    assert httpx.put(f"{store}/kiln/{model}", content=b"evil").status_code == 403
    assert httpx.post(f"{store}/moto-api/reset").status_code == 403
    assert artifacts.get_object(Bucket="kiln", Key=model)["Body"].read() == b"model"


def test_presigned_urls_are_verified_against_their_key_expiry_and_prefix(store):
    images, artifacts = _client(store, *KEYS["images"]), _client(store, *KEYS["artifacts"])
    key = "mlflow/2/a b+c.bin"
    artifacts.put_object(Bucket="kiln", Key=key, Body=b"0123456789")
    sign = lambda c, op, s=60, **kw: c.generate_presigned_url(  # noqa: E731
        op, Params={"Bucket": "kiln", "Key": key, **kw}, ExpiresIn=s
    )
    url = sign(artifacts, "get_object")
    assert httpx.get(url).content == b"0123456789"
    ranged = httpx.get(url, headers={"Range": "bytes=2-4"})
    assert (ranged.status_code, ranged.content) == (206, b"234")
    assert httpx.get(url.replace("a%20b", "x%20b")).status_code == 403, "altered"
    assert httpx.get(sign(images, "get_object")).status_code == 403, "outside its prefix"
    short = sign(artifacts, "get_object", 1)
    time.sleep(2.1)
    assert httpx.get(short).status_code == 403, "expired"
    # A large artifact goes up in parts, each through its own presigned URL.
    upload = artifacts.create_multipart_upload(Bucket="kiln", Key=key)["UploadId"]
    part = sign(artifacts, "upload_part", UploadId=upload, PartNumber=1)
    sent = httpx.put(part, content=b"part one")
    assert sent.status_code == 200 and sent.headers["etag"]


def test_a_store_without_its_keys_refuses_to_start_and_names_them():
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_S3_")}
    env["KILN_S3_IMAGES_KEY_ID"] = KEYS["images"][0]
    proc = subprocess.run(
        [sys.executable, "-m", "deployments.object_store", "--port", str(free_port())],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1].endswith(
        "error: set KILN_S3_IMAGES_SECRET, KILN_S3_ARTIFACTS_KEY_ID, KILN_S3_ARTIFACTS_SECRET: "
        "the two users' keys (kiln stack writes them)"
    )
