"""The training loop's callbacks and fault points (models/callbacks/, models/training/faults.py),
and the import graph of models/ without circles. The callbacks' effects on a real stage (held-out
loss, grids, divergence, checkpoints, kills) are tested through `accelerate launch` in
test_train.py, test_heldout_loss.py and test_sample_grid.py."""

import ast
from pathlib import Path

import pytest
import torch
import yaml

from kiln_config import FaultInjection, StageRun, TrainConfig
from models.callbacks import Callback, Callbacks, StepEnd
from models.callbacks.divergence_check import DivergenceCheck
from models.callbacks.due_checkpoint import DueCheckpoint
from models.callbacks.log_sample_grids import SampleGrids
from models.callbacks.step_faults import StepFaults
from models.train import build_callbacks
from models.training.faults import POINTS, Faults
from models.training.state import TrainContext

REPO = Path(__file__).resolve().parents[3]


def _run(tmp_path, **faults) -> StageRun:
    train = TrainConfig(**yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())["train"])
    return StageRun(
        train=train,
        stage_index=0,
        shards=str(tmp_path / "shards"),
        output_dir=str(tmp_path),
        faults=FaultInjection(**faults),
    )


def test_callbacks_run_in_order_at_every_event():
    calls = []

    class Recorder(Callback):
        def __init__(self, name):
            self.name = name

        def on_fit_start(self, ctx, state, window):
            calls.append(("start", self.name))

        def on_step_end(self, ctx, state, window, step):
            calls.append(("step", self.name, step.mean_loss))

    class Quiet(Callback):  # the base's events do nothing
        pass

    cbs = Callbacks([Recorder("a"), Quiet(), Recorder("b")])
    cbs.on_fit_start(None, None, None)
    cbs.on_step_end(None, None, None, StepEnd(grad_norm=1.0, mean_loss=0.5))
    cbs.on_fit_end(None, None)
    assert calls == [("start", "a"), ("start", "b"), ("step", "a", 0.5), ("step", "b", 0.5)]


def test_the_loop_checks_divergence_first_and_injects_faults_last(tmp_path):
    # Without a validation split the stage has no held-out loss callback.
    ctx = TrainContext(_run(tmp_path), *([None] * 8))
    kinds = [type(cb) for cb in build_callbacks(ctx).callbacks]
    assert kinds == [DivergenceCheck, SampleGrids, DueCheckpoint, StepFaults]
    # A throughput measurement neither draws grids nor checkpoints.
    kinds = [type(cb) for cb in build_callbacks(ctx, checkpoints=False).callbacks]
    assert kinds == [DivergenceCheck, StepFaults]


def test_fault_points(tmp_path):
    faults = Faults.of(_run(tmp_path, nan_at_step=3, desync_rank=1))
    loss = torch.tensor(0.25)
    assert faults.at("loss", loss, step=2) is loss  # untouched off the planned step
    assert torch.isnan(faults.at("loss", loss, step=3))
    module = torch.nn.Linear(2, 2)
    before = module.weight.detach().clone()
    faults.at("weights", module, rank=0)
    assert torch.equal(module.weight, before)
    faults.at("weights", module, rank=1)
    assert not torch.equal(module.weight, before)
    # Points with nothing planned do nothing and leave no fire-once marker.
    faults.at("step_end", step=3)
    for point in POINTS:
        if point.startswith("export:"):
            faults.at(point)
    assert not list(tmp_path.glob(".fault-fired-*"))


def test_an_unknown_fault_point_is_named(tmp_path):
    with pytest.raises(ValueError, match="'export:after_everything' is not one of loss, "):
        Faults.of(_run(tmp_path)).at("export:after_everything")


def _module_imports(path: Path) -> set[str]:
    """The models.* modules `path` imports at module level, TYPE_CHECKING blocks included (a
    type-only import is an arrow too); imports inside functions are not arrows."""
    out, body = set(), list(ast.parse(path.read_text()).body)
    while body:
        node = body.pop()
        if isinstance(node, ast.If):
            body += node.body + node.orelse
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("models"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("models")}
    return out


def test_models_import_each_other_without_a_circle():
    graph = {}
    for path in (REPO / "models").rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        graph[name] = _module_imports(path)
    done, stack = set(), []

    def visit(node):
        if node in stack:
            raise AssertionError(
                "import circle: " + " -> ".join([*stack[stack.index(node) :], node])
            )
        if node in done or node not in graph:
            return
        stack.append(node)
        for nxt in sorted(graph[node]):
            visit(nxt)
        stack.pop()
        done.add(node)

    for node in sorted(graph):
        visit(node)
    assert (
        "models.train" not in graph["models.training.checkpoint"]
    )  # the state lives in models.training.state
