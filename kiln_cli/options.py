"""What every `kiln` command shares (`kiln_cli/main.py`, `kiln_cli/rate.py`): the `--config` and
`--root` options, options that set a config field, the one way a command loads its config
(through its step of the table, flows/steps.py, when it runs one), and the one error path: a
user's error is one line, a bug prints its traceback.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import traceback
from typing import Any

import click
from pydantic import BaseModel

from flows.steps import STEPS
from kiln_config import PipelineConfig, redact_uri
from kiln_config.errors import KilnError
from tasks.inputs import load_checked

__all__ = [
    "CONFIG",
    "ROOT",
    "CliError",
    "ConfigDefault",
    "KilnGroup",
    "config_options",
    "load_for_command",
    "study_for_model",
    "schema_default",
    "step_flow",
]

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


def config_options(f):
    """`--config` and `--root`: the options of every command that reads a pipeline config."""
    return CONFIG(ROOT(f))


def schema_default(field: str):
    """The schema's default of a dotted pipeline-config field (`human_eval.port`)."""
    model: type[BaseModel]
    model, *parents, leaf = PipelineConfig, *field.split(".")
    for name in parents:
        model = model.model_fields[name].annotation
    return model.model_fields[leaf].get_default(call_default_factory=True)


class ConfigDefault(click.Option):
    """An option that sets a config field. Given, it overrides the loaded config's value,
    validated by the schema like the file's own; left out, the config's value applies, and
    the config's default is the schema's. `--help` shows the field and its schema default.

    The option is not passed to the command: `load_for_command` applies it, and the command
    reads the field from the config it returns.
    """

    def __init__(self, *args, field: str, **kwargs) -> None:
        self.field = field
        super().__init__(*args, default=None, show_default=False, expose_value=False, **kwargs)

    def handle_parse_result(self, ctx: click.Context, opts, args):
        value, args = super().handle_parse_result(ctx, opts, args)
        if value is not None:
            ctx.meta.setdefault(_OVERRIDES, {})[self.field] = (self.opts[-1], value)
        return value, args

    def get_help_record(self, ctx: click.Context):
        record = super().get_help_record(ctx)
        if record is None:
            return None
        opts, text = record
        return opts, f"{text}  [default: {self.field}, {schema_default(self.field)}]"


_OVERRIDES = "kiln.config_overrides"


def _overrides() -> dict[str, tuple[str, Any]]:
    """The fields the current command's `ConfigDefault` options set: {field: (option, value)}."""
    ctx = click.get_current_context(silent=True)
    return dict(ctx.meta.get(_OVERRIDES, {})) if ctx else {}


class CliError(click.ClickException):
    """An expected failure: shown as `kiln: error: ...` lines on stderr, exit code 1."""

    def show(self, file=None) -> None:
        for line in self.format_message().splitlines() or [""]:
            click.echo(f"kiln: error: {line}", err=True, file=file)


class _Bug(click.ClickException):
    """An exception Kiln did not expect: a bug. Its traceback is printed first, then one line
    saying so; exit code 70 (EX_SOFTWARE), apart from a user's error (1)."""

    exit_code = 70

    def show(self, file=None) -> None:
        click.echo(
            f"kiln: bug: {self.format_message()} is a bug in Kiln, not a mistake in your input "
            "or config. Please report it to Kiln's maintainers with the traceback above and "
            "the command you ran.",
            err=True,
            file=file,
        )


def load_for_command(
    config_path: str,
    root: str | None,
    step: str | None = None,
    *,
    checks: tuple[str, ...] = (),
    source: str | None = None,
) -> PipelineConfig:
    """A command's one config load, before any flow (or Prefect) is imported: validated,
    overrides applied (`--root`, `--source` and the command's `ConfigDefault` options), and,
    for a command that runs a `step` of the table (flows/steps.py), that step's inputs checked
    and its training lock refused as its deployment does (`tasks.inputs.load_checked`); for
    another command, the inputs of `checks`.

    Raises:
        CliError: the config file cannot be read (a permission, a bad disk: the OS's message).
        ValueError: both a step and checks of its own given (a bug in a command).
    """
    if step is not None and checks:
        raise ValueError(f"step {step!r} checks its own inputs; got checks {checks} too")
    try:
        if step is not None:
            cfg = STEPS[step].load_config(
                config_path, root=root, source=source, overrides=_overrides()
            )
        else:
            cfg = load_checked(
                config_path, checks, root=root, source=source, overrides=_overrides()
            )
    except OSError as e:  # an unreadable file: ConfigError covers a missing or invalid one
        raise CliError(str(e)) from e
    _LOADED["registry"] = cfg.tracking_uri  # what a registry's refusal names
    return cfg


# What the running command loaded, for its error line.
_LOADED: dict[str, str] = {}

