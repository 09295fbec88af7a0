"""The streaming loader: stream mixing by proportion."""

from collections import Counter

from flows.config import load_config
from models.data import build_loader
from models.factory import build_tokenizer
from models.throughput import write_synthetic_shards


def test_streams_mix_by_proportion(tmp_path, tiny_shards):
    cfg_path, root, version = tiny_shards
    cfg = load_config(cfg_path).train
    other = tmp_path / "last-year"
    write_synthetic_shards(other, 32, 40)  # keys s0..s39
    tok = build_tokenizer(cfg.model.tokenizer)
    main = str(root / "shards" / version / "32")
    counts: Counter = Counter()
    for seed in range(3):
        loader = build_loader(main, tok, 32, 4, shuffle_seed=seed, mix=[(str(other), 0.2)],
                              shuffle_algo="py1s")  # fmt: skip
        for batch in loader:
            counts.update("other" if k.startswith("s") and k[1:].isdigit() else "main"
                          for k in batch["key"])  # fmt: skip
    share = counts["other"] / sum(counts.values())
    assert abs(share - 0.2) < 0.05, counts
