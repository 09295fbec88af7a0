"""The logger for task code: Prefect's run logger inside a run, a plain logger outside one."""

from __future__ import annotations

import logging

from prefect import get_run_logger
from prefect.exceptions import MissingContextError

__all__ = ["task_logger"]


def task_logger(name: str) -> logging.Logger | logging.LoggerAdapter:
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(name)
