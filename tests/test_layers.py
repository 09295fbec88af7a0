"""The layer rule of DESIGN.md: imports point only down the table."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ALLOWED = {
    "deployments": {"deployments", "flows", "kiln_config"},
    "kiln_cli": {
        "kiln_cli",
        "flows",
        "tasks",
        "models",
        "data_quality",
        "human_eval",
        "kiln_demo",
        "kiln_config",
    },
    "flows": {"flows", "tasks", "data_quality", "human_eval", "kiln_config"},
    "tasks": {"tasks", "models", "data_quality", "human_eval", "kiln_demo", "kiln_config"},
    "models": {"models", "kiln_config"},
    "data_quality": {"data_quality", "kiln_config"},
    "human_eval": {"human_eval", "kiln_config"},
    "kiln_demo": {"kiln_demo"},
    "kiln_config": {"kiln_config"},
}
OURS = set(ALLOWED)


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_imports_point_down(layer):
    for path in (REPO / layer).rglob("*.py"):
        for full in _imports(path):
            mod = full.split(".")[0]
            if mod in OURS:
                assert mod in ALLOWED[layer], f"{path.relative_to(REPO)} imports {mod}"
            if layer == "flows" and mod == "models":
                # The orchestrator shares the train schema only; it never runs ML code.
                assert full == "kiln_config", f"{path.relative_to(REPO)} imports {full}"
            if layer in ("models", "data_quality", "human_eval", "kiln_demo", "kiln_config"):
                assert mod != "prefect", f"{path.relative_to(REPO)} imports prefect"


# Entry points exit as Python does: a private CPython exit hook or os._exit skips the
# interpreter's teardown (atexit order, buffered files, SQLite's WAL) for no lasting gain.
PRIVATE_EXITS = {
    ("threading", "_shutdown"),
    ("atexit", "_run_exitfuncs"),
    ("atexit", "_clear"),
    ("os", "_exit"),
    ("sys", "_exit"),
}


def _product_files():
    yield REPO / "kiln_pyfunc.py"
    for layer in sorted(ALLOWED):
        yield from (REPO / layer).rglob("*.py")


def test_no_private_interpreter_exit():
    for path in _product_files():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                hit = (node.value.id, node.attr) in PRIVATE_EXITS
                where = f"{path.relative_to(REPO)}:{node.lineno}"
                assert not hit, f"{where} uses {node.value.id}.{node.attr}"
            if isinstance(node, ast.ImportFrom) and node.module in {"os", "threading", "atexit"}:
                for a in node.names:
                    hit = (node.module, a.name) in PRIVATE_EXITS
                    assert not hit, f"{path.relative_to(REPO)}:{node.lineno} imports {a.name}"


def test_flows_and_the_command_line_import_no_ml_library():
    """A flow run's process, and every `kiln` command before its flow, start without torch,
    diffusers or transformers: they load where ML code runs (a launched process, or the task
    that computes in process), not with the module that orchestrates it. The console script's
    package imports none of the command line (ingest's and shard's spawned workers run it)."""
    import subprocess
    import sys

    probe = (
        "import sys, importlib\n"
        "import kiln_cli\n"
        "assert not [m for m in sys.modules if m.startswith(('kiln_cli.', 'flows', 'tasks'))]\n"
        "for m in sys.argv[1:]:\n"
        "    importlib.import_module(m)\n"
        "print(sorted({'torch', 'diffusers', 'transformers'} & set(sys.modules)))\n"
    )
    flows = sorted(f"flows.{p.stem}" for p in (REPO / "flows").glob("*.py"))
    out = subprocess.run(
        [sys.executable, "-c", probe, "kiln_cli.main", *flows],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    )
    assert out.stdout.strip() == "[]", out.stdout
