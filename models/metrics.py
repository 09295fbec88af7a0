"""Training metrics: `metrics.jsonl`, a `heartbeat` file, and MLflow, all from the main process.

The script logs into the MLflow run that the orchestrator opened (its id is in stage.yaml);
it never opens a run of its own. A tracking-server hiccup is logged and training goes on:
`metrics.jsonl` keeps every value regardless.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

__all__ = ["MetricsSink"]

log = logging.getLogger(__name__)


class MetricsSink:
    def __init__(
        self,
        out_dir: Path,
        tracking_uri: str | None,
        run_id: str | None,
        prefix: str,
        is_main: bool,
    ):
        self.out_dir, self.prefix, self.is_main = Path(out_dir), prefix, is_main
        self.last: dict[str, float] = {}
        self._client = None
        self._run_id = run_id
        if is_main and tracking_uri and run_id:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(tracking_uri)

    def _append(self, record: dict) -> None:
        with open(self.out_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def heartbeat(self, step: int) -> None:
        """Written every optimizer step; a watchdog reads its age."""
        if self.is_main:
            tmp = self.out_dir / ".heartbeat.tmp"
            tmp.write_text(json.dumps({"step": step, "time": time.time()}))
            tmp.replace(self.out_dir / "heartbeat")

    def event(self, name: str, **fields) -> None:
        if self.is_main:
            self._append({"event": name, "time": time.time(), **fields})

    def log(self, step: int, **metrics: float) -> None:
        if not self.is_main:
            return
        self.last = {k: float(v) for k, v in metrics.items()}
        self._append({"step": step, "time": time.time(), **self.last})
        log.info("step %d %s", step, " ".join(f"{k}={v:.4g}" for k, v in self.last.items()))
        if self._client is None:
            return
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        batch = [Metric(f"{self.prefix}/{k}", v, ts, step) for k, v in self.last.items()]
        try:
            self._client.log_batch(self._run_id, metrics=batch)
        except Exception as e:  # noqa: BLE001 - metrics.jsonl still has them
            log.warning("MLflow logging failed at step %d (kept in metrics.jsonl): %s", step, e)
