"""The `kiln` command line. Every step is also a Prefect flow that can run on its own.

Heavy modules are imported inside the commands: ingest and shard start worker processes with
`spawn`, and those re-import this module, so it must stay light.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import click

__all__ = ["main"]

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
SOURCE = click.option(
    "--source",
    default=None,
    help="Raw images: a local folder or s3://bucket/prefix. Overrides ingest.source.",
)


def _call(fn, config_path: str, **kwargs):
    """Validate the config, then run a flow; expected failures end in one clear error line.

    The config is checked before any flow run starts, so a typo never reaches Prefect.
    """
    from flows.config import ConfigError, load_config
    from tasks.health import HealthCheckError
    from tasks.launch import LaunchError
    from tasks.quality import QualityGateError

    try:
        load_config(config_path, root=kwargs.get("root"), source=kwargs.get("source"))
        return fn(config_path, **kwargs)
    except (
        ConfigError,
        FileNotFoundError,
        QualityGateError,
        LaunchError,
        HealthCheckError,
        ValueError,
    ) as e:
        raise click.ClickException(str(e)) from e


def _show(result: dict) -> None:
    click.echo(json.dumps(result, indent=2, default=str))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Kiln: train a text-to-image diffusion model from scratch on your own images.

    Steps: ingest -> validate -> shard -> train -> evaluate -> register. `kiln run` chains
    them as one Prefect flow run. Without PREFECT_API_URL, flows run against Prefect's local
    embedded server; `kiln ui` shows them.
    """
    # Prefect's server telemetry cannot reach the network here and contends for the local
    # SQLite database; off unless the user has set it.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


@main.command("demo-data")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--n", default=60, show_default=True, help="Number of image files, 5 planted bad.")
@click.option("--seed", default=0, show_default=True, help="Random seed; same seed, same bytes.")
def demo_data(directory: str, n: int, seed: int) -> None:
    """Write a generated, captioned image set (imagefolder layout) to DIRECTORY.

    Coloured shapes with matching captions, in varied sizes, plus planted bad items: a
    truncated JPEG, a zero-byte file, text named .jpg, an empty caption and a duplicate.
    """
    from tasks.demo_data import write_demo_dataset

    try:
        _show(write_demo_dataset(directory, n=n, seed=seed))
    except ValueError as e:
        raise click.ClickException(str(e)) from e


@main.command()
@CONFIG
@SOURCE
@ROOT
def run(config_path: str, source: str | None, root: str | None) -> None:
    """Run the whole pipeline as one Prefect flow run (a subflow per step)."""
    from flows.pipeline import kiln_pipeline

    result = _call(kiln_pipeline, config_path, root=root, source=source)
    _show(result)
    _where(config_path, root, result)


@main.command()
@CONFIG
@SOURCE
@ROOT
def ingest(config_path: str, source: str | None, root: str | None) -> None:
    """List and decode the source; write <root>/catalog/<ingest_id>/."""
    from flows.ingest import ingest_flow

    _show(_call(ingest_flow, config_path, root=root, source=source))


@main.command()
@CONFIG
@ROOT
@click.option("--ingest-id", default=None, help="Catalog to validate (default: newest).")
def validate(config_path: str, root: str | None, ingest_id: str | None) -> None:
    """Run the Great Expectations quality gate; quarantine failing rows."""
    from flows.validate import validate_flow

    _show(_call(validate_flow, config_path, root=root, ingest_id=ingest_id))


@main.command()
@CONFIG
@ROOT
@click.option("--ingest-id", default=None, help="Validated catalog to shard (default: newest).")
def shard(config_path: str, root: str | None, ingest_id: str | None) -> None:
    """Write one MDS dataset per training stage resolution."""
    from flows.shard import shard_flow

    _show(_call(shard_flow, config_path, root=root, ingest_id=ingest_id))


@main.command()
@CONFIG
@ROOT
@click.option("--dataset-version", default=None, help="Shards to train on (default: newest).")
@click.option("--run-id", default=None, help="Resume this training run (default: a new run).")
def train(
    config_path: str, root: str | None, dataset_version: str | None, run_id: str | None
) -> None:
    """Train every stage with `accelerate launch`, resuming from checkpoints after a crash."""
    from flows.train import train_flow

    result = _call(
        train_flow, config_path, root=root, dataset_version=dataset_version, run_id=run_id
    )
    _show({k: v for k, v in result.items() if k != "stages"})


