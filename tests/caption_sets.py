"""The caption sets of the language rule's precision (tests/data/captions/, the demo's
captions, the evaluation prompts), and whether the rule quarantines each caption: used by
tests/tasks/quality/test_language_precision.py and benchmarks/language_precision.py."""

from __future__ import annotations

import csv
import json
import tempfile
from pathlib import Path

from data_quality.content.language import UNDETERMINED, detect, verdict
from kiln_config import QualityConfig
from kiln_demo.data import write_demo_dataset

REPO = Path(__file__).resolve().parent.parent
SETS = REPO / "tests" / "data" / "captions"


def caption_sets() -> dict[str, list[str]]:
    """The English sets (their captions should all pass) and the other languages'."""
    with tempfile.TemporaryDirectory() as tmp:
        write_demo_dataset(tmp, n=400, seed=0)
        rows = [json.loads(x) for x in (Path(tmp) / "metadata.jsonl").read_text().splitlines()]
    demo = sorted({r["text"] for r in rows if isinstance(r.get("text"), str) and r["text"]})
    prompts = []
    for f in (REPO / "tests" / "data" / "prompts.csv", REPO / "configs" / "prompts" / "tiny.csv"):
        with f.open(newline="") as fh:
            prompts += [r["Prompts"] for r in csv.DictReader(fh)]
    other = (SETS / "other-languages.tsv").read_text().splitlines()
    return {
        "english_with_names": (SETS / "english-names.txt").read_text().splitlines(),
        "demo_captions": demo,
        "prompts": prompts,
        "other_languages": [line.split("\t", 1)[1] for line in other],
    }


def quarantined(captions: list[str], rules: QualityConfig) -> list[bool]:
    """Whether the language rule quarantines each caption under `rules`."""
    code, conf, best = detect(captions, rules.allowed_languages)
    lang = verdict(captions, code, conf, best, rules)
    ok = {*rules.allowed_languages, UNDETERMINED}
    return [str(x) not in ok for x in lang]


def top_language_only(rules: QualityConfig) -> QualityConfig:
    """`rules` judging by the top language alone: the baseline the evidence is measured
    against (a caption fails when its top language is not allowed at
    `min_language_confidence`)."""
    return rules.model_copy(
        update={
            "min_language_words": 1,
            "max_allowed_language_confidence": 1.0,
            "min_language_ratio": 1e-9,
        }
    )
