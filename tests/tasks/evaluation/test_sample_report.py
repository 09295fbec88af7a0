"""The stage's sample-grid artifact (tasks/evaluation/grid_artifact.py): the newest grid, shown
from MLflow."""

import io
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tasks.evaluation.grid_artifact import sample_grid_report
from tests.servers import free_port


def _grid(path: Path, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (40, 60, 3), dtype=np.uint8))
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return image


def test_without_mlflow_the_report_shows_the_file_only(tmp_path):
    grids = [tmp_path / "samples" / f"step-{s:06d}.png" for s in (10, 20)]
    md = sample_grid_report(32, {"samples": [str(p) for p in grids]}, None, None)
    assert md.startswith("## Samples of stage 32px at step 20\n")
    assert f"On disk: `{grids[1]}` (2 grids in `{grids[1].parent}`)" in md
    assert "Not in MLflow" in md and "![" not in md
    assert sample_grid_report(32, {"samples": []}, None, None) is None
    assert sample_grid_report(32, {}, None, None) is None  # a manifest from before grids


def _get(url: str, proc, timeout: float = 120) -> bytes:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"mlflow ui exited early with {proc.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return r.read()
        except OSError:
            pass
        time.sleep(0.5)  # polling a server that is starting; not a race dodge
    raise AssertionError(f"{url} did not answer within {timeout}s")


@pytest.mark.integration
def test_report_shows_the_newest_logged_grid_served_by_mlflow(tmp_path):
    """A real `mlflow ui` on 127.0.0.1: the artifact's inline image URL serves the newest
    grid's PNG (the one logged last for the newest step), and its link opens the run's page."""
    from mlflow.tracking import MlflowClient

    port = free_port()
    env = {**os.environ, "MLFLOW_BACKEND_STORE_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    mlflow = Path(sys.executable).parent / "mlflow"
    proc = subprocess.Popen(
        [str(mlflow), "ui", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        server = f"http://127.0.0.1:{port}"
        assert _get(f"{server}/health", proc).strip() == b"OK"
        client = MlflowClient(server)
        exp = client.create_experiment("s", artifact_location=(tmp_path / "art").as_uri())
        run_id = client.create_run(exp).info.run_id
        key = "samples/stage-48"
        old = _grid(tmp_path / "samples" / "step-000010.png", 0)
        client.log_image(run_id, old, key=key, step=10, synchronous=True)
        first = _grid(tmp_path / "x.png", 1)
        client.log_image(run_id, first, key=key, step=20, timestamp=1000, synchronous=True)
        newest = _grid(tmp_path / "samples" / "step-000020.png", 2)  # a relaunch logged again
        client.log_image(run_id, newest, key=key, step=20, timestamp=2000, synchronous=True)
        manifest = {"samples": [str(tmp_path / "samples" / f"step-{s:06d}.png") for s in (10, 20)]}
        md = sample_grid_report(48, manifest, server, run_id)
        image_url = re.search(r"!\[samples of stage 48px at step 20\]\((\S+)\)", md).group(1)
        assert image_url.startswith(f"{server}/get-artifact?path=images%2Fsamples~stage-48")
        served = Image.open(io.BytesIO(_get(image_url, proc)))
        assert np.array_equal(np.asarray(served), np.asarray(newest))
        link = re.search(r"\[Open it in MLflow\]\((\S+)\)", md).group(1)
        assert link.startswith(f"{server}/#/experiments/{exp}/runs/{run_id}/artifacts/images/")
        assert "On disk: `" in md and "step-000020.png` (2 grids" in md
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
