"""The layer rule (docs/architecture.md, "Layers"): imports point only down the table."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ALLOWED = {
    "deployments": {"deployments", "flows", "kiln_config"},
    "kiln_cli": {
        "kiln_cli",
        "deployments",
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


# Inside tasks/ and models/, subpackages import only those of a lower rank (or their own);
# the modules at the top of tasks/ and models/ (models/' `-m` entry points) rank highest.
RANKS = {
    "tasks": {
        "storage": 0,
        "runtime": 0,
        "planning": 0,
        "catalog": 1,
        "launch": 1,
        "ingest": 2,
        "quality": 2,
        "registry": 2,
        "shards": 3,
        "evaluation": 3,
    },
    "models": {"data": 0, "components": 1, "training": 2, "evaluation": 3, "callbacks": 4},
}


def _part(layer: str, dotted: str) -> str:
    """The subpackage of `layer` a module belongs to ("" for a module at the layer's top)."""
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in RANKS[layer] else ""


@pytest.mark.parametrize("layer", sorted(RANKS))
def test_subpackages_import_only_lower_ones(layer):
    ranks = {**RANKS[layer], "": max(RANKS[layer].values()) + 1}
    for path in (REPO / layer).rglob("*.py"):
        here = _part(layer, ".".join(path.relative_to(REPO).with_suffix("").parts))
        for full in _imports(path):
            if full.split(".")[0] != layer:
                continue
            there = _part(layer, full)
            ok = there == here or ranks[there] < ranks[here]
            assert ok, f"{path.relative_to(REPO)} ({here or 'top'}) imports {full}"


# Kiln's own modules are imported at the top of a module, where the dependency shows. These
# are the only imports made inside functions, each for a heavy third-party library at a
# process edge (its reason is the comment beside it).
LAZY = {
    # The console script: the workers that ingest and shard spawn run it again.
    ("kiln_cli/__init__.py", "kiln_cli.main"),
    # Commands that need torch, MLflow or Prefect, loaded when they run.
    ("kiln_cli/lineage.py", "tasks.registry"),
    ("kiln_cli/main.py", "tasks.planning.budget"),
    ("kiln_cli/main.py", "tasks.evaluation.generate"),
    ("kiln_cli/options.py", "flows.human_evaluation"),
    # Training processes never load MLflow for the served model's prompt cut.
    ("models/data/tokenization.py", "kiln_pyfunc"),
    # Tasks that run ML code in process: torch loads there, not with every flow.
    ("tasks/evaluation/study_metrics.py", "models.evaluation.study_metrics"),
    ("tasks/evaluation/proxy_scores.py", "models.embed_content"),
    ("tasks/evaluation/proxy_scores.py", "models.evaluation.image_metrics"),
    ("tasks/launch/gpu_fit.py", "tasks.planning.memory_model"),
    ("tasks/shards/vae_folder.py", "models.components.vae_fit"),
    ("tasks/shards/write.py", "models.components.factory"),
}


def test_kiln_imports_sit_at_the_top_of_modules():
    ours = (*OURS, "kiln_pyfunc")
    found = set()
    for path in _product_files():
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                found |= {
                    (path.relative_to(REPO).as_posix(), n) for n in names if n.split(".")[0] in ours
                }
    assert found == LAZY


def test_the_formatter_owns_the_layout():
    """No comment that turns the formatter off for a line or a block: ruff format lays out
    every line (`make lint`)."""
    for path in [*_product_files(), *(REPO / "tests").rglob("*.py")]:
        text = path.read_text()
        for marker in ("fmt" + ": skip", "fmt" + ": off"):  # not this file's own words
            assert marker not in text, f"{path.relative_to(REPO)} has `# {marker}`"
