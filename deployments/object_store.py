"""The stack's object store: moto's S3 server with its authentication on.

    python -m deployments.object_store --host 127.0.0.1 --port 9000 --bucket kiln

moto's server checks no credentials unless its authentication is on, and then only IAM users'
access keys pass. This starts it with authentication on from its first request, and makes,
in the server's own process before it listens (so there is no window of unchecked requests),
the bucket and two IAM users whose keys come from the environment:

- `KILN_S3_IMAGES_KEY_ID` / `KILN_S3_IMAGES_SECRET`: the worker's and the members' key, for
  the source images and anything else in the bucket but `mlflow/`;
- `KILN_S3_ARTIFACTS_KEY_ID` / `KILN_S3_ARTIFACTS_SECRET`: the MLflow server's, for
  `mlflow/` (the registry's artifacts) alone. No member holds it: a model's files change only
  through the tracking server, which checks each write against its logins.

An unsigned request, an unknown key, a wrong signature or a key outside its prefix is refused
(403), as S3 and MinIO refuse them. A presigned URL (SigV4 in the query: the tracking server
hands them to its clients to move large artifacts in parts) is verified here, against the
key that signed it, its expiry and that key's prefix, since moto's own checks read only the
Authorization header. moto's own control API (`/moto-api/`: its dashboard, and a
reset that empties every bucket) is refused too. Objects live in the server's memory: gone when
it stops.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import hmac
import json
import os
import sys
import threading
from urllib.parse import parse_qsl, quote, unquote

__all__ = ["ACCOUNT", "ARTIFACTS_PREFIX", "main"]

ACCOUNT = "123456789012"  # moto's default account
ARTIFACTS_PREFIX = "mlflow/"


def _policy(bucket: str, objects: str, deny: str | None = None) -> str:
    statements = [
        {
            "Effect": "Allow",
            "Action": ["s3:ListBucket", "s3:GetBucketLocation"],
            "Resource": f"arn:aws:s3:::{bucket}",
        },
        {"Effect": "Allow", "Action": "s3:*", "Resource": f"arn:aws:s3:::{bucket}/{objects}"},
    ]
    if deny:
        statements.append(
            {"Effect": "Deny", "Action": "s3:*", "Resource": f"arn:aws:s3:::{bucket}/{deny}"}
        )
    return json.dumps({"Version": "2012-10-17", "Statement": statements})


# Each user, and the prefix of the environment variables that give its key
# (`<prefix>_KEY_ID`, `<prefix>_SECRET`).
USERS = {"kiln-images": "KILN_S3_IMAGES", "kiln-artifacts": "KILN_S3_ARTIFACTS"}
KEY_VARIABLES = tuple(f"{env}_{part}" for env in USERS.values() for part in ("KEY_ID", "SECRET"))


def _setup(bucket: str) -> None:
    """The bucket and the two users, made in the backends of this process."""
    from moto.iam.models import iam_backends
    from moto.s3.models import s3_backends

    s3_backends[ACCOUNT]["aws"].create_bucket(bucket, "us-east-1")
    iam = iam_backends[ACCOUNT]["aws"]
    policies = {
        "kiln-images": _policy(bucket, "*", deny=f"{ARTIFACTS_PREFIX}*"),
        "kiln-artifacts": _policy(bucket, f"{ARTIFACTS_PREFIX}*"),
    }
    for user, env in USERS.items():
        policy = policies[user]
        key_id, secret = os.environ[f"{env}_KEY_ID"], os.environ[f"{env}_SECRET"]
        iam.create_user("us-east-1", user)
        key = iam.create_access_key(user)
        key.access_key_id, key.secret_access_key = key_id, secret  # the stack's own keys
        KEYS[key_id] = (secret, "artifacts" if user == "kiln-artifacts" else "images")
        iam.put_user_policy(user, "kiln", policy)


_ANONYMOUS = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
    b"<Message>Anonymous access is not allowed: sign the request with an access key"
    b"</Message></Error>\n"
)
_BAD_URL = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
    b"<Message>The presigned URL is expired, altered or not this key's to sign"
    b"</Message></Error>\n"
)

# The keys this process made: {access key id: (secret, the user's object prefix rule)}.
KEYS: dict[str, tuple[str, str]] = {}
# Set while a presigned request that `_presigned_ok` verified runs in this thread.
_VERIFIED = threading.local()


def _quote(text: str) -> str:
    return quote(text, safe="-_.~")


def _presigned_ok(environ: dict, bucket: str) -> bool:
    """Whether a presigned (SigV4 query) request is signed by one of this store's keys, not
    expired, and for an object that key may reach. moto's own checks cannot verify one
    (they read the Authorization header): the tracking server hands such URLs to its
    clients for large artifacts."""
    pairs = parse_qsl(environ.get("QUERY_STRING", ""), keep_blank_values=True)
    q = dict(pairs)
    try:
        key_id, day, region, service, _ = q["X-Amz-Credential"].split("/")
        secret, rule = KEYS[key_id]
        signed_at = dt.datetime.strptime(q["X-Amz-Date"], "%Y%m%dT%H%M%SZ").replace(tzinfo=dt.UTC)
        expires = int(q["X-Amz-Expires"])
    except (KeyError, ValueError):
        return False
    if dt.datetime.now(dt.UTC) > signed_at + dt.timedelta(seconds=expires):
        return False
    raw_path = environ.get("RAW_URI") or environ.get("REQUEST_URI") or environ["PATH_INFO"]
    path = raw_path.split("?", 1)[0]
    obj = unquote(path).lstrip("/").removeprefix(f"{bucket}/")
    if (rule == "artifacts") != obj.startswith(ARTIFACTS_PREFIX):
        return False
    query = "&".join(f"{_quote(k)}={_quote(v)}" for k, v in sorted(pairs) if k != "X-Amz-Signature")
    names = q.get("X-Amz-SignedHeaders", "host").split(";")
    values = {"host": environ.get("HTTP_HOST", "")}
    headers = "".join(
        f"{n}:{values.get(n, environ.get('HTTP_' + n.upper().replace('-', '_'), '')).strip()}\n"
        for n in names
    )
    canonical = "\n".join(
        [environ["REQUEST_METHOD"], path, query, headers, ";".join(names), "UNSIGNED-PAYLOAD"]
    )
    scope = f"{day}/{region}/{service}/aws4_request"
    digest = hashlib.sha256(canonical.encode()).hexdigest()
    to_sign = f"AWS4-HMAC-SHA256\n{q['X-Amz-Date']}\n{scope}\n{digest}"
    k = f"AWS4{secret}".encode()
    for part in (day, region, service, "aws4_request"):
        k = hmac.new(k, part.encode(), hashlib.sha256).digest()
    expected = hmac.new(k, to_sign.encode(), hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, q.get("X-Amz-Signature", ""))


def _guarded(app, bucket: str):
    """`app` behind refusals of its own: moto's control API, a request with no signature at
    all (moto's checks expect one and would answer 500), and a presigned URL that
    `_presigned_ok` does not verify; a verified one skips moto's header checks."""

    def refuse(start_response, body: bytes, kind: str = "application/xml"):
        start_response("403 Forbidden", [("Content-Type", kind)])
        return [body]

    def wsgi(environ, start_response):
        if environ.get("PATH_INFO", "").startswith("/moto-api"):
            return refuse(
                start_response, b"moto's control API is off in this object store\n", "text/plain"
            )
        query = environ.get("QUERY_STRING", "")
        if "X-Amz-Signature=" in query:
            if not _presigned_ok(environ, bucket):
                return refuse(start_response, _BAD_URL)
            _VERIFIED.on = True
            try:
                return list(app(environ, start_response))
            finally:
                _VERIFIED.on = False
        if "HTTP_AUTHORIZATION" not in environ:
            return refuse(start_response, _ANONYMOUS)
        return app(environ, start_response)

    return wsgi


def _skip_checks_when_verified() -> None:
    """moto's check of each action, skipped for a presigned request verified above."""
    from moto.core.authorization import ActionAuthenticatorMixin

    check = ActionAuthenticatorMixin._authenticate_and_authorize_action

    def checked(self, iam_request_cls, resource="*"):
        if getattr(_VERIFIED, "on", False):
            return None
        return check(self, iam_request_cls, resource)

    ActionAuthenticatorMixin._authenticate_and_authorize_action = checked


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deployments.object_store", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--bucket", default="kiln")
    a = p.parse_args(argv)
    missing = [n for n in KEY_VARIABLES if not os.environ.get(n)]
    if missing:
        p.error(f"set {', '.join(missing)}: the two users' keys (kiln stack writes them)")
    os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"  # read when moto's settings import
    os.environ.setdefault("MOTO_PORT", str(a.port))
    from moto import settings
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import run_simple

    settings.INITIAL_NO_AUTH_ACTION_COUNT = 0
    _setup(a.bucket)
    _skip_checks_when_verified()
    app = _guarded(DomainDispatcherApplication(create_backend_app), a.bucket)
    sys.stdout.write(f"object store on http://{a.host}:{a.port}, bucket {a.bucket}\n")
    sys.stdout.flush()
    run_simple(a.host, a.port, app, threaded=True, request_handler=MotoRequestHandler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
