"""What every config section shares: the strict base model, the config error
(`kiln_config/errors.py`), and the helpers the schema itself uses (hashing, URI checks,
secrets masked in dumps).
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    PlainSerializer,
    SerializationInfo,
)

from kiln_config.errors import ConfigError

__all__ = [
    "ConfigError",
    "REVEAL_SECRETS",
    "SecretUri",
    "Strict",
    "is_remote",
    "redact_uri",
    "stable_hash",
]


class Strict(BaseModel):
    """Base of every config section: an unknown key is an error, never silently ignored."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())


def stable_hash(obj: Any, n: int = 16) -> str:
    """The first `n` hex digits of the SHA-256 of `obj` as canonical JSON (sorted keys).

    The identity of settings, configs and encoders: equal values give equal hashes in any
    process and on any machine.
    """
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:n]


def is_remote(uri: str) -> bool:
    """Whether `uri` names a scheme (s3://, http://...) rather than a local path."""
    return "://" in uri


def redact_uri(uri: str) -> str:
    """`uri` with the secret of its userinfo masked, for anything shown or logged.

    Tracking URIs can hold database credentials (`postgresql://user:secret@host/db`) or, for an
    http(s) server, a bare token as the user (`https://token@host`). Never raises: the netloc
    is split as text, so a malformed port cannot turn a message into a traceback.
    """
    parts = urlsplit(uri)
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if not at:
        return uri
    user, colon, _ = userinfo.partition(":")
    if colon:
        masked = f"{user}:***"
    elif parts.scheme in ("http", "https"):
        masked = "***"  # a token in the user part
    else:
        return uri  # a database user name alone is no secret
    return urlunsplit(parts._replace(netloc=f"{masked}@{hostport}"))


def _redact_in_json(uri: str, info: SerializationInfo) -> str:
    return uri if (info.context or {}).get("reveal_secrets") else redact_uri(uri)


# A URI that may hold credentials (a database password, a token). A JSON dump of the config
# (a Prefect flow run's parameters, anything logged) masks them; a file that must load back
# (the run's config snapshot) dumps with `context=REVEAL_SECRETS`.
SecretUri = Annotated[str, PlainSerializer(_redact_in_json, when_used="json")]

REVEAL_SECRETS = {"reveal_secrets": True}
