"""The language rule's precision and recall on captions the tests build.

For the rule as shipped (`quality.min_language_words`, `max_allowed_language_confidence`) and,
as the baseline in the same run, the top language alone (a caption fails when its top language
is not allowed at `min_language_confidence`): the share of clean English captions each one
quarantines (captions with place and people names, the demo's captions, the evaluation
prompts) and the share of captions in ten other languages it catches.

    python benchmarks/language_precision.py --out benchmarks/results/language_precision.json
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from data_quality.content.language import UNDETERMINED, detect, verdict  # noqa: E402
from kiln_config import QualityConfig  # noqa: E402
from kiln_demo.data import write_demo_dataset  # noqa: E402

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
    other = [
        line.split("\t", 1)[1] for line in (SETS / "other-languages.tsv").read_text().splitlines()
    ]
    return {
        "english_with_names": (SETS / "english-names.txt").read_text().splitlines(),
        "demo_captions": demo,
        "prompts": prompts,
        "other_languages": other,
    }


def quarantined(captions: list[str], rules: QualityConfig) -> list[bool]:
    """Whether the language rule quarantines each caption under `rules`."""
    code, conf, best = detect(captions, rules.allowed_languages)
    lang = verdict(captions, code, conf, best, rules)
    ok = {*rules.allowed_languages, UNDETERMINED}
    return [str(x) not in ok for x in lang]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    shipped = QualityConfig(allowed_languages=["en"])
    top_only = shipped.model_copy(
        update={
            "min_language_words": 1,
            "max_allowed_language_confidence": 1.0,
            "min_language_ratio": 1e-9,
        }
    )
    sets = caption_sets()
    t = time.perf_counter()
    res: dict = {"sets": {k: len(v) for k, v in sets.items()}, "rules": {}}
    for name, rules in (("top_language_only", top_only), ("shipped", shipped)):
        r = {}
        for k, caps in sets.items():
            q = quarantined(caps, rules)
            r[k] = {"quarantined": sum(q), "share": round(sum(q) / len(caps), 5)}
            if k != "other_languages":
                r[k]["examples"] = [c for c, bad in zip(caps, q, strict=True) if bad][:8]
        res["rules"][name] = r
    res["settings"] = {
        k: getattr(shipped, k)
        for k in (
            "min_language_confidence",
            "min_language_words",
            "max_allowed_language_confidence",
        )
    }
    res["wall_s"] = round(time.perf_counter() - t, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    for name, r in res["rules"].items():
        print(name, {k: v["share"] for k, v in r.items()})


if __name__ == "__main__":
    main()
