"""`python -m kiln_cli`: the `kiln` command."""

from kiln_cli import entry

if __name__ == "__main__":
    entry()
