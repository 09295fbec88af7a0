"""Sample grids during training (models/evaluation/sample_grid.py): tiling, determinism, the
EMA weights through the export path, a real `accelerate launch` stage, and the stepped MLflow
image."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from kiln_config import StageRun, TrainConfig

REPO = Path(__file__).resolve().parents[3]
TINY = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
DEMO_PROMPTS = TINY["train"]["sample_prompts"]


def _pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"))


def _tile(grid: Image.Image, row: int, col: int, tile) -> np.ndarray:
    from models.evaluation.sample_grid import tile_box

    return _pixels(grid.crop(tile_box(row, col, tile)))


def _enlarged(image: Image.Image, tile) -> np.ndarray:
    return _pixels(image.resize(tile, Image.Resampling.NEAREST))


# -- tiling ------------------------------------------------------------------------------------


def test_grid_has_rows_by_columns_tiles_of_the_enlarged_images():
    from models.evaluation.sample_grid import HEADER_HEIGHT, LABEL_WIDTH, grid_image, tile_size

    rng = np.random.default_rng(0)
    rows = [
        [Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)) for _ in range(2)]
        for _ in range(3)
    ]
    prompts = [*DEMO_PROMPTS[:2], "a prompt " * 40]  # the last one is cut with an ellipsis
    grid = grid_image(rows, prompts, ["seed 0", "seed 1"], title="32px step 4")
    tile = tile_size((32, 32))
    assert tile == (128, 128), "32px samples are enlarged 4x, to at least 128px"
    assert grid.size == (LABEL_WIDTH + 2 * (128 + 2), HEADER_HEIGHT + 3 * (128 + 2))
    for r in range(3):
        for c in range(2):
            assert np.array_equal(_tile(grid, r, c, tile), _enlarged(rows[r][c], tile))
    # The label column holds text (dark pixels), the labels never spill into the tiles.
    labels = _pixels(grid.crop((0, HEADER_HEIGHT, LABEL_WIDTH, grid.size[1])))
    assert (labels < 128).any()
    assert tile_size((512, 512)) == (512, 512), "real-size samples are not enlarged"
    with pytest.raises(ValueError, match="needs 2 images"):
        grid_image([rows[0][:1]], prompts[:1], ["seed 0", "seed 1"])


# -- in-process: the real components, accelerator and export path -------------------------------


def _run(tmp_path: Path, **train_overrides) -> StageRun:
    train = TrainConfig.model_validate({**TINY["train"], **train_overrides})
    out = tmp_path / "stage-32"
    out.mkdir(parents=True, exist_ok=True)
    return StageRun(
        train=train, stage_index=0, shards=str(tmp_path / "unused"), output_dir=str(out)
    )


def _build(run: StageRun):
    from accelerate import Accelerator

    from models.train import build_models
    from models.training.metrics import MetricsSink

    accelerator = Accelerator(cpu=True)
    comps, _, _, ema, _ = build_models(run, accelerator)
    sink = MetricsSink(Path(run.output_dir), run.tracking_uri, run.mlflow_run_id, "stage32", True)
    return accelerator, comps, ema, sink


def _perturb(module: torch.nn.Module, seed: int = 1) -> None:
    """Move the raw weights away from the EMA's (which holds the initial ones)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))


def test_grid_is_deterministic_and_leaves_training_state_alone(tmp_path):
    """Same weights, same PNG bytes; the global RNG, the UNet's train mode and its raw weights
    are exactly as before, and no temporary export is left behind."""
    from models.evaluation.sample_grid import sample_grid, tile_size

    run = _run(tmp_path)
    accelerator, comps, ema, sink = _build(run)
    unet = accelerator.unwrap_model(comps.unet)
    _perturb(unet)
    before = {k: v.clone() for k, v in unet.state_dict().items()}
    rng = torch.get_rng_state()
    path = sample_grid(run, accelerator, comps, ema, 5, sink)
    assert path == Path(run.output_dir) / "samples" / "step-000005.png"
    first = path.read_bytes()
    assert torch.equal(torch.get_rng_state(), rng), "grid generation drew from the global RNG"
    assert unet.training, "the UNet must stay in train mode"
    assert all(torch.equal(before[k], v) for k, v in unet.state_dict().items())
    assert comps.vae.dtype == comps.text_encoder.dtype == torch.float32
    assert not (Path(run.output_dir) / ".samples.tmp").exists()
    assert sample_grid(run, accelerator, comps, ema, 5, sink).read_bytes() == first
    grid = Image.open(path)
    tile = tile_size((32, 32))
    tiles = [_tile(grid, r, 0, tile) for r in range(3)]
    assert grid.size[1] > 3 * tile[1] and len({t.tobytes() for t in tiles}) == 3
    events = [json.loads(x) for x in (Path(run.output_dir) / "metrics.jsonl").open()]
    grids = [e for e in events if e.get("event") == "sample_grid"]
    assert len(grids) == 2 and grids[0]["step"] == 5 and grids[0]["seconds"] > 0
    assert grids[0]["mlflow"] is False  # no tracking store configured


