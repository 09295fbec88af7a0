"""A stage that cannot run as configured fails in the train flow before anything is launched:
a real flow run on the demo shards with a batch larger than the dataset."""

import shutil

import pytest
import yaml

from kiln_config import load_config
from tasks.launch.preflight import HealthCheckError


def test_a_dataset_smaller_than_one_global_batch_fails_before_any_launch(tiny_shards, tmp_path):
    """Stage 3's micro-batch fits its dataset, but not its global batch (micro-batch times
    accumulation): the run fails before stage 1 starts, naming stage 3."""
    from flows.train import train_flow

    cfg_path, root, version = tiny_shards
    mine = tmp_path / "root"
    shutil.copytree(root, mine)  # the session's shards stay untouched
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["storage"]["root"] = str(mine)
    last = cfg["train"]["stages"][-1]
    res = last["resolution"]
    samples = yaml.safe_load((mine / "shards" / version / "shards.json").read_text())["stages"]
    have = samples[str(res)]["samples"]
    last["batch_size"] = have // 2  # one micro-batch fits the dataset...
    last["gradient_accumulation_steps"] = 4  # ...its global batch does not
    path = tmp_path / "big-batch.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))

    before = _listing(mine)
    state = train_flow(load_config(path), return_state=True)
    assert state.is_failed()
    err = state.result(raise_on_failure=False)
    assert isinstance(err, HealthCheckError)
    msg = str(err)
    need = have // 2 * 4
    assert f"stage 3 ({res}px): its dataset has {have} training samples" in msg
    assert f"fewer than one global batch of {need} ({have // 2} per process x 4 accumulated" in msg
    assert "train.stages.2.batch_size" in msg
    # Nothing was started: no new run folder (no stage.yaml, no launch), no VAE fitted.
    assert _listing(mine) == before
    # One task ran, once: the check; no stage task (no launch), no retry.
    runs = _task_runs(state.state_details.flow_run_id)
    assert [(r.name.split("-")[:2], r.run_count, r.state.type.value) for r in runs] == [
        (["stage", "feasibility"], 1, "FAILED")
    ]


def _listing(root):
    """The run and fitted-VAE folders under `root` (the session's shards may come with some)."""
    return {
        k: sorted(p.name for p in (root / k).iterdir()) if (root / k).is_dir() else []
        for k in ("runs", "vae")
    }


def _task_runs(flow_run_id):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        return client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )


def test_check_stages_names_the_memory_that_does_not_fit():
    """On GPUs the memory model is checked too: the sd2-base recipe's 512 px stage at its
    old per-GPU batch of 64 on 80 GB; the message carries the line to paste."""
    from pathlib import Path

    from kiln_config import load_config
    from tasks.launch.preflight import check_stages

    repo = Path(__file__).resolve().parents[2]
    cfg = load_config(repo / "configs" / "sd2-base.yaml")
    stats = {s.resolution: {"samples": 10**6} for s in cfg.train.stages}
    check_stages(cfg.train, cfg.launch, stats, [0, 1, 2], on_gpu=True)  # as shipped: fits
    cfg.train.stages[1].batch_size, cfg.train.stages[1].gradient_accumulation_steps = 64, 1
    check_stages(cfg.train, cfg.launch, stats, [0, 1], on_gpu=False)  # dataset only: passes
    with pytest.raises(HealthCheckError) as err:
        check_stages(cfg.train, cfg.launch, stats, [0, 1], on_gpu=True)
    msg = str(err.value)
    assert "stage 2 (512px): the memory model puts a step at 95.7 GB per GPU" in msg
    assert "over launch.gpu_memory_gb 80" in msg
    assert "replace train.stages[1] with  - {resolution: 512, batch_size: 32" in msg
