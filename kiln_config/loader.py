"""Reading a YAML config: `base:` files merged underneath, and validation errors rendered as
one line per bad field (its dotted path and the value received).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ValidationError,
)

from kiln_config.base import ENV_OK, ConfigError, redact_text

__all__ = [
    "apply_overrides",
    "env_fields",
    "expand_env",
    "format_validation_error",
    "load_yaml_model",
    "read_yaml",
]


# "Value error, train.stages.1.num_machines: ..." : a model validator's message that already
# starts with the field's dotted path.
_NAMED = re.compile(r"^Value error, ([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)+: .*)$", re.DOTALL)


def format_validation_error(err: ValidationError, source: str) -> str:
    """Render each error as `dotted.path: message (received value)`."""
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        own = _NAMED.match(e["msg"]) if e["type"] == "value_error" else None
        if own:  # a check across fields that names the field and the value itself
            lines.append(f"  {own.group(1)}")
            continue
        path = ".".join(str(p) for p in e["loc"]) or "<root>"
        lines.append(f"  {path}: {e['msg']} (received {_shown(path, e.get('input'))})")
    return "\n".join(lines)


# Field names whose values are credentials: a message never shows them.
_SECRET_FIELD = re.compile(r"pass|secret|token|credential|api_?key|private", re.IGNORECASE)


def _shown(path: str, value: Any) -> str:
    """A received value as an error message shows it: a credential field's not at all, any
    URI in it with its secrets masked (`redact_uri`: a misspelt `database_url` key holding
    `postgresql://user:password@host/db` must not print the password), cut at 120
    characters."""
    if _SECRET_FIELD.search(path):
        return "a value, not shown: the field holds a secret"
    shown = repr(_redacted(value))
    return shown[:117] + "..." if len(shown) > 120 else shown


def _redacted(value: Any) -> Any:
    """`value` with every string in it (mappings and lists included) through `redact_text`."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {k: _redacted(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_redacted(v) for v in value)
    return value


