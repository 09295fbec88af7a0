"""The `kiln` command line (`kiln_cli.main`), started by the console script or `python -m
kiln_cli`."""

__all__ = ["entry"]


def entry() -> None:
    """The `kiln` console script."""
    # Imported here, not at the top: the worker processes that ingest and shard start with
    # `spawn` run the console script again, and need none of the command line.
    from kiln_cli.main import main

    main()
