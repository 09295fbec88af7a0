"""The errors Kiln expects: a user caused them and can fix them.

Each derives from `KilnError`, and its message names what to fix: the config field and the
value received, the id that does not exist, the command to run first. `kiln` prints such an
error as one line; any other exception is a bug in Kiln and prints its traceback
(`kiln_cli/options.py`).

Each kind also derives from the builtin exception its callers already catch (`ValueError`,
`KeyError`, `FileNotFoundError`, `RuntimeError`), so raising a domain error in place of a
builtin one changes no `except` clause.
"""

from __future__ import annotations

__all__ = ["ConfigError", "InputError", "KilnError", "MissingInput", "NotFound"]


class KilnError(Exception):
    """Base of every error a user can cause and fix; its message says what to fix."""


class InputError(KilnError, ValueError):
    """A value the user gave (an option, a file's content, a URI, a query) that Kiln cannot
    use. The message names the value and what is accepted."""


class ConfigError(InputError):
    """A config file failed validation. The message names each bad field and its value."""


class NotFound(KilnError, KeyError):
    """A name the user gave (a model version, a comparison, a study, an image key) that does
    not exist where Kiln looked. A `KeyError` (so a `LookupError`) whose text is its message
    as written, not quoted."""

    def __str__(self) -> str:
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class MissingInput(KilnError, FileNotFoundError):
    """A file, or an earlier step's output, that is not there. The message names the path
    and the step (or setting) that provides it."""
