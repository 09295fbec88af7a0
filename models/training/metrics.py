"""Training metrics: `metrics.jsonl`, a `heartbeat` file, and MLflow, all from the main process.

The script logs into the MLflow run that the orchestrator opened (its id is in stage.yaml);
it never opens a run of its own. A tracking-server hiccup is logged and training goes on:
`metrics.jsonl` keeps every value regardless.

While a stage trains, `system_metrics` also logs the machine's CPU, memory, disk and network
use (and each GPU's utilisation, memory and power when `nvidia-ml-py` is installed) into the
same run as MLflow's `system/...` metrics, from the main process.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from models.training.flops import device_stats

__all__ = ["MetricsSink", "MetricsWindow", "system_metrics"]

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


class MetricsWindow:
    """The figures of one logging window, between two rows of training metrics.

    It accumulates the window's wall time, the time spent waiting for data, the micro-batch
    losses and the optimizer steps; `log` turns them into one row (the rank-averaged loss,
    throughput, MFU, device hours and cost) and starts the next window.

    Args:
        accelerator: The run's Accelerator (the loss all-reduce, the device, the world size).
        sink: Where the row goes.
        flops_per_sample: Training FLOPs of one sample (`models.training.flops`).
        peak_flops_total: The peak FLOP/s of every device in use together.
        samples_per_step: Samples of one optimizer step over all processes.
        gpu_hour_usd: Price of one device-hour.
    """

    def __init__(
        self,
        accelerator,
        sink: MetricsSink,
        flops_per_sample: float,
        peak_flops_total: float,
        samples_per_step: int,
        gpu_hour_usd: float,
    ):
        self.accelerator, self.sink = accelerator, sink
        self.flops_per_sample, self.peak_flops_total = flops_per_sample, peak_flops_total
        self.samples_per_step, self.gpu_hour_usd = samples_per_step, gpu_hour_usd
        self._reset(time.perf_counter())

    def _reset(self, start: float) -> None:
        self.start, self.wait_s, self.loss_sum, self.loss_n, self.steps = start, 0.0, 0.0, 0, 0

    def add_wait(self, seconds: float) -> None:
        """Time the loop spent waiting for the next batch."""
        self.wait_s += seconds

    def add_loss(self, loss: torch.Tensor) -> None:
        """One micro-batch's loss (a host sync, once per micro-batch)."""
        self.loss_sum += loss.detach().float().item()
        self.loss_n += 1

    def exclude(self, seconds: float) -> None:
        """Keep `seconds` (a validation pass, a sample grid) out of the window's step time."""
        self.start += seconds

    def log(self, state, lr: float, grad_norm: float) -> float:
        """Log the window's row at `state.step`, add its wall time to `state.elapsed_s` and
        start the next window. Returns the loss averaged over the window and every rank."""
        accelerator = self.accelerator
        mean_loss = accelerator.reduce(
            torch.tensor(self.loss_sum / self.loss_n, device=accelerator.device), "mean"
        ).item()
        now = time.perf_counter()
        dt = now - self.start
        state.elapsed_s += dt
        steps = self.steps  # fewer than log_every right after a resume
        rate = self.samples_per_step * steps / dt
        dev_hours = state.elapsed_s * accelerator.num_processes / 3600
        self.sink.log(
            state.step,
            loss=mean_loss,
            lr=lr,
            grad_norm=grad_norm,
            step_time_s=dt / steps,
            samples_per_s=rate,
            samples_per_s_per_device=rate / accelerator.num_processes,
            data_wait_frac=min(1.0, self.wait_s / dt),
            mfu=rate * self.flops_per_sample / self.peak_flops_total,
            gpu_hours=dev_hours,
            cost_usd=dev_hours * self.gpu_hour_usd,
            **device_stats(accelerator.device),
        )
        self._reset(now)
        return mean_loss


@contextmanager
def system_metrics(
    tracking_uri: str | None, run_id: str | None, is_main: bool, sampling_interval: float = 10.0
) -> Iterator[object | None]:
    """Log system metrics into run `run_id` while the block runs (on the main process only).

    MLflow's `SystemMetricsMonitor` samples on a thread every `sampling_interval` seconds
    (`MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL` overrides it), continuing the step count of
    earlier stages of the same run. It is stopped when the block ends, on an error too, and
    one closing sample is logged then: the monitor drops samples it has not yet logged, so
    a stage shorter than the interval would otherwise log none. Only global rank 0 logs, so a
    multi-node run shows the first machine. A monitor that cannot start or stop is a warning,
    never a training failure. Yields the monitor, or None when nothing is logged.
    """
    monitor = None
    if is_main and tracking_uri and run_id:
        monitor = _start_monitor(tracking_uri, run_id, sampling_interval)
    try:
        yield monitor
    finally:
        if monitor is not None:
            _stop_monitor(monitor)


def _start_monitor(tracking_uri: str, run_id: str, sampling_interval: float):
    try:
        import psutil
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        # psutil's first CPU reading in a process is 0.0 by definition (it measures since the
        # previous call): start its clock now, or each stage's first sample reads as idle.
        psutil.cpu_percent()
        monitor = SystemMetricsMonitor(
            run_id,
            sampling_interval=sampling_interval,
            resume_logging=True,
            tracking_uri=tracking_uri,
        )
        monitor.start()
        return monitor
    except Exception as e:  # noqa: BLE001 - training goes on without system metrics
        log.warning("system metrics not logged (%s: %s)", type(e).__name__, e)
        return None


def _stop_monitor(monitor) -> None:
    try:
        monitor.finish()  # stops and joins the thread, flushes what it logged
        monitor.collect_metrics()
        monitor.publish_metrics(monitor.aggregate_metrics())
        monitor.mlflow_logger.flush()
    except Exception as e:  # noqa: BLE001 - the stage's own outcome stands
        log.warning("system metrics: closing sample not logged (%s: %s)", type(e).__name__, e)
