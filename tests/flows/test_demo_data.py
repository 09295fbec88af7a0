import json

import pytest

from kiln_demo.data import PLANTED, write_demo_dataset


def test_demo_data_is_deterministic_and_plants_bad_items(tmp_path):
    a = write_demo_dataset(tmp_path / "a", n=20, seed=3)
    write_demo_dataset(tmp_path / "b", n=20, seed=3)
    assert a["files"] == 20
    for p in (tmp_path / "a").iterdir():
        assert p.read_bytes() == (tmp_path / "b" / p.name).read_bytes(), p.name
    rows = [
        json.loads(line) for line in (tmp_path / "a" / "metadata.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 20 and set(PLANTED) <= {r["file_name"] for r in rows}
    assert (tmp_path / "a" / "bad-empty.jpg").stat().st_size == 0
    caption = rows[0]["text"]
    assert caption.startswith("a ") and caption.endswith("background")


def test_demo_data_rejects_tiny_n(tmp_path):
    with pytest.raises(ValueError, match="at least 8"):
        write_demo_dataset(tmp_path, n=3)
