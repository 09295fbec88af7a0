"""The table of Kiln's steps, read by both doors: the `kiln` command (kiln_cli/) and the
deployments' entry flows (flows/entry.py, which deployments/prefect.yaml and serve.py run).

A step names its flow, the inputs checked before it starts (`tasks.inputs.check_inputs`: the
source, the topology file, the tracking store, the cluster, the evaluation prompts) and whether
it is exclusive (it takes the root's training lock, so it is refused at once while another
process holds it). Both doors load the config through `Step.load_config`, so a step checks the
same inputs whichever door starts it.

A flow is named by its module and function, and imported only when its step runs: the flows
import Prefect, torch and MLflow (seconds and about a gigabyte), which `kiln --help`, a
config error found by the checks, and the worker processes that ingest and shard spawn (they
import the `kiln` console script again) all do without.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kiln_config import PipelineConfig, check_id
from tasks.inputs import load_checked

__all__ = ["ID_PARAMS", "STEPS", "Step", "check_id_params"]

# A step's parameters that name a folder under the root: checked (`kiln_config.check_id`)
# by either door before anything runs, so that `--run-id ../../escape` is one line.
ID_PARAMS = ("run_id", "ingest_id", "dataset_version", "study_id")


def check_id_params(params: dict[str, Any], label: Callable[[str], str] = str) -> None:
    """Raise on the first id parameter of `params` that is not one path component.

    Args:
        params: A step's parameters (None: not given).
        label: How a message names a parameter (the CLI's `--run-id`, a deployment's `run_id`).

    Raises:
        InputError: naming the parameter and the value received.
    """
    for name in ID_PARAMS:
        if params.get(name) is not None:
            check_id(label(name), params[name])


@dataclass(frozen=True)
class Step:
    """One step of the table.

    Attributes:
        name: The step's name (the CLI command and the entry flow of the same name).
        flow: `module:function` of its typed flow, which takes the loaded `PipelineConfig`.
        checks: The steps whose inputs are checked before it starts (`tasks.inputs`).
        exclusive: It takes the root's training lock.
    """

    name: str
    flow: str
    checks: tuple[str, ...] = ()
    exclusive: bool = False

    def load_config(
        self,
        path: str,
        *,
        root: str | None = None,
        source: str | None = None,
        overrides: dict[str, tuple[str, Any]] | None = None,
    ) -> PipelineConfig:
        """The config at `path`, validated, with its overrides, and this step's inputs
        checked (`tasks.inputs.load_checked`)."""
        return load_checked(
            path,
            self.checks,
            root=root,
            source=source,
            exclusive=self.exclusive,
            overrides=overrides,
        )

    def load_flow(self):
        """The step's flow (imported now: see the module docstring)."""
        module, function = self.flow.split(":")
        return getattr(importlib.import_module(module), function)


EVERY_STEP = ("ingest", "train", "evaluate", "register")

STEPS: dict[str, Step] = {
    s.name: s
    for s in (
        Step("pipeline", "flows.pipeline:kiln_pipeline", EVERY_STEP, exclusive=True),
        # Checks its inputs itself, once it knows the retrain is due.
        Step("retrain", "flows.retrain:retrain_flow"),
        Step("ingest", "flows.ingest:ingest_flow", ("ingest",)),
        Step("validate", "flows.validate:validate_flow"),
        Step("shard", "flows.shard:shard_flow", ("shard",)),
        Step("train", "flows.train:train_flow", ("train",), exclusive=True),
        Step("evaluate", "flows.evaluate:evaluate_flow", ("evaluate",)),
        Step("register", "flows.register:register_flow", ("register",)),
        Step("promote", "flows.promote:promote_flow", ("register",)),
        Step("rollback", "flows.promote:rollback_flow", ("register",)),
        # It logs its report to the tracking store, as registration does.
        Step("human_eval", "flows.human_evaluation:human_eval_flow", ("register",)),
        Step("takedown", "flows.takedown:takedown_flow"),
    )
}
