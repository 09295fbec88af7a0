import os
import sys
import time

import pytest

from tasks.launch import LaunchError, accelerate_command, run_launch


def test_output_streams_and_failure_carries_the_tail(caplog):
    cmd = [sys.executable, "-c", "print('hello from child'); import sys; sys.exit(3)"]
    with caplog.at_level("INFO"), pytest.raises(LaunchError, match="exit code 3") as e:
        run_launch(cmd)
    assert "hello from child" in str(e.value)
    assert any("hello from child" in r.getMessage() for r in caplog.records)


def test_hung_launch_is_killed_with_its_whole_process_group(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    # The child starts a grandchild, then both hang without ever writing a heartbeat.
    script = (
        "import subprocess, sys, time;"
        f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
        f"open({str(pidfile)!r}, 'w').write(str(p.pid));"
        "time.sleep(600)"
    )
    start = time.monotonic()
    with pytest.raises(LaunchError, match="hung"):
        run_launch(
            [sys.executable, "-c", script], heartbeat=tmp_path / "heartbeat", hang_timeout_s=3
        )
    assert time.monotonic() - start < 60
    pid = int(pidfile.read_text())
    # The grandchild was in the launch's process group, so it is gone too (or a zombie).
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            assert f.read().split()[2] == "Z"
    except ProcessLookupError:
        pass


def test_accelerate_command_checks_the_topology(tmp_path):
    with pytest.raises(FileNotFoundError, match="accelerate_config"):
        accelerate_command(str(tmp_path / "missing.yaml"), "models.train", [])
    (tmp_path / "t.yaml").write_text("distributed_type: 'NO'\n")
    cmd = accelerate_command(str(tmp_path / "t.yaml"), "models.train", ["--config", "x"], 2)
    assert cmd[-4:] == ["-m", "models.train", "--config", "x"]
    assert cmd[cmd.index("--num_processes") + 1] == "2"
