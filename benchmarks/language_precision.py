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
import importlib.util
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kiln_config import QualityConfig  # noqa: E402


def _load(name: str):
    """A test helper module by its file (`tests` is not a package outside pytest)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "tests" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


sets_ = _load("caption_sets")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    shipped = QualityConfig(allowed_languages=["en"])
    top_only = sets_.top_language_only(shipped)
    sets = sets_.caption_sets()
    t = time.perf_counter()
    res: dict = {"sets": {k: len(v) for k, v in sets.items()}, "rules": {}}
    for name, rules in (("top_language_only", top_only), ("shipped", shipped)):
        r = {}
        for k, caps in sets.items():
            q = sets_.quarantined(caps, rules)
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
