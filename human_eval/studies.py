"""Studies (`kiln evaluate` output) and the comparison built from two of them.

A study is `<root>/eval/<study_id>/{images/,study.json}` (models/study_images.py writes it): one
image per (prompt, seed). Two studies can be compared only when they hold the same prompts,
seeds and image size; anything else is refused with the first difference named.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from PIL import Image as PILImage

from human_eval.store import RatingStore
from kiln_config.errors import InputError, MissingInput

__all__ = [
    "Study",
    "StudyMismatch",
    "create_comparison",
    "is_model_ref",
    "load_study",
    "match_studies",
]


class StudyMismatch(InputError):
    """Two studies that cannot be compared side by side."""


@dataclass(frozen=True)
class Study:
    study_id: str
    folder: Path
    model: str
    resolution: int
    items: list[dict]  # {index, prompt, category, seed, path}


def load_study(ref: str | Path, studies: str | Path | None = None) -> Study:
    """A study by folder, or by id in `studies` (the root's study folder, `<root>/eval/`).

    Raises:
        FileNotFoundError: naming where study.json was looked for.
    """
    folder = Path(ref)
    if not (folder / "study.json").is_file() and studies is not None:
        folder = Path(studies) / str(ref)
    path = folder / "study.json"
    if not path.is_file():
        raise MissingInput(
            f"no study {ref!r}: {path} does not exist; run `kiln evaluate` to create it"
        )
    data = json.loads(path.read_text())
    model = data.get("model", {})
    return Study(
        study_id=data.get("study_id", folder.name),
        folder=folder.resolve(),
        model=model.get("ref") or model.get("pipeline", ""),
        resolution=int(data["settings"]["resolution"]),
        items=data["items"],
    )


def _image_size(path: Path) -> tuple[int, int]:
    with PILImage.open(path) as im:  # reads the header only
        return im.size


def match_studies(a: Study, b: Study) -> list[tuple[dict, dict]]:
    """The (item of A, item of B) pairs of two studies with the same prompts, seeds and size.

    Raises:
        StudyMismatch: naming the first difference (prompt set, seeds, image size).
    """
    if a.study_id == b.study_id:
        raise StudyMismatch(f"--a and --b are the same study ({a.study_id}); compare two models")
    key = lambda it: (it["index"], it["seed"])  # noqa: E731
    ka, kb = {key(it): it for it in a.items}, {key(it): it for it in b.items}
    seeds_a, seeds_b = (
        sorted({it["seed"] for it in a.items}),
        sorted({it["seed"] for it in b.items}),
    )
    if seeds_a != seeds_b:
        raise StudyMismatch(
            f"seeds differ: {a.study_id} has {seeds_a}, {b.study_id} has "
            f"{seeds_b}; evaluate both with the same evaluate.seeds"
        )
    prompts_a = [(it["prompt"], it["category"]) for it in sorted(ka.values(), key=key)]
    prompts_b = [(it["prompt"], it["category"]) for it in sorted(kb.values(), key=key)]
    if set(ka) != set(kb) or prompts_a != prompts_b:
        diff = next(((x, y) for x, y in zip(prompts_a, prompts_b, strict=False) if x != y), None)
        raise StudyMismatch(
            f"prompts differ: {a.study_id} has {len(ka)} images, {b.study_id} has {len(kb)}"
            + (f"; first difference {diff[0][0]!r} vs {diff[1][0]!r}" if diff else "")
            + "; evaluate both with the same evaluate.prompts_csv and limit"
        )
    if a.resolution != b.resolution:
        raise StudyMismatch(
            f"image sizes differ: {a.study_id} is {a.resolution}px, "
            f"{b.study_id} is {b.resolution}px"
        )
    pairs = []
    for k in sorted(ka):
        ia, ib = ka[k], kb[k]
        sa, sb = _image_size(a.folder / ia["path"]), _image_size(b.folder / ib["path"])
        if sa != sb:
            raise StudyMismatch(
                f"image sizes differ: {a.study_id}/{ia['path']} is {sa}, "
                f"{b.study_id}/{ib['path']} is {sb}"
            )
        pairs.append((ia, ib))
    return pairs


def _inside(folder: Path, rel: str) -> str:
    """An item's image as an absolute path, refusing one that leaves the study folder."""
    path = (folder / rel).resolve()
    if folder not in path.parents:
        raise StudyMismatch(f"image path {rel!r} leaves the study folder {folder}")
    return str(path)


def create_comparison(
    store: RatingStore,
    a: Study,
    b: Study,
    *,
    raters_per_pair: int,
    gold: int,
    name: str | None = None,
) -> tuple[str, bool]:
    """Create (or find) the comparison of study A with study B.

    Gold pairs: `gold` items whose two images come from one study, chosen at random for each
    gold pair: its image of the item's prompt, and its image of a *different* prompt, so the
    alignment answer is known. Were every gold pair A's, a rater who met an image of a gold
    pair again in a regular pair would know which side is A.

    The id is `name`, else a hash of the studies and settings, so asking twice finds the same
    comparison.

    Returns:
        (comparison id, whether it was created now).
    """
    if raters_per_pair < 1 or gold < 0:
        raise InputError(
            f"raters_per_pair must be >= 1 and gold >= 0 (got {raters_per_pair}, {gold})"
        )
    matched = match_studies(a, b)
    key = json.dumps([a.study_id, b.study_id, raters_per_pair, gold]).encode()
    cid = name or "cmp-" + hashlib.sha256(key).hexdigest()[:10]
    # ASCII only: the id names a folder and (lowercased) a Prefect artifact key.
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", cid):
        raise InputError(f"--name: letters, digits, - and _ only, 64 at most (got {cid!r})")
    existing = store.comparison(cid)
    if existing is not None:
        if (existing.study_a, existing.study_b) != (a.study_id, b.study_id):
            raise InputError(
                f"comparison {cid!r} already exists for {existing.study_a} vs "
                f"{existing.study_b}; choose another --name"
            )
        return cid, False
    items = [
        {
            "prompt_index": ia["index"],
            "prompt": ia["prompt"],
            "category": ia["category"],
            "seed": ia["seed"],
            "path_a": _inside(a.folder, ia["path"]),
            "path_b": _inside(b.folder, ib["path"]),
        }
        for ia, ib in matched
    ]
    # Which items, which study and which other prompt: drawn from the store's secret, so the
    # repository, the config and the studies do not say which study a check shows.
    gold_rows = _gold_pairs(items, gold, store.keyed_random(f"gold:{cid}"))
    store.add_comparison(
        cid,
        study_a=a.study_id,
        study_b=b.study_id,
        model_a=a.model,
        model_b=b.model,
        items=items,
        gold=gold_rows,
        raters_per_pair=raters_per_pair,
        gold_per_rater=gold,
    )
    return cid, True


def _gold_pairs(items: list[dict], n: int, rng: random.Random) -> list[dict]:
    if n == 0:
        return []
    if len({it["prompt"] for it in items}) < 2 or n > len(items):
        raise InputError(
            f"--gold {n}: needs at least two prompts and at most {len(items)} gold pairs"
        )
    out = []
    for it in rng.sample(items, n):
        side = rng.choice("ab")  # the study this gold pair shows, both images
        other = rng.choice([o for o in items if o["prompt"] != it["prompt"]])
        out.append({**it, "path_a": it[f"path_{side}"], "path_b": other[f"path_{side}"]})
    return out


def is_model_ref(ref: str) -> bool:
    """A registered model URI (models:/name@alias, models:/name/3) or a folder that is not a
    study, rather than a study. A folder without study.json is taken for a pipeline, so that
    one without model_index.json either is named as neither (`flows.human_evaluation`) instead of
    being looked up as a study id."""
    if ref.startswith("models:/"):
        return True
    folder = Path(ref)
    return (folder / "model_index.json").is_file() or (
        folder.is_dir() and not (folder / "study.json").is_file()
    )
