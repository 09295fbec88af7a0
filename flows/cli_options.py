"""The options every `kiln` command shares (`flows/cli.py`, `flows/rate_cli.py`).

Only click is imported here, so `kiln --help` stays fast.
"""

from __future__ import annotations

import click

__all__ = ["CONFIG", "ROOT"]

CONFIG = click.option(
    "--config",
    "config_path",
    required=True,
    type=click.Path(dir_okay=False),
    help="Pipeline YAML (e.g. configs/tiny.yaml).",
)
ROOT = click.option(
    "--root", default=None, help="Storage root: a local folder. Overrides storage.root."
)
