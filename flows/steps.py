"""The table of Kiln's steps, read by both doors: the `kiln` command (kiln_cli/) and the
deployments' entry flows (flows/entry.py, which deployments/prefect.yaml and serve.py run).

A step names its flow, the inputs checked before it starts (`tasks.inputs.check_inputs`: the
source, the content rules' models, the topology file, the tracking store, the cluster, the
evaluation prompts; the pipeline's are those of the steps it chains) and whether it is
exclusive (it takes the root's training lock, so it is refused at once while another process
holds it). Both doors load the config through `Step.load_config`, so a step checks the same
inputs whichever door starts it.

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

__all__ = ["ID_PARAMS", "PIPELINE", "STEPS", "Step", "check_id_params"]

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
        checks: The inputs checked before it starts (names from `tasks.inputs.INPUTS`).
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


_STEPS = (
    Step("ingest", "flows.ingest:ingest_flow", ("source",)),
    Step("validate", "flows.validate:validate_flow", ("content",)),
    Step("shard", "flows.shard:shard_flow", ("precompute",)),
    Step("train", "flows.train:train_flow", ("topology", "tracking", "cluster", "memory"), True),
    Step("evaluate", "flows.evaluate:evaluate_flow", ("topology", "prompts")),
    Step("register", "flows.register:register_flow", ("tracking",)),
    Step("promote", "flows.promote:promote_flow", ("tracking",)),
    Step("rollback", "flows.promote:rollback_flow", ("tracking",)),
    # It logs its report to the tracking store, as registration does.
    Step("human_eval", "flows.human_evaluation:human_eval_flow", ("tracking",)),
    Step("takedown", "flows.takedown:takedown_flow"),
)

PIPELINE = ("ingest", "validate", "shard", "train", "evaluate", "register")
"""The steps `kiln run` chains, in order: the pipeline checks all their inputs before it starts
(and a due retrain, flows/retrain.py, the same)."""


_BY_NAME = {s.name: s for s in _STEPS}
_PIPELINE_CHECKS = tuple(dict.fromkeys(c for name in PIPELINE for c in _BY_NAME[name].checks))

STEPS: dict[str, Step] = {
    "pipeline": Step("pipeline", "flows.pipeline:kiln_pipeline", _PIPELINE_CHECKS, exclusive=True),
    # Checks the pipeline's inputs itself, once it knows the retrain is due.
    "retrain": Step("retrain", "flows.retrain:retrain_flow"),
    **_BY_NAME,
}
