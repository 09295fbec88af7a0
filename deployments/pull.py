"""Prefect pull steps for Kiln's deployments (`deployments/prefect.yaml`).

A process worker runs each flow run in a fresh temporary folder unless a pull step moves it. The
flows' entrypoints (`flows/entry.py:pipeline` and the other entries) and the configs they are given
(`configs/sd2-base.yaml`) are paths inside the project, so the run must start in the project folder.
`set_project_directory` finds it without any setup: `KILN_PROJECT_DIR` when set (a checkout other
than the installed one), else the checkout this `kiln` package is installed from (`make install`
installs it in editable mode).
"""

from __future__ import annotations

import os
from pathlib import Path

import flows

__all__ = ["project_directory", "set_project_directory"]


def project_directory(override: str | None = None) -> Path:
    """The Kiln checkout to run flows in.

    Args:
        override: An explicit folder (`KILN_PROJECT_DIR`); default the installed checkout.

    Raises:
        FileNotFoundError: The folder holds no `flows/pipeline.py`, with the fix.
    """
    path = Path(override) if override else Path(flows.__file__).resolve().parent.parent
    if not (path / "flows" / "pipeline.py").is_file():
        raise FileNotFoundError(
            f"{path} is not a Kiln checkout (no flows/pipeline.py): set KILN_PROJECT_DIR to the "
            "folder you cloned Kiln into, in the worker's environment"
        )
    return path


def set_project_directory() -> dict[str, str]:
    """Pull step: change into the Kiln checkout (see the module docstring)."""
    path = project_directory(os.environ.get("KILN_PROJECT_DIR") or None)
    os.chdir(path)
    return {"directory": str(path)}
