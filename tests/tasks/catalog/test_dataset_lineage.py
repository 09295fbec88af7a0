"""Draw counts from the sample logs: a resumed stage's redone steps count once."""

import json
from collections import Counter

from tasks.catalog.dataset_lineage import stage_draws


def _log(path, records):
    path.write_text("".join(json.dumps({"step": s, "keys": k}) + "\n" for s, k in records))


def test_steps_redone_after_a_resume_count_once_on_every_rank(tmp_path):
    # Rank 0 crashed after logging step 3, resumed from the checkpoint at step 2; rank 1 was
    # torn down after step 2 and redid it. The killed process left half a line.
    rank0 = [
        (0, ["a", "b"]),
        (1, ["c", "d"]),
        (2, ["e", "f"]),
        (3, ["g", "h"]),
        (2, ["e", "f"]),
        (3, ["g", "h"]),
    ]
    _log(tmp_path / "samples-rank0.jsonl", rank0)
    _log(
        tmp_path / "samples-rank1.jsonl",
        [(0, ["i"]), (1, ["j"]), (2, ["k"]), (2, ["k"]), (3, ["l"])],
    )
    with open(tmp_path / "samples-rank1.jsonl", "a") as f:
        f.write('{"step": 4, "ke')
    assert stage_draws(tmp_path, accumulation=1) == Counter("abcdefghijkl")


def test_micro_batches_of_a_step_cut_by_a_crash_count_once(tmp_path):
    # Two micro-batches a step; the crash came after the first micro-batch of step 2 (labelled
    # 2 until the optimizer steps), the resume redid step 2 from its start.
    _log(
        tmp_path / "samples-rank0.jsonl",
        [
            (0, ["a"]),
            (0, ["b"]),
            (1, ["c"]),
            (1, ["d"]),
            (2, ["e"]),
            (2, ["e"]),
            (2, ["f"]),
            (3, ["g"]),
            (3, ["h"]),
        ],
    )
    assert stage_draws(tmp_path, accumulation=2) == Counter("abcdefgh")