def _merge(base: dict, over: dict) -> dict:
    """`over` on top of `base`: mappings merge key by key; lists and scalars replace."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# `${NAME}` in a string value: the environment variable NAME, so that a credential (a database
# URL's password, a tracking server's address) is given by the service's environment, not
# written in the file. Only fields that take a secret or a path read the environment
# (`SecretUri` and `EnvPath` in the schema): a secret given to any other field would be shown
# wherever the config is (Prefect's parameters, MLflow's params, messages).
# `${NAME:-default}` gives `default` where NAME is unset or empty; a value that is one such
# reference and comes out empty leaves the field unset (its default). A plain `${NAME}` that
# is set but empty is an error: an empty variable would otherwise silently fall back to the
# field's default (a local registry instead of the team's).
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


_UNSET = object()  # a field given as one reference that came out empty: left at its default


def env_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    """The dotted fields of `model` that may be given as `${NAME}` (`*` stands for a list's
    index or a mapping's key)."""
    out: list[str] = []
    for name, field in model.model_fields.items():
        _collect(field.annotation, list(field.metadata), f"{prefix}{name}", out)
    return out


def _collect(annotation: Any, metadata: list, path: str, out: list[str]) -> None:
    if any(m is ENV_OK for m in metadata):
        out.append(path)
        return
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        _collect(args[0], list(annotation.__metadata__), path, out)
    elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
        out.extend(env_fields(annotation, f"{path}."))
    elif origin in (list, tuple):
        for a in args:
            _collect(a, [], f"{path}.*", out)
    elif origin is dict:
        _collect(args[1], [], f"{path}.*", out)
    else:  # a union (`X | None`)
        for a in args:
            _collect(a, [], path, out)


def _allowed(where: str, fields: list[str]) -> bool:
    parts = where.split(".")
    return any(
        len(f.split(".")) == len(parts)
        and all(p == "*" or p == w for p, w in zip(f.split("."), parts, strict=True))
        for f in fields
    )


def expand_env(data: Any, where: str = "", fields: list[str] | None = None) -> Any:
    """`data` with each `${NAME}` in its strings replaced by the environment variable NAME.

    Args:
        fields: The dotted fields that may hold a reference (`env_fields` of the model the
            data is for); None: any.

    Raises:
        ConfigError: naming the field and the variable, where one is not set or is empty, or
            where the field does not take a secret or a path.
    """
    if isinstance(data, dict):
        out = {
            k: expand_env(v, f"{where}.{k}" if where else str(k), fields) for k, v in data.items()
        }
        return {k: v for k, v in out.items() if v is not _UNSET}
    if isinstance(data, list):
        out = [expand_env(v, f"{where}.{i}", fields) for i, v in enumerate(data)]
        return [v for v in out if v is not _UNSET]
    if not isinstance(data, str) or "${" not in data:
        return data
    if fields is not None and _ENV_REF.search(data) and not _allowed(where, fields):
        raise ConfigError(
            f"{where}: ${{NAME}} is read from the environment only in the fields that take a "
            'secret or a path (docs/operations.md, "Credentials from the environment"); '
            "write this value in the file"
        )

    def value(m: re.Match) -> str:
        name, default = m.group(1), m.group(2)
        if default is not None:
            return os.environ.get(name) or default
        if name not in os.environ:
            raise ConfigError(
                f"{where}: the environment variable {name} is not set (the value is "
                f"${{{name}}}: set it in the environment of every process that loads this "
                "config, such as the Prefect worker's)"
            )
        if not os.environ[name]:
            raise ConfigError(
                f"{where}: the environment variable {name} is empty (set it, or write "
                f"${{{name}:-}} to leave the field at its default where it is empty)"
            )
        return os.environ[name]

    out = _ENV_REF.sub(value, data)
    given = "".join(os.environ.get(m.group(1), "") for m in _ENV_REF.finditer(data))
    if "${" in out and "${" not in given:  # left over, and not from a variable's own value
        raise ConfigError(
            f"{where}: a malformed ${{...}} reference in {redact_text(data)!r} (write "
            "${NAME} or ${NAME:-default})"
        )
    return _UNSET if out == "" and _ENV_REF.fullmatch(data) else out


def read_yaml(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict:
    """A YAML mapping, with its `base:` file (relative to its folder) merged underneath.

    `base: tiny.yaml` lets a variant state only what differs from a preset. The merge is by
    key: mappings merge, lists (such as `train.stages`) and scalars replace. Relative paths in
    either file resolve against the folder of the file Kiln was given.

    Raises:
        ConfigError: A missing file, invalid YAML, a non-mapping, or a `base:` cycle.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    if path.resolve() in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, path.resolve()))
        raise ConfigError(f"base: the configs include each other ({chain})")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config {path} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"base: expected the path of a config file (received {base!r})")
    seen = (*_seen, path.resolve())
    try:
        under = read_yaml(path.parent / base, seen)
    except ConfigError as e:
        raise ConfigError(f"{path}: base: {e}") from None
    return _merge(under, data)


def load_yaml_model(model: type[BaseModel], path: str | Path, *, env: bool = False) -> Any:
    """Load a YAML file (and its `base:`) into `model`, raising :class:`ConfigError` with
    dotted field paths.

    Args:
        env: Expand `${NAME}` in the fields that take a secret or a path (a user's config).
            A file Kiln wrote (a run file, a config snapshot) holds values as they were
            loaded and is read as it is: a password that holds `${` is not expanded again.
    """
    path = Path(path)
    data = read_yaml(path)
    if env:
        try:
            data = expand_env(data, fields=env_fields(model))
        except ConfigError as e:
            raise ConfigError(f"invalid config {path}: {e}") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, str(path))) from None


def apply_overrides(config: BaseModel, overrides: dict[str, tuple[str, Any]]) -> None:
    """Set dotted fields of a loaded config (`human_eval.port`), each validated by the schema
    as the file's own value is.

    Args:
        config: The loaded config, changed in place.
        overrides: {dotted field: (what set it, for the message: `--port`; its value)}.

    Raises:
        ConfigError: a value the schema refuses, naming what set it, the field and the value.
    """
    for name, (label, value) in overrides.items():
        *parents, leaf = name.split(".")
        section = config
        for part in parents:
            section = getattr(section, part)
        try:
            type(section).__pydantic_validator__.validate_assignment(section, leaf, value)
        except ValidationError as e:
            msg = e.errors()[0]["msg"]
            raise ConfigError(f"{label} ({name}): {msg} (received {_shown(name, value)})") from None