# How a tracking server says no: an HTTP status in MLflow's message, or its REST error code.
_STATUS = re.compile(r"error code (\d{3})")
_REFUSALS = {
    401: "not logged in, or a wrong login: set MLFLOW_TRACKING_USERNAME and "
    "MLFLOW_TRACKING_PASSWORD to a login the server has",
    403: "permission denied to {user}: ask the server's admin for EDIT on the registered "
    "model, or use a login that has it",
    404: "not found: {message}",
    409: "conflict, changed by someone else meanwhile (run the command again): {message}",
}
_REST_STATUS = {
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "RESOURCE_DOES_NOT_EXIST": 404,
    "RESOURCE_ALREADY_EXISTS": 409,
}


def registry_refusal(e: Exception, server: str | None) -> str:
    """The one line for an MLflow error: the server (its URI, masked) and what to do, for the
    refusals a user meets (a login missing or wrong, a permission, not found, a conflict)."""
    message = getattr(e, "message", str(e))
    found = _STATUS.search(message)
    status = int(found.group(1)) if found else _REST_STATUS.get(getattr(e, "error_code", ""))
    where = f"registry {redact_uri(server)}" if server else "registry"
    if status not in _REFUSALS:
        return f"{where}: {message}"
    user = os.environ.get("MLFLOW_TRACKING_USERNAME")
    said = _REFUSALS[status].format(
        user=f"the login {user!r}" if user else "an anonymous client", message=message
    )
    return f"{where}: {said}"


def study_for_model(cfg: PipelineConfig, ref: str) -> str:
    """The study id of a model given to `kiln evaluate --model` or `kiln compare`, generated
    unless it exists (`flows.human_evaluation.study_for_model`)."""
    # A flows module (Prefect, torch, MLflow): loaded when a command is given a model.
    from flows.human_evaluation import study_for_model as study

    return study(cfg, ref)


def _expected(e: Exception) -> str | None:
    """`e` as the one line a user acts on, or None when it is a bug in Kiln.

    Expected are Kiln's own errors (`kiln_config.errors.KilnError`), what the operating system
    refused (an `OSError`: a permission, a full disk; it names the path) and what the MLflow
    registry answered. Any other exception, a `KeyError` or `ValueError` included, is a bug.
    """
    if isinstance(e, KilnError):
        return str(e)
    if isinstance(e, OSError):
        return f"{type(e).__name__}: {e}"
    # MLflow takes 1.5 s to import: on the error path only, and only when no other type matched.
    from mlflow.exceptions import MlflowException

    if isinstance(e, MlflowException):
        return registry_refusal(e, _LOADED.get("registry"))
    return None


def step_flow(step: str):
    """The table's flow of `step`, imported, with Prefect's console made quiet about expected
    errors: a flow run that fails on one (a refusal from the registry, a missing model, a
    permission) logs its one line there, and `kiln: error:` says it again on the way out; its
    traceback goes only to the run's logs in the Prefect UI, and to the console under
    `kiln --debug`."""
    flow = STEPS[step].load_flow()  # imports Prefect, which configures its logging
    ctx = click.get_current_context(silent=True)
    if not (ctx and ctx.find_root().params.get("debug")):
        for handler in {*logging.getLogger("prefect").handlers, *logging.getLogger().handlers}:
            if isinstance(handler, logging.StreamHandler) and not hasattr(handler, "_kiln_quiet"):
                handler.emit = _quiet_emit(handler.emit)
                handler._kiln_quiet = True
    return flow


def _quiet_emit(emit):
    def quiet(record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and _expected(exc) is not None:
            # A copy: the other handlers (Prefect's API, for the UI) keep the traceback.
            record = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None})
        emit(record)

    return quiet


def _exit_cleanly_on_sigterm() -> None:
    """SIGTERM (systemd, Docker, a Prefect worker cancelling the run) exits like Ctrl-C: as an
    exception in the main thread, so every `finally` runs: a local launch's process group is
    killed and a SLURM job is cancelled (`scancel`) instead of being left running."""

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    ):
        signal.signal(signal.SIGTERM, stop)


class KilnGroup(click.Group):
    """The one error path of every `kiln` command, subgroups included. An error the user can
    fix (`_expected`) is `kiln: error: <message>`, exit code 1, with its traceback only under
    `kiln --debug`. Any other exception is a bug: its traceback, then one `kiln: bug:` line
    saying so, exit code 70. Ctrl-C stops as click makes it (`Aborted!`).

    A flow's own failure logs (Prefect's, with the traceback) are still printed while it runs
    and kept in the UI; what this removes is the second, longer traceback of an expected
    error that Python prints on the way out.
    """

    def invoke(self, ctx: click.Context):
        debug = ctx.params.get("debug", False)
        _exit_cleanly_on_sigterm()
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.Abort, click.UsageError):
            raise
        except click.ClickException as e:
            if debug:
                traceback.print_exception(e)  # the chain shows the cause's traceback
            if isinstance(e, CliError):
                raise
            raise CliError(e.format_message()) from e
        except Exception as e:
            line = _expected(e)
            if line is None:
                traceback.print_exception(e)
                first = (str(e).strip().splitlines() or [""])[0][:300]
                raise _Bug(f"{type(e).__name__}: {first}" if first else type(e).__name__) from e
            if debug:
                traceback.print_exception(e)
            raise CliError(line) from e
