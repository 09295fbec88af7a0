"""The inputs a step needs, checked before it starts: the source, the topology file, the
tracking store, the cluster and the evaluation prompts. Every check reads; none changes
the config it checks. A value a check finds (the resolved prompts file, `prompts_file`) is
returned, and the step that needs it sets it on its own copy (`with_prompts`).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml

from data_quality.content.clip import AestheticHead
from kiln_config import (
    ConfigError,
    PipelineConfig,
    apply_overrides,
    is_remote,
    load_config,
    redact_uri,
    sharding_conflict,
)
from kiln_config.errors import InputError
from tasks.evaluation.prompts import PromptsUnavailable, resolve_prompts
from tasks.launch.gpu_fit import HealthCheckError, check_memory, declares_gpus
from tasks.launch.kubernetes import KubernetesRejected, check_kubernetes
from tasks.launch.slurm import SlurmError, check_slurm
from tasks.storage.lock import RootBusy, busy_reason
from tasks.storage.objects import ProbeError, Storage

__all__ = [
    "INPUTS",
    "SOURCE_FIX",
    "check_inputs",
    "load_checked",
    "prompts_file",
    "tracking_folder",
    "with_prompts",
]


# The inputs a step can need before it starts; the table of steps (flows/steps.py) names each
# step's. `source`: ingest.source lists files. `content`: the content rules' local models and
# languages (and the topology, when the CLIP embeddings launch). `precompute`: the topology,
# when the shard step precomputes latents. `topology`: launch.accelerate_config and its
# sharding. `tracking`: the MLflow store is writable or answers. `cluster`: SLURM or
# Kubernetes accepts the stages. `memory`: each stage fits the GPUs the config declares.
# `prompts`: the evaluation prompts are readable.
INPUTS = (
    "source",
    "content",
    "precompute",
    "topology",
    "tracking",
    "cluster",
    "memory",
    "prompts",
)


def check_inputs(cfg: PipelineConfig, inputs: Iterable[str]) -> None:
    """Fail fast on missing inputs that a later step needs, before hours of earlier steps.

    Runs before any flow starts, so a typo costs a second, not a Prefect server start and a
    failed run. The local checks (the content models, the source folder, the topology file,
    the tracking folder) run first and report every failure at once; the ones that may reach
    the network (an S3 source listed with a fast probe, an http(s) tracking server, the
    DrawBench prompts, which may come from the Hub) run after, so an offline machine reports a
    local typo quickly.

    Args:
        cfg: The loaded config (read, never changed).
        inputs: Names from `INPUTS` (a step's `checks` in flows/steps.py).

    Raises:
        ConfigError: one line per failing input, naming the field, the value and the fix.
        ValueError: an input name that is not in `INPUTS` (a bug in the table of steps).
    """
    need = set(inputs)
    if need - set(INPUTS):
        raise ValueError(f"unknown inputs {sorted(need - set(INPUTS))}; known: {INPUTS}")
    if "precompute" in need and cfg.shards.precompute:  # precompute launches on the topology
        need.add("topology")
    if "content" in need and cfg.quality.needs_clip:  # the embeddings launch on it too
        need.add("topology")
    errors = []
    if "content" in need:
        errors += _check_content(cfg)
    if "source" in need:
        errors += _check_source_local(cfg)
    if "topology" in need:
        errors += _check_topology(cfg)
    if "tracking" in need:
        errors += _check_tracking_local(cfg.tracking_uri)
    if errors:
        raise ConfigError("\n".join(errors))
    if "source" in need:
        _check_source_remote(cfg)
    if "tracking" in need:
        _check_tracking_server(cfg.tracking_uri)
    if "cluster" in need and cfg.launch.backend == "slurm":
        try:  # the cluster's own answer: a bad partition or an impossible node count
            check_slurm(cfg.launch.slurm, max(s.num_machines for s in cfg.train.stages))
        except SlurmError as e:
            raise ConfigError(str(e)) from e
    if "cluster" in need and cfg.launch.backend == "kubernetes":
        try:  # a client configuration, and the runtime the TrainJobs refer to
            check_kubernetes(cfg.launch.kubernetes)
        except KubernetesRejected as e:
            raise ConfigError(str(e)) from e
    # Every stage fits the GPUs the config names (a machine without them checks too).
    if "memory" in need and declares_gpus(cfg.launch, probe=False):
        try:
            check_memory(
                cfg.train, cfg.launch, list(range(len(cfg.train.stages))), cfg.shards.precompute
            )
        except HealthCheckError as e:
            raise ConfigError(str(e)) from e
    if "prompts" in need:  # readable now, not after training
        prompts_file(cfg)


def prompts_file(cfg: PipelineConfig) -> str:
    """The evaluation prompts file `cfg` names, resolved: the configured file, the copy
    `KILN_DRAWBENCH_CSV` names, or DrawBench from the Hub (fetched once, then cached).

    Raises:
        ConfigError: the configured file is missing, or DrawBench is neither cached nor
            reachable; names `evaluate.prompts_csv` and both fixes.
    """
    try:
        return str(resolve_prompts(cfg.evaluate.prompts_csv))
    except (PromptsUnavailable, FileNotFoundError) as e:
        msg = str(e).removeprefix("evaluate.prompts_csv: ")
        raise ConfigError(f"evaluate.prompts_csv: {msg}") from e


def with_prompts(cfg: PipelineConfig) -> PipelineConfig:
    """A copy of `cfg` whose `evaluate.prompts_csv` is the resolved file (`prompts_file`), so
    that a run's config snapshot names the file its study reads; `cfg` stays as given."""
    ev = cfg.evaluate.model_copy(update={"prompts_csv": prompts_file(cfg)})
    return cfg.model_copy(update={"evaluate": ev})


SOURCE_FIX = "pass --source or set ingest.source"


def _check_source_local(cfg: PipelineConfig) -> list[str]:
    """A local source is a folder that holds files (ingest reads folders, tars inside them)."""
    src = cfg.ingest.source
    if not src:
        return [f"ingest.source: not set ({SOURCE_FIX})"]
    if is_remote(src) and not src.startswith("file://"):
        return []  # s3://: probed after the local checks; other schemes fail in Storage
    return _probe_source(cfg)


def _check_source_remote(cfg: PipelineConfig) -> None:
    src = cfg.ingest.source
    if src and is_remote(src) and not src.startswith("file://"):
        errors = _probe_source(cfg)
        if errors:
            raise ConfigError(errors[0])


def _probe_source(cfg: PipelineConfig) -> list[str]:
    src = cfg.ingest.source
    try:
        store = Storage(src, cfg.storage.endpoint_url)
        if not store.probe():
            return [f"ingest.source: {src} holds no files ({SOURCE_FIX})"]
    except ProbeError as e:
        if store.is_s3:
            hint = (
                "check the bucket and prefix, the AWS credentials, and storage.endpoint_url "
                "or S3_ENDPOINT_URL for MinIO, Ceph or R2"
            )
        elif "is a file" in str(e):
            hint = "ingest reads a folder: images with a manifest or .txt captions, or .tar shards"
        else:
            hint = SOURCE_FIX
        return [f"ingest.source: {e} ({hint})"]
    except ValueError as e:  # an unsupported scheme, an S3 URI without a bucket
        return [f"ingest.source: {e} ({SOURCE_FIX})"]
    return []


def _check_content(cfg: PipelineConfig) -> list[str]:
    """The content rules' local weights are there, and their languages are Lingua's."""
    q, errors = cfg.quality, []
    if q.clip_model is not None and not (Path(q.clip_model).expanduser() / "config.json").is_file():
        errors.append(
            f"quality.clip_model: no CLIP folder at {q.clip_model} (config.json, weights and "
            "processor files from save_pretrained); docs/operations.md, 'Curation by content'"
        )
    if q.aesthetic_head is not None and not Path(q.aesthetic_head).expanduser().is_file():
        errors.append(
            f"quality.aesthetic_head: no file at {q.aesthetic_head}; stage LAION's linear head "
            "for the CLIP there (docs/operations.md, 'Curation by content')"
        )
    if not errors and q.aesthetic_head is not None and q.clip_model is not None:
        try:  # the head must be the one fitted on this CLIP's embedding width
            width = json.loads((Path(q.clip_model).expanduser() / "config.json").read_text())
            dim = len(AestheticHead.load(q.aesthetic_head).weight)
            if width.get("projection_dim") not in (None, dim):
                errors.append(
                    f"quality.aesthetic_head expects {dim}-d embeddings; quality.clip_model "
                    f"gives {width['projection_dim']}-d: use the head of that CLIP"
                )
        except (InputError, ValueError, OSError) as e:
            errors.append(str(e))
    if q.allowed_languages is not None:
        from lingua import IsoCode639_1  # a compiled module: imported when the rule is on

        unknown = [c for c in q.allowed_languages if not hasattr(IsoCode639_1, c.upper())]
        if unknown:
            errors.append(f"quality.allowed_languages: Lingua has no language {unknown}")
    return errors


def _check_topology(cfg: PipelineConfig) -> list[str]:
    path = cfg.launch.accelerate_config
    if Path(path).is_file():
        return _check_sharding(cfg, yaml.safe_load(Path(path).read_text()) or {})
    return [
        f"launch.accelerate_config: file not found (received {path!r}); set it to a topology "
        f"such as configs/accelerate/single.yaml"
    ]


def _check_sharding(cfg: PipelineConfig, topology: dict) -> list[str]:
    """`train.sharding` shards the UNet itself: on a DDP topology, in bf16 or fp32."""
    train = cfg.train
    sharded = [i for i in range(len(train.stages)) if train.stage_sharding(i) != "ddp"]
    if not sharded:
        return []
    why = sharding_conflict(
        topology.get("distributed_type", "NO"), topology.get("mixed_precision", "no")
    )
    if why is None:
        return []
    stage = sharded[0]
    return [
        f"train.sharding: stage {stage + 1} shards with {train.stage_sharding(stage)}, which {why}"
    ]


def tracking_folder(uri: str) -> Path | None:
    """The local folder MLflow writes for `uri`, or None for a server or database URI.

    `sqlite:///path/mlflow.db` writes beside the database file; a `file:` URI or a plain path
    is a file store, a folder of its own. Relative paths are MLflow's: against the working
    directory.
    """
    if uri.startswith("sqlite:///"):
        return Path(uri.removeprefix("sqlite:///")).expanduser().parent
    if uri.startswith("file:"):
        return Path(urlparse(uri).path).expanduser()
    if "://" in uri or uri == "databricks" or uri.startswith("databricks:"):
        return None  # http(s), postgresql, mysql, sqlite:// in memory, databricks
    return Path(uri).expanduser()


def _check_tracking_local(uri: str) -> list[str]:
    """The tracking folder exists and is writable, or can be created (nothing is created)."""
    folder = tracking_folder(uri)
    if folder is None:
        return []
    shown = redact_uri(uri)
    fix = "set registry.tracking_uri or --root to a writable place"
    folder = folder.absolute()
    existing = next(p for p in (folder, *folder.parents) if p.exists() or p == p.parent)
    if not existing.is_dir():
        return [
            f"registry.tracking_uri: {existing} is a file, not a folder (received {shown!r}); {fix}"
        ]
    try:  # os.access says yes to root even on a read-only mount: write, then remove
        with tempfile.TemporaryFile(dir=existing, prefix=".kiln-write-check-"):
            pass
    except OSError as e:
        return [
            f"registry.tracking_uri: {existing} is not writable ({e.strerror or e}; received "
            f"{shown!r}); {fix}"
        ]
    return []


def _check_tracking_server(uri: str, timeout_s: float = 5.0) -> None:
    """An http(s) tracking server answers at all (any HTTP status: auth is MLflow's concern).

    Only reachability is checked: a refused connection, an unknown host or a timeout fails
    here, in seconds, instead of when training starts hours later. Database URIs are not
    probed (their drivers and credentials belong to MLflow).
    """
    if not uri.startswith(("http://", "https://")):
        return
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return  # it answered
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise ConfigError(
            f"registry.tracking_uri: the MLflow server at {redact_uri(uri)} does not answer "
            f"({reason}); start it or set registry.tracking_uri"
        ) from e


def load_checked(
    path: str,
    inputs: Iterable[str] = (),
    *,
    root: str | None = None,
    source: str | None = None,
    exclusive: bool = False,
    overrides: dict[str, tuple[str, Any]] | None = None,
) -> PipelineConfig:
    """The one load of a pipeline YAML before a step starts, through either door: the `kiln`
    command (kiln_cli) and a deployment's flow run (flows/entry.py), each with its step's
    inputs from the table of steps (flows/steps.py).

    Args:
        path: The pipeline YAML.
        inputs: The inputs `check_inputs` checks (the step's `checks`).
        root: Overrides `storage.root`.
        source: Overrides `ingest.source`.
        exclusive: The step takes the root's training lock (tasks/storage/lock.py): refused
            here, before anything starts, while another process holds it.
        overrides: Dotted fields to set, validated as the file's own values are
            (`kiln_config.apply_overrides`): a command's options that set a config field.

    Raises:
        ConfigError: the file fails validation, an override or an input check.
        RootBusy: `exclusive`, and another process holds the root's training lock.
    """
    cfg = load_config(path, root=root, source=source)
    apply_overrides(cfg, overrides or {})
    check_inputs(cfg, inputs)
    busy = exclusive and busy_reason(Path(cfg.storage.root))
    if busy:
        raise RootBusy(busy)
    return cfg
