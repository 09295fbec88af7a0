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
(403), as S3 and MinIO refuse them. moto's own control API (`/moto-api/`: its dashboard, and a
reset that empties every bucket) is refused too. Objects live in the server's memory: gone when
it stops.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

__all__ = ["ACCOUNT", "ARTIFACTS_PREFIX", "main"]

ACCOUNT = "123456789012"  # moto's default account
ARTIFACTS_PREFIX = "mlflow/"


def _policy(bucket: str, objects: str, deny: str | None = None) -> str:
    statements = [
        {"Effect": "Allow", "Action": ["s3:ListBucket", "s3:GetBucketLocation"],
         "Resource": f"arn:aws:s3:::{bucket}"},
        {"Effect": "Allow", "Action": "s3:*", "Resource": f"arn:aws:s3:::{bucket}/{objects}"},
    ]  # fmt: skip
    if deny:
        statements.append(
            {"Effect": "Deny", "Action": "s3:*", "Resource": f"arn:aws:s3:::{bucket}/{deny}"}
        )
    return json.dumps({"Version": "2012-10-17", "Statement": statements})


def _setup(bucket: str) -> None:
    """The bucket and the two users, made in the backends of this process."""
    from moto.iam.models import iam_backends
    from moto.s3.models import s3_backends

    s3_backends[ACCOUNT]["aws"].create_bucket(bucket, "us-east-1")
    iam = iam_backends[ACCOUNT]["aws"]
    users = {
        "kiln-images": ("KILN_S3_IMAGES", _policy(bucket, "*", deny=f"{ARTIFACTS_PREFIX}*")),
        "kiln-artifacts": ("KILN_S3_ARTIFACTS", _policy(bucket, f"{ARTIFACTS_PREFIX}*")),
    }
    for user, (env, policy) in users.items():
        key_id, secret = os.environ[f"{env}_KEY_ID"], os.environ[f"{env}_SECRET"]
        iam.create_user("us-east-1", user)
        key = iam.create_access_key(user)
        key.access_key_id, key.secret_access_key = key_id, secret  # the stack's own keys
        iam.put_user_policy(user, "kiln", policy)


_ANONYMOUS = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
    b"<Message>Anonymous access is not allowed: sign the request with an access key"
    b"</Message></Error>\n"
)


def _guarded(app):
    """`app` behind two refusals of its own: moto's control API, and a request with no
    signature at all (moto's checks expect one and would answer 500)."""

    def wsgi(environ, start_response):
        if environ.get("PATH_INFO", "").startswith("/moto-api"):
            start_response("403 Forbidden", [("Content-Type", "text/plain")])
            return [b"moto's control API is off in this object store\n"]
        query = environ.get("QUERY_STRING", "")
        if "HTTP_AUTHORIZATION" not in environ and "Signature=" not in query:
            start_response("403 Forbidden", [("Content-Type", "application/xml")])
            return [_ANONYMOUS]
        return app(environ, start_response)

    return wsgi


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deployments.object_store", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--bucket", default="kiln")
    a = p.parse_args(argv)
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
    app = _guarded(DomainDispatcherApplication(create_backend_app))
    sys.stdout.write(f"object store on http://{a.host}:{a.port}, bucket {a.bucket}\n")
    sys.stdout.flush()
    run_simple(a.host, a.port, app, threaded=True, request_handler=MotoRequestHandler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
