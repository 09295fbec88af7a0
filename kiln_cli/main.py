"""The `kiln` command line. Every step is also a Prefect flow that can run on its own.

A command that runs a step of the table (flows/steps.py) loads its config through that step
(its inputs checked as its deployment checks them), then imports and runs its flow. Prefect,
torch and MLflow load only when a command needs them: `kiln --help` and a config error come
back in about a second.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import click
import psutil

from deployments.stack import main as stack_main
from flows.steps import check_id_params
from kiln_cli.catalog import catalog
from kiln_cli.lineage import lineage, takedown
from kiln_cli.options import (
    CONFIG,
    ROOT,
    CliError,
    ConfigDefault,
    KilnGroup,
    config_options,
    load_for_command,
    step_flow,
    study_for_model,
)
from kiln_cli.rate import compare, rate
from kiln_config import redact_uri
from kiln_demo.data import write_demo_dataset
from tasks.planning.topology import processes_per_machine, stage_processes
from tasks.storage.layout import Layout

__all__ = ["PREFECT_UI_PORT", "main"]

PREFECT_UI_PORT = 4200
"""Where `kiln ui` serves the Prefect UI unless given `--port`."""

ALLOW_FAILED_GATE = click.option(
    "--allow-failed-gate",
    is_flag=True,
    help="Shard a catalog that failed the quality gate (recorded in its shards.json).",
)
SOURCE = click.option(
    "--source",
    default=None,
    help="Raw images: a local folder or s3://bucket/prefix. Overrides ingest.source.",
)


def _run_step(
    step: str, config_path: str, root: str | None, *, source: str | None = None, **kwargs
):
    """Load and check the config once through the table's `step`, then run its flow on it.

    Before any flow run starts (and before Prefect is even imported), the schema is validated
    and the step's input checks run (`kiln_cli.options.load_for_command`), so a typo or a missing
    file never reaches Prefect. The flow gets the loaded config object, not the user's file,
    which may change while it runs.

    Returns:
        (the loaded config, the flow's result).
    """
    check_id_params(kwargs, lambda name: "--" + name.replace("_", "-"))
    cfg = load_for_command(config_path, root, step, source=source)
    return cfg, step_flow(step)(cfg, **kwargs)


def _show(result: dict) -> None:
    click.echo(json.dumps(result, indent=2, default=str))


@click.group(cls=KilnGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show the traceback of an error, not one line.")
def main(debug: bool) -> None:
    """Kiln: train a text-to-image diffusion model from scratch on your own images.

    Steps: ingest -> validate -> shard -> train -> evaluate -> register. `kiln run` chains
    them as one Prefect flow run. Without PREFECT_API_URL, flows run against Prefect's local
    embedded server; `kiln ui` shows them. Before any flow starts, the inputs it needs are
    checked (source, topology, tracking folder, prompts): a missing one is one line.
    """
    # Prefect's server telemetry cannot reach the network here and contends for the local
    # SQLite database; off unless the user has set it.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # The embedded server gets 20 s to answer by default; a busy laptop (training, or the
    # test suite on 2 cores) can need longer, and then every command failed at start.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")


@main.command("demo-data")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option(
    "--n",
    default=60,
    show_default=True,
    type=click.IntRange(min=8),
    help="Number of image files, 5 planted bad.",
)
@click.option("--seed", default=0, show_default=True, help="Random seed; same seed, same bytes.")
def demo_data(directory: str, n: int, seed: int) -> None:
    """Write a generated, captioned image set (imagefolder layout) to DIRECTORY.

    Coloured shapes with matching captions, in varied sizes, plus planted bad items: a
    truncated JPEG, a zero-byte file, text named .jpg, an empty caption and a duplicate.
    """
    _show(write_demo_dataset(directory, n=n, seed=seed))


@main.command()
@config_options
@SOURCE
@ALLOW_FAILED_GATE
def run(config_path: str, source: str | None, root: str | None, allow_failed_gate: bool) -> None:
    """Run the whole pipeline as one Prefect flow run (a subflow per step)."""
    cfg, result = _run_step(
        "pipeline", config_path, root, source=source, allow_failed_gate=allow_failed_gate
    )
    _show(result)
    _where(cfg, config_path, result)


@main.command()
@config_options
@SOURCE
def ingest(config_path: str, source: str | None, root: str | None) -> None:
    """List and decode the source; write <root>/catalog/<ingest_id>/."""
    _show(_run_step("ingest", config_path, root, source=source)[1])


@main.command()
@config_options
@click.option("--ingest-id", default=None, help="Catalog to validate (default: newest).")
def validate(config_path: str, root: str | None, ingest_id: str | None) -> None:
    """Run the Great Expectations quality gate; quarantine failing rows."""
    _show(_run_step("validate", config_path, root, ingest_id=ingest_id)[1])


@main.command()
@config_options
@click.option("--ingest-id", default=None, help="Validated catalog to shard (default: newest).")
@ALLOW_FAILED_GATE
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print the dataset version and each stage's image counts; write nothing.",
)
def shard(
    config_path: str,
    root: str | None,
    ingest_id: str | None,
    allow_failed_gate: bool,
    dry_run: bool,
) -> None:
    """Write one MDS dataset per training stage resolution."""
    _show(
        _run_step(
            "shard",
            config_path,
            root,
            ingest_id=ingest_id,
            allow_failed_gate=allow_failed_gate,
            dry_run=dry_run,
        )[1]
    )


@main.command()
@config_options
@click.option("--dataset-version", default=None, help="Shards to train on (default: newest).")
@click.option("--run-id", default=None, help="Resume this training run (default: a new run).")
def train(
    config_path: str, root: str | None, dataset_version: str | None, run_id: str | None
) -> None:
    """Train every stage with `accelerate launch`, resuming from checkpoints after a crash."""
    _, result = _run_step(
        "train", config_path, root, dataset_version=dataset_version, run_id=run_id
    )
    _show({k: v for k, v in result.items() if k not in ("stages", "config")})


@main.command()
@config_options
@click.option(
    "--measure-steps",
    type=int,
    default=None,
    help="Measure each stage's img/s on this machine with N real training steps.",
)
@click.option(
    "--img-per-s",
    type=float,
    default=None,
    help="Per-device img/s of stage 1 (other stages scaled by FLOPs per sample).",
)
@click.option(
    "--gpus-per-node",
    type=click.IntRange(min=1),
    default=None,
    help="Another team's nodes: GPUs on each (each stage's world: its num_machines times this).",
)
@click.option(
    "--gpu-memory-gb",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Memory of each GPU in GB (default launch.gpu_memory_gb).",
)
@click.option(
    "--inter-node-gbps",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Network bandwidth of each node in Gbit/s (default launch.inter_node_gbps).",
)
def plan(
    config_path: str,
    root: str | None,
    measure_steps: int | None,
    img_per_s: float | None,
    gpus_per_node: int | None,
    gpu_memory_gb: float | None,
    inter_node_gbps: float | None,
) -> None:
    """Print each stage's steps, samples, wall time, GPU-hours and cost, and the total; its
    memory per GPU by component (and what to change where it does not fit launch.gpu_memory_gb),
    and its step time and scaling efficiency on 1 to 16 nodes.

    The plan is saved to <root>/runs/plan.json; the train flow's summary compares it with the
    actual run.
    """
    # The planner traces the UNet's activations with torch (2 s to import): loaded here, for
    # `kiln plan` alone.
    from tasks.planning.budget import (
        format_memory,
        format_plan,
        make_plan,
        memory_and_scale,
        save_plan,
    )

    if (measure_steps is None) == (img_per_s is None):
        raise click.UsageError("give exactly one of --measure-steps N or --img-per-s X")
    cfg = load_for_command(config_path, root, checks=("topology",))
    given = {"gpu_memory_gb": gpu_memory_gb, "inter_node_gbps": inter_node_gbps}
    launch = cfg.launch.model_copy(update={k: v for k, v in given.items() if v is not None})
    worlds = stage_processes(launch, cfg.train)
    if gpus_per_node:
        worlds = [s.num_machines * gpus_per_node for s in cfg.train.stages]
    try:
        result = make_plan(
            cfg.train,
            worlds,
            launch.gpu_hour_usd,
            img_per_s=img_per_s,
            measure_steps=measure_steps,
            val_samples=_val_samples(cfg),
            processes_per_machine=gpus_per_node or processes_per_machine(launch),
        )
        memory_and_scale(result, cfg.train, launch, cfg.shards.precompute, gpus_per_node)
    except OSError as e:  # an unreadable topology or shards.json
        raise CliError(str(e)) from e
    save_plan(result, Layout(Path(cfg.storage.root)).plan())
    click.echo(format_plan(result))
    click.echo()
    click.echo(format_memory(result))


def _val_samples(cfg) -> list[int] | None:
    """Each stage's validation split size in the newest dataset version (shards.json), so the
    plan counts the held-out evaluations; None before `kiln shard` has run."""
    layout = Layout(Path(cfg.storage.root))
    version = layout.latest_or_none("shards")
    path = layout.shards(version) / "shards.json" if version else None
    if path is None or not path.is_file():
        return None
    stages = json.loads(path.read_text()).get("stages", {})
    return [int(stages.get(str(s.resolution), {}).get("val_samples", 0)) for s in cfg.train.stages]


@main.command()
@config_options
@click.option("--run-id", default=None, help="Training run to evaluate (default: newest).")
@click.option(
    "--model",
    default=None,
    help="Evaluate a model instead of a run: models:/NAME@ALIAS, models:/NAME/VERSION or an "
    "exported pipeline folder (same prompts, seeds and settings; an existing study is reused).",
)
def evaluate(config_path: str, root: str | None, run_id: str | None, model: str | None) -> None:
    """Generate images for each evaluation prompt and seed into <root>/eval/<study_id>/: the
    prompts the config names (`evaluate.prompts_csv`, the preset's own or DrawBench).

    With --model, the study of any registered model or pipeline folder, generated with the
    config's `evaluate` settings unless it exists (content-addressed); prints its id and path.
    """
    if model and run_id:
        raise CliError("--model and --run-id exclude each other: pass one")
    if not model:
        _show(_run_step("evaluate", config_path, root, run_id=run_id)[1])
        return
    cfg = load_for_command(config_path, root, "evaluate")
    study_id = study_for_model(cfg, model)
    _show({"study_id": study_id, "path": str(Layout(Path(cfg.storage.root)).study(study_id))})


@main.command()
@config_options
@click.option("--run-id", default=None, help="Training run to register (default: newest).")
@click.option(
    "--study-id", default=None, help="Evaluation study for the lineage (default: newest)."
)
def register(config_path: str, root: str | None, run_id: str | None, study_id: str | None) -> None:
    """Log the final pipeline to MLflow, register a version and set the alias."""
    _show(
        _run_step(
            "register",
            config_path,
            root,
            run_id=run_id,
            study_id=study_id,
        )[1]
    )


@main.command()
@config_options
@click.option(
    "--model",
    required=True,
    help="models:/NAME@ALIAS, models:/NAME/VERSION or an exported pipeline folder.",
)
@click.option("--prompt", required=True, help="What to draw.")
@click.option("--n", "n", type=int, default=4, show_default=True, help="Images (one seed each).")
@click.option("--seed", type=int, default=0, show_default=True, help="First seed.")
@click.option(
    "--steps",
    type=int,
    cls=ConfigDefault,
    field="evaluate.num_inference_steps",
    help="Inference steps.",
)
@click.option(
    "--guidance", type=float, cls=ConfigDefault, field="evaluate.guidance_scale", help="CFG scale."
)
@click.option("--out", default="generated", show_default=True, help="Folder for the PNGs.")
def generate(
    config_path: str, root: str | None, model: str, prompt: str, n: int, seed: int, out: str
) -> None:
    """Generate PNG files from a registered model (or an export) for one prompt."""
    # MLflow and diffusers (seconds to import), for this command alone.
    from tasks.evaluation.generate import generate_pngs

    cfg = load_for_command(config_path, root)
    ev = cfg.evaluate  # --steps and --guidance applied
    try:
        result = generate_pngs(
            model,
            cfg.tracking_uri,
            Path(cfg.storage.root),
            prompt,
            Path(out),
            n=n,
            seed=seed,
            steps=ev.num_inference_steps,
            guidance_scale=ev.guidance_scale,
        )
    except OSError as e:  # an unwritable --out
        raise CliError(str(e)) from e
    _show(result)


@main.command()
@config_options
@click.option(
    "--candidate",
    default=None,
    help="models:/NAME@ALIAS or models:/NAME/VERSION (default: the registry alias, candidate).",
)
@click.option("--first", is_flag=True, help="Promote with no champion yet.")
@click.option("--force", is_flag=True, help="Promote past a refused gate (needs --reason).")
@click.option("--reason", default=None, help="Why (recorded on the version).")
@click.option(
    "--allow-takedown",
    is_flag=True,
    help="Promote a candidate whose dataset holds taken-down images (needs --reason).",
)
def promote(
    config_path: str,
    root: str | None,
    candidate: str | None,
    first: bool,
    force: bool,
    reason: str | None,
    allow_takedown: bool,
) -> None:
    """Move the `champion` alias to the candidate if the gate (registry.gate) passes.

    The gate reads the candidate's human-evaluation comparison against the current champion
    from MLflow: enough votes on every pair, the 95% CI of its preference at or above
    min_pref_ci_low for quality and alignment, no prompt category below
    min_category_pref, and no worse validation loss. The old champion becomes
    `previous-champion`; `kiln rollback` swaps them back. A candidate whose dataset holds a
    taken-down image is refused unless --allow-takedown --reason says why.
    """
    _show(
        _run_step(
            "promote",
            config_path,
            root,
            candidate=candidate,
            first=first,
            force=force,
            reason=reason,
            allow_takedown=allow_takedown,
        )[1]
    )


@main.command()
@config_options
@click.option("--reason", default=None, help="Why (recorded on both versions).")
def rollback(config_path: str, root: str | None, reason: str | None) -> None:
    """Swap `champion` and `previous-champion` back."""
    _show(_run_step("rollback", config_path, root, reason=reason)[1])


@main.command()
@click.option("--port", default=PREFECT_UI_PORT, show_default=True, help="Port on 127.0.0.1.")
def ui(port: int) -> None:
    """Serve the Prefect UI (flow runs, logs, artifacts) at http://127.0.0.1:PORT."""
    os.environ.update(_ui_env(port, os.environ))
    prefect = shutil.which("prefect", path=str(Path(sys.executable).parent)) or "prefect"
    os.execv(prefect, [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)])


def _ui_env(port: int, env) -> dict[str, str]:
    """The settings that make the UI served on `port` call the API on the same port.

    The UI asks the server (`/ui-settings`) where its API is, and Prefect answers from
    PREFECT_API_URL or PREFECT_SERVER_API_PORT, never from `--port`: without this, a UI on
    4301 calls the API on 4200. A UI API URL the user has set (a reverse proxy) is kept.
    """
    if env.get("PREFECT_SERVER_UI_API_URL") or env.get("PREFECT_UI_API_URL"):
        return {}
    return {"PREFECT_SERVER_UI_API_URL": f"http://127.0.0.1:{port}/api"}


@main.command(
    context_settings={"ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def stack(args: tuple[str, ...]) -> None:
    """A team's services on this machine: PostgreSQL, S3, the Prefect server and a worker,
    MLflow with logins, the rating app (`kiln stack --help`; docs/operations.md)."""
    raise SystemExit(stack_main(list(args)))


@main.command("mlflow-ui")
@CONFIG
@ROOT
@click.option("--port", default=5000, show_default=True, help="Port on 127.0.0.1.")
def mlflow_ui(config_path: str, root: str | None, port: int) -> None:
    """Serve the MLflow UI (runs, metrics, registry) for the config's tracking URI."""
    cfg = load_for_command(config_path, root)
    raise SystemExit(_mlflow_ui(cfg.tracking_uri, port, runner=_stops_its_tree(subprocess.call)))


class _Stopped(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


# SIGHUP too: in a session of its own, the command no longer gets the terminal's hang-up.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _stops_its_tree(call):
    """`call` (subprocess.call) that, on SIGTERM, SIGINT or SIGHUP, stops every process it
    started, their children included, and returns 0, as a server stopped on request does.

    `mlflow ui` serves from a uvicorn child with worker processes of its own and does not
    pass SIGTERM on: stopping only `mlflow ui` (as systemd, Docker or a process manager
    would) left uvicorn serving, orphaned. The tree is listed in the handler, while its
    parent still holds it together; a member still up after 10 s is killed. The command
    runs in a process group of its own, which is killed last: uvicorn replaces a worker
    that exits until it handles its own SIGTERM, and a worker started in that moment is in
    no list (and, once its parent is gone, no longer a child of anyone here).
    """

    def run(argv, **kwargs):
        tree: list = []
        groups: set[int] = set()

        def stop(signum, _frame):
            for sig in _STOP_SIGNALS:  # one stop at a time
                signal.signal(sig, signal.SIG_IGN)
            tree.extend(psutil.Process().children(recursive=True))
            for proc in tree:
                with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):  # gone
                    groups.add(os.getpgid(proc.pid))
                    proc.terminate()
            raise _Stopped(signum)

        handlers = {sig: signal.signal(sig, stop) for sig in _STOP_SIGNALS}
        try:
            return call(argv, start_new_session=True, **kwargs)
        except _Stopped:
            _, alive = psutil.wait_procs(tree, timeout=10)
            for proc in alive:
                proc.kill()
            psutil.wait_procs(alive, timeout=10)
            for group in groups - {os.getpgrp()}:
                with contextlib.suppress(ProcessLookupError):  # the whole group is gone
                    os.killpg(group, signal.SIGKILL)
            return 0
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    return run


def _mlflow_ui(tracking_uri: str, port: int, runner) -> int:
    """Run `mlflow ui` for `tracking_uri` with `runner(argv, env=...)` (subprocess.call).

    The URI can hold database credentials, and any user sees a process's argv (`ps`): it goes
    through the environment (`MLFLOW_BACKEND_STORE_URI`, which `mlflow ui` reads), never argv.
    """
    mlflow = shutil.which("mlflow", path=str(Path(sys.executable).parent)) or "mlflow"
    cmd = [mlflow, "ui", "--host", "127.0.0.1", "--port", str(port)]
    click.echo(f"MLflow UI for {redact_uri(tracking_uri)} at http://127.0.0.1:{port}", err=True)
    return runner(cmd, env={**os.environ, "MLFLOW_BACKEND_STORE_URI": tracking_uri})


def _where(cfg, config_path: str, result: dict) -> None:
    layout = Layout(Path(cfg.storage.root))
    ing = result["ingest"]["ingest_id"]
    lines = [
        "",
        "Kiln pipeline finished. Outputs:",
        f"  catalog      {layout.catalog(ing)}/ (the ingest's rows, verdict.json, rejects)",
        f"  quality      {layout.quality(ing) / 'summary.json'}",
        f"  shards       {layout.shards(result['shards']['dataset_version'])}/",
        f"  config       {layout.run_config(result['run']['run_id'])} (as run)",
        f"  model export {result['run']['export']}",
        f"  study        {result['study']['path']}/ ({result['study']['images']} images of the "
        f"{result['study']['prompts']} prompts)",
        f"  registry     {result['model']['uri_by_alias']} (version {result['model']['version']})",
        f"  tracking     {redact_uri(cfg.tracking_uri)}",
        "",
        "Open the UIs:",
        f"  Prefect  kiln ui                          -> http://127.0.0.1:{PREFECT_UI_PORT}",
        f"  MLflow   kiln mlflow-ui --config {config_path} (prints its address)",
    ]
    click.echo("\n".join(lines))


for _command in (compare, rate, lineage, takedown, catalog):
    main.add_command(_command)


if __name__ == "__main__":  # python -m kiln_cli.main, as python -m kiln_cli
    main()
