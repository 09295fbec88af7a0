"""The layer rule of DESIGN.md: imports point only down the table."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ALLOWED = {
    "flows": {"flows", "tasks", "models", "data_quality", "human_eval"},
    "tasks": {"tasks", "models", "data_quality"},
    "models": {"models"},
    "data_quality": {"data_quality"},
    "human_eval": {"human_eval"},
    "deployments": {"deployments", "flows"},
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
                assert full == "models.config", f"{path.relative_to(REPO)} imports {full}"
            if layer in ("models", "data_quality", "human_eval"):
                assert mod != "prefect", f"{path.relative_to(REPO)} imports prefect"