def test_grid_shows_the_ema_weights_as_the_final_export_does(tmp_path):
    """With raw weights away from the EMA's, each grid tile is, pixel for pixel, what the
    stage's `final/` export generates for that prompt and seed, and not what the raw weights
    generate: the grid goes through the export path with the EMA weights."""
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel

    from models.evaluation.sample_grid import sample_grid, tile_size
    from models.train import save_and_export
    from models.training.state import TrainState

    run = _run(tmp_path, sample_seeds=[0, 7])
    accelerator, comps, ema, sink = _build(run)
    _perturb(accelerator.unwrap_model(comps.unet))
    grid = Image.open(sample_grid(run, accelerator, comps, ema, 3, sink))
    save_and_export(run, accelerator, comps, ema, TrainState(step=3), sink)
    out = Path(run.output_dir)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["samples"] == [str(out / "samples" / "step-000003.png")]
    final = StableDiffusionPipeline.from_pretrained(out / "final")
    raw = StableDiffusionPipeline.from_pretrained(
        out / "final", unet=UNet2DConditionModel.from_pretrained(out / "final-raw" / "unet")
    )
    # One batch of the 6 images, row by row, as the grid generates them (evaluate's batching).
    prompts = [p for p in DEMO_PROMPTS for _ in (0, 7)]
    kw = {"num_inference_steps": 4, "guidance_scale": 7.5}

    def generate(pipe):
        gens = [torch.Generator().manual_seed(s) for _ in DEMO_PROMPTS for s in (0, 7)]
        return pipe(prompts, generator=gens, **kw).images

    from_final, from_raw = generate(final), generate(raw)
    tile = tile_size((32, 32))
    for r in range(3):
        for c in range(2):
            got = _tile(grid, r, c, tile)
            assert np.array_equal(got, _enlarged(from_final[2 * r + c], tile)), (r, c)
            assert not np.array_equal(got, _enlarged(from_raw[2 * r + c], tile)), (r, c)


def test_a_tracking_store_that_fails_is_a_warning(tmp_path, caplog):
    from models.evaluation.sample_grid import sample_grid

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = _run(tmp_path).model_copy(update={"tracking_uri": store, "mlflow_run_id": "nope"})
    accelerator, comps, ema, sink = _build(run)
    path = sample_grid(run, accelerator, comps, ema, 1, sink)
    assert path.is_file()
    assert "sample grid of step 1 not logged to MLflow" in caplog.text
    last = json.loads((Path(run.output_dir) / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["event"] == "sample_grid" and last["mlflow"] is False


# -- a real stage: accelerate launch, grids at sample_every and at the end, MLflow ---------------


def _launch_stage(cfg_path, root, version, out, run_opts, **train_overrides):
    from kiln_config import load_config

    cfg = load_config(cfg_path)
    train = cfg.train.model_copy(update=train_overrides)
    run = StageRun(
        train=train,
        stage_index=0,
        shards=str(root / "shards" / version / str(train.stages[0].resolution)),
        output_dir=str(out),
        **run_opts,
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "stage.yaml").write_text(yaml.safe_dump(run.model_dump(mode="json")))
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "configs" / "accelerate" / "single.yaml"),
        "-m",
        "models.train",
        "--config",
        str(out / "stage.yaml"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.integration
def test_training_writes_grids_lists_them_and_logs_them_to_mlflow(tmp_path, tiny_shards):
    """4 steps with `sample_every: 2`: grids at step 2 and at the stage's end (step 4), in the
    manifest, and in the MLflow run as stepped images that read back as the same pixels."""
    from mlflow.tracking import MlflowClient

    from kiln_config import load_config
    from models.evaluation.sample_grid import tile_size

    cfg_path, root, version = tiny_shards
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(store)
    exp = client.create_experiment("samples", artifact_location=(tmp_path / "art").as_uri())
    mlflow_run = client.create_run(exp).info.run_id
    stages = [
        load_config(cfg_path).train.stages[0].model_copy(update={"max_steps": 4, "batch_size": 4})
    ]
    out = tmp_path / "stage-32"
    _launch_stage(
        cfg_path,
        root,
        version,
        out,
        {"tracking_uri": store, "mlflow_run_id": mlflow_run},
        stages=stages,
        sample_every=2,
    )
    grids = [out / "samples" / "step-000002.png", out / "samples" / "step-000004.png"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["samples"] == [str(p) for p in grids]
    tile = tile_size((32, 32))
    for p in grids:  # three demo prompts by one seed
        assert Image.open(p).size == tile_box_extent(3, 1, tile)
    logged = [a.path for a in client.list_artifacts(mlflow_run, "images")]
    for step, p in ((2, grids[0]), (4, grids[1])):
        name = [a for a in logged if a.startswith(f"images/samples~stage-32+step+{step}+")]
        png = [a for a in name if a.endswith(".png")]
        assert len(png) == 1, logged
        back = Image.open(client.download_artifacts(mlflow_run, png[0], str(tmp_path)))
        assert np.array_equal(_pixels(back), _pixels(Image.open(p)))
    assert client.get_run(mlflow_run).data.tags.get("mlflow.loggedImages") == "True"
    events = [json.loads(x) for x in (out / "metrics.jsonl").open()]
    assert [e["step"] for e in events if e.get("event") == "sample_grid"] == [2, 4]
    assert all(e["mlflow"] for e in events if e.get("event") == "sample_grid")


def tile_box_extent(rows: int, cols: int, tile) -> tuple[int, int]:
    from models.evaluation.sample_grid import PAD, tile_box

    right, bottom = tile_box(rows - 1, cols - 1, tile)[2:]
    return right + PAD, bottom + PAD
