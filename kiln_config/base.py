"""What every config section shares: the strict base model, the config error
(`kiln_config/errors.py`), and the helpers the schema itself uses (hashing, URI checks,
secrets masked in dumps and messages, the rule for ids that name folders).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    PlainSerializer,
    SerializationInfo,
)

from kiln_config.errors import ConfigError, InputError

__all__ = [
    "ConfigError",
    "REVEAL_SECRETS",
    "SecretUri",
    "Strict",
    "check_id",
    "files_sha256",
    "is_id",
    "is_remote",
    "redact_text",
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


def files_sha256(path: str | Path) -> dict:
    """The sha256 of a weights file, or of each file of a folder plus one digest over them
    (of the sorted `relpath sha256` lines), so a changed file anywhere changes `sha256`."""
    path = Path(path)
    if path.is_file():
        return {"sha256": _file_sha256(path)}
    files = {
        p.relative_to(path).as_posix(): _file_sha256(p)
        for p in sorted(path.rglob("*"))
        if p.is_file() and ".cache" not in p.relative_to(path).parts
    }
    joined = "".join(f"{k} {v}\n" for k, v in files.items())
    return {"sha256": hashlib.sha256(joined.encode()).hexdigest(), "files": files}


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def is_remote(uri: str) -> bool:
    """Whether `uri` names a scheme (s3://, http://...) rather than a local path."""
    return "://" in uri


# Query parameters that carry a secret (`?password=`, `?sslpassword=`, `?token=`...).
_SECRET_PARAM = re.compile(r"pass|pwd|secret|token|key|credential|auth|sig", re.IGNORECASE)


def redact_uri(uri: str) -> str:
    """`uri` with its secrets masked, for anything shown or logged: the password of its
    userinfo, and the value of every query parameter that names one.

    Tracking URIs can hold database credentials (`postgresql://user:secret@host/db`,
    `postgresql://host/db?user=u&password=secret`) or, for an http(s) server, a bare token as
    the user (`https://token@host`). Never raises: the netloc is split as text, so a
    malformed port cannot turn a message into a traceback, and a URI `urlsplit` refuses (an
    unclosed `[`) is shown as its scheme alone.
    """
    try:
        parts = urlsplit(uri)
    except ValueError:
        return uri.partition("://")[0] + "://***"
    if parts.query:
        pairs = parse_qsl(parts.query, keep_blank_values=True)
        if any(_SECRET_PARAM.search(k) for k, _ in pairs):
            masked_q = [(k, "***" if _SECRET_PARAM.search(k) else v) for k, v in pairs]
            parts = parts._replace(query=urlencode(masked_q, safe="*"))
            uri = urlunsplit(parts)
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


_URI_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"]+")


def redact_text(text: str) -> str:
    """`text` with every URI in it passed through `redact_uri`: for a message that quotes
    what a user gave (a config value, a command line)."""
    return _URI_IN_TEXT.sub(lambda m: redact_uri(m.group(0)), text)


# An id that names a folder under the storage root (a run, an ingest, a dataset version, a
# study, a comparison) or a file a download writes: letters, digits, `.`, `_` and `-`, not
# starting with a dot, so that it is one path component and never `..` or hidden.
_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


def is_id(value: object) -> bool:
    """Whether `value` is an id that can name a folder (`check_id`'s rule)."""
    return isinstance(value, str) and _ID.fullmatch(value) is not None


def check_id(what: str, value: object) -> str:
    """`value`, when it is an id that can name a folder; else an error naming `what`.

    Raises:
        InputError: one line naming `what` and the value received.
    """
    if is_id(value):
        return value
    raise InputError(
        f"{what}: an id is letters, digits, '.', '_' and '-', 128 at most, not starting with "
        f"'.' (received {value!r})"
    )


def _redact_in_json(uri: str, info: SerializationInfo) -> str:
    return uri if (info.context or {}).get("reveal_secrets") else redact_uri(uri)


# A URI that may hold credentials (a database password, a token). A JSON dump of the config
# (a Prefect flow run's parameters, anything logged) masks them; a file that must load back
# (the run's config snapshot) dumps with `context=REVEAL_SECRETS`.
SecretUri = Annotated[str, PlainSerializer(_redact_in_json, when_used="json")]

REVEAL_SECRETS = {"reveal_secrets": True}