@main.command()
@CONFIG
@ROOT
@click.option(
    "--measure-steps", type=int, default=None,
    help="Measure each stage's img/s on this machine with N real training steps.",
)  # fmt: skip
@click.option(
    "--img-per-s", type=float, default=None,
    help="Per-device img/s of stage 1 (other stages scaled by FLOPs per sample).",
)  # fmt: skip
def plan(
    config_path: str, root: str | None, measure_steps: int | None, img_per_s: float | None
) -> None:
    """Print each stage's steps, samples, wall time, GPU-hours and cost, and the total.

    The plan is saved to <root>/runs/plan.json; the train flow's summary compares it with the
    actual run.
    """
    from pathlib import Path

    from flows.config import ConfigError, load_config
    from tasks.plan import format_plan, make_plan, save_plan, topology_processes

    if (measure_steps is None) == (img_per_s is None):
        raise click.UsageError("give exactly one of --measure-steps N or --img-per-s X")
    try:
        cfg = load_config(config_path, root=root)
        procs = topology_processes(cfg.launch.accelerate_config, cfg.launch.num_processes)
        result = make_plan(
            cfg.train, procs, cfg.launch.gpu_hour_usd,
            img_per_s=img_per_s, measure_steps=measure_steps,
        )  # fmt: skip
    except (ConfigError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    save_plan(result, Path(cfg.storage.root) / "runs" / "plan.json")
    click.echo(format_plan(result))


@main.command()
@CONFIG
@ROOT
@click.option("--run-id", default=None, help="Training run to evaluate (default: newest).")
def evaluate(config_path: str, root: str | None, run_id: str | None) -> None:
    """Generate images for every DrawBench prompt and seed into <root>/eval/<study_id>/."""
    from flows.evaluate import evaluate_flow

    _show(_call(evaluate_flow, config_path, root=root, run_id=run_id))


@main.command()
@CONFIG
@ROOT
@click.option("--run-id", default=None, help="Training run to register (default: newest).")
@click.option(
    "--study-id", default=None, help="Evaluation study for the lineage (default: newest)."
)
def register(config_path: str, root: str | None, run_id: str | None, study_id: str | None) -> None:
    """Log the final pipeline to MLflow, register a version and set the alias."""
    from flows.register import register_flow

    _show(_call(register_flow, config_path, root=root, run_id=run_id, study_id=study_id))


@main.command()
@click.option("--port", default=4200, show_default=True, help="Port on 127.0.0.1.")
def ui(port: int) -> None:
    """Serve the Prefect UI (flow runs, logs, artifacts) at http://127.0.0.1:PORT."""
    prefect = shutil.which("prefect", path=str(Path(sys.executable).parent)) or "prefect"
    os.execv(prefect, [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)])


@main.command("mlflow-ui")
@CONFIG
@ROOT
@click.option("--port", default=5000, show_default=True, help="Port on 127.0.0.1.")
def mlflow_ui(config_path: str, root: str | None, port: int) -> None:
    """Serve the MLflow UI (runs, metrics, registry) for the config's tracking URI."""
    from flows.config import load_config

    cfg = _call(load_config, config_path, root=root)
    mlflow = shutil.which("mlflow", path=str(Path(sys.executable).parent)) or "mlflow"
    cmd = [
        mlflow,
        "ui",
        "--backend-store-uri",
        cfg.tracking_uri,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    raise SystemExit(subprocess.call(cmd))


def _where(config_path: str, root: str | None, result: dict) -> None:
    from flows.config import load_config

    cfg = load_config(config_path, root=root)
    r = Path(cfg.storage.root)
    ing = result["ingest"]["ingest_id"]
    lines = [
        "",
        "Kiln pipeline finished. Outputs:",
        f"  catalog      {r / 'catalog' / ing}/{{accepted,quarantine,clean}}.parquet",
        f"  quality      {r / 'quality' / ing / 'summary.json'}",
        f"  shards       {r / 'shards' / result['shards']['dataset_version']}/",
        f"  model export {result['run']['export']}",
        f"  DrawBench    {result['study']['path']}/ ({result['study']['images']} images)",
        f"  registry     {result['model']['uri_by_alias']} (version {result['model']['version']})",
        f"  tracking     {cfg.tracking_uri}",
        "",
        "Open the UIs:",
        "  Prefect  kiln ui                          -> http://127.0.0.1:4200",
        f"  MLflow   kiln mlflow-ui --config {config_path} -> http://127.0.0.1:5000",
    ]
    click.echo("\n".join(lines))


if __name__ == "__main__":
    main()
