"""The `kiln` command's exit without the interpreter's teardown (`flows/cli.py` `entry`).

The implementation lives in `models/process_exit.py`, beside the launched scripts that use it;
the flows reach `models` only through this layer (DESIGN.md's table: flows import
`models.config` alone).
"""

from models.process_exit import run_then_exit

__all__ = ["run_then_exit"]
