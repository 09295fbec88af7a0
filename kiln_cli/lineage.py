"""`kiln lineage ...` and `kiln takedown ...`: licensed data, traced.

    kiln lineage image KEY_OR_PATH          dataset versions, runs and registered versions
                                            that included the image
    kiln lineage model models:/NAME/N       its dataset version, rows by source, license and
                                            contributor, each contributor's draws per stage
                                            (--csv FILE: the revenue-share report)
    kiln takedown add --key K | --contributor C | --file keys.csv --reason TEXT
    kiln takedown list

The registry's lineage and the takedown flow load MLflow and Prefect, so they are imported by
the commands that use them.
"""

from __future__ import annotations

import json

import click
import pandas as pd

from kiln_cli.options import config_options, load_for_command, step_flow
from tasks.catalog.takedown import read_keys_file, read_takedowns

__all__ = ["lineage", "takedown"]


def _table(df) -> str:
    """The whole frame as text: every column, however wide."""
    with pd.option_context(
        "display.width", None, "display.max_columns", None, "display.max_colwidth", None
    ):
        return df.to_string(index=False) if len(df) else "(none)"


def _registry_lineage():
    """`tasks.registry.model_lineage`, loaded by the two commands that read the registry: it
    imports MLflow and Prefect (seconds), which the other commands do without."""
    from tasks.registry import model_lineage

    return model_lineage


@click.group()
def lineage() -> None:
    """Which images trained which model, and how often each contributor's were drawn."""


@lineage.command("image")
@config_options
@click.argument("key_or_path")
def lineage_image(config_path: str, root: str | None, key_or_path: str) -> None:
    """The dataset versions, training runs and registered versions that included an image.

    KEY_OR_PATH is its catalog key (`00001.jpg`) or `<source>/<key>`.
    """
    cfg = load_for_command(config_path, root)
    found = _registry_lineage().image_lineage(
        cfg.storage.root, cfg.tracking_uri, cfg.registry.model_name, key_or_path, cfg.quality
    )
    click.echo(f"image {key_or_path}: in {len(found)} dataset version(s)")
    click.echo(_table(found))


@lineage.command("model")
@config_options
@click.argument("model_uri")
@click.option(
    "--csv",
    "csv_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Also write the contributors' report (revenue share) to this CSV file.",
)
def lineage_model(config_path: str, root: str | None, model_uri: str, csv_path: str | None) -> None:
    """What a registered version (models:/NAME/N or models:/NAME@ALIAS) trained on."""
    cfg = load_for_command(config_path, root)
    info = _registry_lineage().model_lineage(
        cfg.storage.root, cfg.tracking_uri, model_uri, cfg.quality
    )
    aliases = f" ({', '.join(info['aliases'])})" if info["aliases"] else ""
    click.echo(
        f"{info['name']} version {info['version']}{aliases}: run {info['run_id']}, "
        f"dataset version {info['dataset_version']} ({info['images']} images); "
        f"earliest license end {info['earliest_license_end'] or 'none'}"
    )
    click.echo("\nRows by source, license and contributor:\n" + _table(info["rows"]))
    if not info["exposure_recorded"]:
        click.echo("\n(draws not recorded: the run trained with train.log_sample_keys off)")
    click.echo("\nContributors (draws per stage):\n" + _table(info["report"]))
    if csv_path:
        info["report"].to_csv(csv_path, index=False)
        click.echo(f"\nwrote {csv_path}")


@click.group()
def takedown() -> None:
    """The takedown list: images and contributors withdrawn from every future dataset."""


@takedown.command("add")
@config_options
@click.option("--key", "keys", multiple=True, help="An image: catalog key or <source>/<key>.")
@click.option("--contributor", default=None, help="Every image of this contributor.")
@click.option(
    "--file",
    "keys_file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="A CSV with a `key` column (or one key per line).",
)
@click.option("--reason", required=True, help="Why (recorded with who and when).")
@click.option("--by", default=None, help="Who asked (default: the current user).")
def takedown_add(
    config_path: str,
    root: str | None,
    keys: tuple[str, ...],
    contributor: str | None,
    keys_file: str | None,
    reason: str,
    by: str | None,
) -> None:
    """Append to the takedown list; the next validate quarantines those rows, registered
    versions holding them are tagged, and a retrain is due if the newest training saw one."""
    given = [
        n for n, v in (("--key", keys), ("--contributor", contributor), ("--file", keys_file)) if v
    ]
    if len(given) != 1:
        raise click.UsageError(f"give exactly one of --key, --contributor, --file (got {given})")
    cfg = load_for_command(config_path, root, "takedown")
    wanted = list(keys) or (read_keys_file(keys_file) if keys_file else None)
    result = step_flow("takedown")(cfg, reason=reason, keys=wanted, contributor=contributor, by=by)
    click.echo(json.dumps(result, indent=2, default=str))


@takedown.command("list")
@config_options
def takedown_list(config_path: str, root: str | None) -> None:
    """Every addition to the takedown list: when, who, why, and what."""
    cfg = load_for_command(config_path, root)
    click.echo(_table(read_takedowns(cfg.storage.root)))
