"""`kiln catalog ...`: the catalog's Delta tables for a data team.

kiln catalog show                       table versions, rows by source and by quarantine
                                        reason, the commit history
kiln catalog sql "SELECT ..."           DuckDB over `clean`, `accepted`, `quarantine`
                                        (--version N: the accepted table at version N)
kiln catalog export OUT --format csv    the clean view as Parquet or CSV
kiln catalog compact                    compact small files, vacuum old ones
kiln catalog migrate                    move a chain-layout catalog into the tables, once
"""

from __future__ import annotations

import json

import click
import duckdb

from kiln_cli.options import CliError, config_options, load_for_command
from tasks.catalog.admin import compact, export, migrate, query, registered_versions, show

__all__ = ["catalog"]


@click.group()
def catalog() -> None:
    """The catalog's Delta tables: inspect, query, export, compact, migrate."""


@catalog.command("show")
@config_options
def catalog_show(config_path: str, root: str | None) -> None:
    """The current table versions, rows by source and by quarantine reason, and history."""
    cfg = load_for_command(config_path, root)
    click.echo(json.dumps(show(cfg.storage.root), indent=2, default=str))


@catalog.command("sql")
@config_options
@click.argument("statement")
@click.option(
    "--version",
    "version",
    type=int,
    default=None,
    help="Query the accepted table at this Delta version (default: the newest view).",
)
def catalog_sql(config_path: str, root: str | None, statement: str, version: int | None) -> None:
    """Run a DuckDB STATEMENT over the tables `clean`, `accepted` and `quarantine`."""
    cfg = load_for_command(config_path, root)
    try:
        result = query(cfg.storage.root, statement, version)
    except duckdb.Error as e:  # the user's statement
        raise CliError(str(e)) from e
    click.echo(result.to_pandas().to_string(index=False) if result.num_rows else "(no rows)")


@catalog.command("export")
@config_options
@click.argument("out", type=click.Path(dir_okay=False))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["parquet", "csv"]),
    default="parquet",
    show_default=True,
    help="File format.",
)
@click.option(
    "--version",
    "version",
    type=int,
    default=None,
    help="Export the accepted table at this Delta version (default: the newest view).",
)
def catalog_export(
    config_path: str, root: str | None, out: str, fmt: str, version: int | None
) -> None:
    """Write the clean view (accepted rows less the verdict's rejects) to OUT."""

    cfg = load_for_command(config_path, root)
    n = export(cfg.storage.root, out, fmt, version)
    click.echo(f"wrote {n} rows to {out}")


@catalog.command("compact")
@config_options
@click.option(
    "--retain-hours",
    type=float,
    default=None,
    help="Vacuum keeps every table version younger than this [default: the config's "
    "ingest.compact_retain_hours, 168].",
)
def catalog_compact(config_path: str, root: str | None, retain_hours: float | None) -> None:
    """Compact each table's small files, then vacuum files that no version younger than
    --retain-hours names, nor any version a registered model's dataset was cut from."""

    cfg = load_for_command(config_path, root)
    hours = cfg.ingest.compact_retain_hours if retain_hours is None else retain_hours
    keep = registered_versions(cfg.storage.root, cfg.tracking_uri, cfg.registry.model_name)
    click.echo(json.dumps(compact(cfg.storage.root, hours, keep), indent=2))


@catalog.command("migrate")
@config_options
def catalog_migrate(config_path: str, root: str | None) -> None:
    """Move a catalog written in the chain layout into the Delta tables (once)."""

    cfg = load_for_command(config_path, root)
    done = migrate(cfg.storage.root)
    click.echo(f"migrated {len(done)} ingest(s)" if done else "nothing to migrate")
