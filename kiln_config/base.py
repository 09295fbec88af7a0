"""What every config section shares: the strict base model, the config error
(`kiln_config/errors.py`), and the helpers the schema itself uses (hashing, URI checks,
secrets masked in dumps and messages, the rule for ids that name folders).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qsl, urlencode

from pydantic import (
    BaseModel,
    ConfigDict,
    PlainSerializer,
    SerializationInfo,
)

from kiln_config.errors import ConfigError, InputError

__all__ = [
    "ConfigError",
    "ENV_OK",
    "REVEAL_SECRETS",
    "EnvPath",
    "SecretUri",
    "Strict",
    "check_id",
    "files_sha256",
    "is_id",
    "is_remote",
    "redact_text",
    "redact_uri",
    "stable_hash",
    "write_private",
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
    the user (`https://token@host`). A password may hold `/`, `#`, `?` and `@` unencoded
    (SQLAlchemy's URL parser takes the first three, and a user may write the fourth): the
    userinfo runs from after `://` to the last `@` of the URI, so a password never shows,
    even where that masks a host too (an `@` in the query after a password). Never raises:
    the text is split by hand, so a malformed port or an unclosed `[` cannot turn a message
    into a traceback.
    """
    scheme, sep, rest = uri.partition("://")
    if not sep:
        return uri
    userinfo, at, tail = rest.rpartition("@")
    user, colon, _ = userinfo.partition(":")
    bare_token = scheme in ("http", "https") and not any(c in userinfo for c in "/?#")
    if at and (colon or bare_token):
        if "/" in user or "?" in user or "#" in user:
            # The first `:` is a port's, not a password's (`host:5432/db?u=a@b`): the
            # text between it and the last `@` may still hold one; mask it whole.
            user = user.split("/")[0].split("?")[0].split("#")[0]
        masked = f"{user}:***" if colon else "***"
        return _redact_query(f"{scheme}://{masked}@{tail}")
    return _redact_query(uri)


def _redact_query(uri: str) -> str:
    """`uri` with the value of each query parameter that names a secret masked."""
    head, q, query = uri.partition("?")
    if not q:
        return uri
    query, hash_, fragment = query.partition("#")
    pairs = parse_qsl(query, keep_blank_values=True)
    if not any(_SECRET_PARAM.search(k) for k, _ in pairs):
        return uri
    masked = [(k, "***" if _SECRET_PARAM.search(k) else v) for k, v in pairs]
    return f"{head}?{urlencode(masked, safe='*')}{hash_}{fragment}"


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


class _EnvOk:
    """Marks a field whose value a config may give as `${NAME}` (kiln_config/loader.py)."""

    def __repr__(self) -> str:
        return "ENV_OK"


ENV_OK = _EnvOk()

# A path, a folder or an address (a local path, `s3://bucket/prefix`, a scheduler's address):
# a config may give it from the environment as `${NAME}`. Other fields may not, so a secret
# put in the environment cannot slip through a field that is shown unmasked.
EnvPath = Annotated[str, ENV_OK]

# A URI that may hold credentials (a database password, a token). A JSON dump of the config
# (a Prefect flow run's parameters, anything logged) masks them; a file that must load back
# (the run's config snapshot) dumps with `context=REVEAL_SECRETS`. A config may give it as
# `${NAME}`.
SecretUri = Annotated[str, PlainSerializer(_redact_in_json, when_used="json"), ENV_OK]

REVEAL_SECRETS = {"reveal_secrets": True}


def write_private(path: Path, text: str | bytes) -> Path:
    """Write `text` (or bytes) to `path` atomically, readable by its owner alone (mode 600)
    from its first byte: for a file that holds a credential (a run's config snapshot, a run
    file), and for any file a reader must see whole or not at all.

    The temporary file beside it is created by `tempfile.mkstemp`: an unpredictable name,
    opened with O_EXCL and O_NOFOLLOW, so another user of the folder cannot plant a link or a
    file for Kiln to write through. The rename then replaces `path` itself (a link there is
    replaced, not followed).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
