"""Kiln's configuration: every section's schema and the YAML loader, below every layer.

One YAML file describes one pipeline (`PipelineConfig`); a launched process reads one
resolved run file (`StageRun` for training; `PrecomputeRun`, `StudyRun`, `HealthCheckRun`).
Each default is declared here, once.
"""

from kiln_config.base import (
    REVEAL_SECRETS,
    ConfigError,
    SecretUri,
    Strict,
    check_id,
    files_sha256,
    is_id,
    is_remote,
    redact_text,
    redact_uri,
    stable_hash,
)
from kiln_config.data import (
    CATALOG_COLUMNS,
    SOURCE_FORMATS,
    IngestConfig,
    QualityConfig,
    ShardsConfig,
)
from kiln_config.errors import (
    InputError,
    KilnError,
    MissingInput,
    NotFound,
)
from kiln_config.evaluate import (
    EvalMetricsConfig,
    EvaluateConfig,
    GateConfig,
    HumanEvalConfig,
)
from kiln_config.launch import (
    GpuLimitConfig,
    KubernetesConfig,
    LaunchConfig,
    SlurmConfig,
)
from kiln_config.loader import (
    apply_overrides,
    format_validation_error,
    load_yaml_model,
    read_yaml,
)
from kiln_config.model import (
    Component,
    ModelConfig,
    TokenizerConfig,
    VaeComponent,
    VaeFitConfig,
)
from kiln_config.pipeline import (
    PROJECT_DIR,
    ExecutionConfig,
    PipelineConfig,
    RegistryConfig,
    RetrainConfig,
    StorageConfig,
    config_hash,
    encoder_key,
    load_config,
    run_config,
    write_snapshot,
)
from kiln_config.runs import (
    EmbedRun,
    HealthCheckRun,
    PrecomputeRun,
    StudyRun,
    write_run_file,
)
from kiln_config.train import (
    DEFAULT_SAMPLE_PROMPTS,
    EMAConfig,
    FaultInjection,
    StageConfig,
    StageRun,
    StreamMix,
    TrainConfig,
    sharding_conflict,
)

__all__ = [
    "CATALOG_COLUMNS",
    "Component",
    "ConfigError",
    "DEFAULT_SAMPLE_PROMPTS",
    "EMAConfig",
    "EvalMetricsConfig",
    "EvaluateConfig",
    "ExecutionConfig",
    "FaultInjection",
    "GateConfig",
    "GpuLimitConfig",
    "HealthCheckRun",
    "HumanEvalConfig",
    "IngestConfig",
    "InputError",
    "KilnError",
    "KubernetesConfig",
    "LaunchConfig",
    "MissingInput",
    "ModelConfig",
    "NotFound",
    "PROJECT_DIR",
    "PipelineConfig",
    "EmbedRun",
    "PrecomputeRun",
    "QualityConfig",
    "REVEAL_SECRETS",
    "RegistryConfig",
    "RetrainConfig",
    "SecretUri",
    "ShardsConfig",
    "SOURCE_FORMATS",
    "SlurmConfig",
    "StageConfig",
    "StageRun",
    "StorageConfig",
    "StreamMix",
    "StudyRun",
    "Strict",
    "TokenizerConfig",
    "TrainConfig",
    "sharding_conflict",
    "VaeComponent",
    "VaeFitConfig",
    "config_hash",
    "encoder_key",
    "apply_overrides",
    "format_validation_error",
    "is_remote",
    "load_config",
    "load_yaml_model",
    "read_yaml",
    "check_id",
    "files_sha256",
    "is_id",
    "redact_text",
    "redact_uri",
    "run_config",
    "stable_hash",
    "write_snapshot",
    "write_run_file",
]
