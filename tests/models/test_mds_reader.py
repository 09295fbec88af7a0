"""The MDS reader (`models.mds_reader`): samples read as views of the mapped shard file."""

import numpy as np
from streaming import MDSWriter, StreamingDataset

from models.mds_reader import MDSReader


def test_mapped_reads_match_streamings_reader(tmp_path, tiny_shards):
    """The mapped-shard reader returns exactly what StreamingDataset.get_item does,
    for image shards and for ndarray columns whose shape changes from sample to sample."""
    _, root, version = tiny_shards
    arrays = tmp_path / "arrays"
    cols = {"key": "str", "caption": "str", "a": "ndarray:float16", "b": "ndarray",
            "c": "ndarray:int32:3", "n": "int32", "meta": "json"}  # fmt: skip
    rng = np.random.default_rng(0)
    with MDSWriter(out=str(arrays), columns=cols, size_limit=1 << 12) as w:
        for i in range(40):
            shape = (4, 2, 2) if i % 7 else (2, 3)  # a shape change breaks the header cache
            w.write({"key": f"k{i}", "caption": f"é {i}", "n": i, "meta": {"i": i},
                     "a": rng.standard_normal(shape).astype(np.float16),
                     "b": rng.standard_normal(5) if i % 2 else rng.integers(0, 9, (2, 2)),
                     "c": np.arange(3, dtype=np.int32) + i})  # fmt: skip
    for local in (str(root / "shards" / version / "32"), str(arrays)):
        ours = MDSReader(local=local, batch_size=1, shuffle=False)
        ref = StreamingDataset(local=local, batch_size=1, shuffle=False)
        assert ours.num_samples == ref.num_samples > 0
        assert len(ref.shards) > 1  # several shards, so the shard lookup is exercised
        for i in range(ref.num_samples):
            got, want = ours.read_sample(i), ref.get_item(i)
            assert got.keys() == want.keys()
            for k, v in want.items():
                if isinstance(v, np.ndarray):
                    assert got[k].dtype == v.dtype and np.array_equal(got[k], v), (i, k)
                elif isinstance(v, bytes):
                    assert bytes(got[k]) == v, (i, k)
                else:
                    assert got[k] == v, (i, k)
