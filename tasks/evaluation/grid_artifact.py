"""The Prefect artifact of a stage's newest sample grid (`models.evaluation.sample_grid` draws it).

Prefect's image artifacts and markdown images take a URL, and a browser refuses file:// from
the Prefect UI, so the grid is shown from the MLflow server that holds it as the training
run's stepped image: its `get-artifact` URL (served by `kiln mlflow-ui` for a local tracking
store, or by the team's MLflow server) renders inline, with a link to the run's artifacts
page beside it and the PNG's path on disk, which works without any server.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlencode

from mlflow.tracking import MlflowClient

from tasks.registry.tracking import artifacts_url, mlflow_ui_url
from tasks.runtime.logs import task_logger

__all__ = ["logged_grid", "sample_grid_report"]


def logged_grid(tracking_uri: str, mlflow_run_id: str, resolution: int, step: int) -> str | None:
    """The artifact path of the grid MLflow holds for this stage and step (the newest, when a
    relaunch logged it again), or None."""
    prefix = f"images/samples~stage-{resolution}+step+{step}+"
    client = MlflowClient(tracking_uri)
    found = [
        a.path
        for a in client.list_artifacts(mlflow_run_id, "images")
        if a.path.startswith(prefix) and a.path.endswith(".png")
    ]
    # The name goes on with `+timestamp+<ms>+<uuid>`: the newest sorts by its timestamp.
    return max(found, key=lambda p: int(p[len(prefix) :].split("+")[1]), default=None)


def sample_grid_report(
    resolution: int, manifest: dict, tracking_uri: str | None, mlflow_run_id: str | None
) -> str | None:
    """Markdown showing the stage's newest grid, or None when the manifest lists none.

    An MLflow that cannot be read leaves the path on disk only, with the reason: the artifact
    never fails the stage it reports on.
    """
    grids = manifest.get("samples") or []
    if not grids:
        return None
    latest = Path(grids[-1])
    step = int(latest.stem.removeprefix("step-"))
    lines = [
        f"## Samples of stage {resolution}px at step {step}",
        "",
        "Rows: `train.sample_prompts`; columns: `train.sample_seeds`; EMA weights when EMA is "
        "on, generated from the stage's export as `kiln evaluate` loads it.",
        "",
    ]
    shown = None
    if tracking_uri and mlflow_run_id:
        try:
            path = logged_grid(tracking_uri, mlflow_run_id, resolution, step)
            exp_id = MlflowClient(tracking_uri).get_run(mlflow_run_id).info.experiment_id
        except Exception as e:  # noqa: BLE001 - the file on disk is still shown
            task_logger(__name__).warning("sample grid not found in MLflow: %s", e)
            lines.append(f"MLflow could not be read ({type(e).__name__}); the grid is on disk.")
            path = None
        if path:
            query = urlencode({"path": path, "run_uuid": mlflow_run_id})
            shown = f"{mlflow_ui_url(tracking_uri)}/get-artifact?{query}"
            page = artifacts_url(tracking_uri, exp_id, mlflow_run_id, path)
            lines += [
                f"![samples of stage {resolution}px at step {step}]({shown})",
                "",
                f"[Open it in MLflow]({page}); the run's `samples/stage-{resolution}` image "
                "slider shows every step. A local tracking store needs `kiln mlflow-ui` "
                "running for the image and the link.",
            ]
    if shown is None:
        lines.append("Not in MLflow: no tracking store, or the training run could not log it.")
    lines += [
        "",
        f"On disk: `{latest}` ({len(grids)} grid{'s' if len(grids) != 1 else ''} in "
        f"`{latest.parent}`).",
    ]
    return "\n".join(lines) + "\n"
