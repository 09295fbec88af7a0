"""What every `kiln` command shares (`kiln_cli/main.py`, `kiln_cli/rate.py`): the `--config` and
`--root` options, options whose default is a config field's, the one way a config is loaded
and checked, and the one error translator.

Only click is imported at module level, so `kiln --help` stays fast.
"""

from __future__ import annotations

import signal
import threading
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from kiln_config import PipelineConfig

__all__ = [
    "CONFIG", "ROOT", "ConfigDefault", "KilnError", "KilnGroup", "config_options",
    "load_checked", "schema_default",
]  # fmt: skip

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
    from kiln_config import PipelineConfig

    model, *parents, leaf = PipelineConfig, *field.split(".")
    for name in parents:
        model = model.model_fields[name].annotation
    return model.model_fields[leaf].get_default(call_default_factory=True)


class ConfigDefault(click.Option):
    """An option that defaults to a config field: unset (None), the command reads the loaded
    config's value; `--help` shows the field and its schema default (imported only then)."""

    def __init__(self, *args, field: str, **kwargs) -> None:
        self.field = field
        super().__init__(*args, default=None, show_default=False, **kwargs)

    def get_help_record(self, ctx: click.Context):
        record = super().get_help_record(ctx)
        if record is None:
            return None
        opts, text = record
        return opts, f"{text}  [default: {self.field}, {schema_default(self.field)}]"


class KilnError(click.ClickException):
    """An expected failure: shown as `kiln: error: ...` lines on stderr, exit code 1."""

    def show(self, file=None) -> None:
        for line in self.format_message().splitlines() or [""]:
            click.echo(f"kiln: error: {line}", err=True, file=file)


def load_checked(
    config_path: str,
    root: str | None,
    steps: tuple[str, ...] = (),
    *,
    source: str | None = None,
    exclusive: bool = False,
) -> PipelineConfig:
    """A command's one config load: validated, overrides applied, the inputs of `steps`
    checked (`tasks.inputs.check_inputs`), before any flow (or Prefect) is imported.

    An `exclusive` command (one that takes the root's training lock, tasks/storage/lock.py) fails
    here
    too when another process holds it.
    """
    from kiln_config import load_config
    from tasks.inputs import check_inputs
    from tasks.storage.lock import busy_reason

    try:
        cfg = load_config(config_path, root=root, source=source)
    except OSError as e:  # an unreadable file: ConfigError covers a missing or invalid one
        raise KilnError(str(e)) from e
    check_inputs(cfg, steps)
    busy = exclusive and busy_reason(Path(cfg.storage.root))
    if busy:
        raise KilnError(busy)
    return cfg


def _expected(e: Exception) -> KilnError | None:
    """`e` as the one line a user acts on, or None when it is not a failure Kiln expects.

    The domain errors' modules import Prefect and MLflow: they are imported here, on the
    error path only, and only when `e` is none of the builtin kinds.
    """
    if isinstance(e, KeyError):  # the ratings store's "no such comparison"
        return KilnError(str(e.args[0]) if e.args else "KeyError")
    if isinstance(e, (ValueError, FileNotFoundError)):  # ConfigError is a ValueError
        return KilnError(str(e))
    if isinstance(e, LookupError) and not isinstance(e, IndexError):  # IndexError: a bug
        return KilnError(str(e))  # ModelVersionNotFound and its kind: a name that is not there
    from mlflow.exceptions import MlflowException

    from tasks.launch.accelerate import LaunchError
    from tasks.launch.preflight import HealthCheckError
    from tasks.quality.gate import QualityGateError
    from tasks.registry.promotion import PromotionRefused
    from tasks.storage.lock import RootBusy

    if isinstance(e, MlflowException):
        return KilnError(f"registry: {e.message}")
    if isinstance(e, (QualityGateError, LaunchError, HealthCheckError, RootBusy,
                      PromotionRefused)):  # fmt: skip
        return KilnError(str(e))
    return None


def _exit_cleanly_on_sigterm() -> None:
    """SIGTERM (systemd, Docker, a Prefect worker cancelling the run) exits like Ctrl-C: as an
    exception in the main thread, so every `finally` runs: a local launch's process group is
    killed and a SLURM job is cancelled (`scancel`) instead of being left running."""

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):  # fmt: skip
        signal.signal(signal.SIGTERM, stop)


class KilnGroup(click.Group):
    """The one error path of every `kiln` command, subgroups included: an expected failure
    is `kiln: error: <message>`; an unexpected one is one line plus a hint, unless
    `kiln --debug` was given. Exit code 1 either way.

    A flow's own failure logs (Prefect's, with the traceback) are still printed while it runs
    and kept in the UI; what this removes is the second, longer traceback of the same
    exception that Python prints on the way out.
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
            if isinstance(e, KilnError):
                raise
            raise KilnError(e.format_message()) from e
        except Exception as e:
            error = _expected(e)
            if error is not None:
                if debug:
                    traceback.print_exception(e)
                raise error from e
            if debug:
                raise
            first = (str(e).strip().splitlines() or [""])[0][:300]
            raise KilnError(
                f"{type(e).__name__}: {first} (run `kiln --debug {ctx.invoked_subcommand} ...` "
                "for the traceback)"
            ) from e
