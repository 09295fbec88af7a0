"""The sharded checkpoint's state file is read weights-only: a file that would run code when
unpickled is refused with one error naming it, and nothing is run."""

import os

import pytest
import torch

from models.components.sharding import STATE_FILE, load_sharded_state


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch ran-on-load",))


def test_a_state_file_that_would_run_code_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.save({"model": {}, "optimizer": _RunsCode(), "lr_scheduler": {}}, tmp_path / STATE_FILE)
    with pytest.raises(RuntimeError) as e:
        load_sharded_state(tmp_path, None, None, None)
    assert str(e.value).startswith(f"{tmp_path / STATE_FILE}: not loaded, it holds more than")
    assert not (tmp_path / "ran-on-load").exists(), "nothing was unpickled"
