"""Data lineage on the catalog's side: which images a dataset version holds and how often
training drew each (the registry's side, which registered models saw an image, is
`tasks.registry.model_lineage`).

* A dataset version's rows (`dataset_rows`) are the keys its MDS datasets hold (every stage,
  training and held-out split), joined with the catalog view it was sharded from for their
  source, sha256 and licensing columns. The join is made once and kept beside the shards
  (`Layout.dataset_rows`): the shards never change, while a later validate of the same
  catalog (after a takedown) does change which of its rows are clean.
* A run's draws (`run_draws`) come from the sample order each rank recorded while training
  (`train.log_sample_keys`: `samples-rank<N>.jsonl` in each stage's folder, one line per
  micro-batch with its optimizer step). A resumed stage trains again from its checkpoint and
  appends those steps again; `stage_draws` keeps only the last attempt of every step, so the
  counts are the samples that the final weights were trained on.
* `contributors_report` is the revenue-share table: per contributor, images, licenses, the
  earliest license end and draws per stage, which the registry logs as a CSV on each
  registered version's run (`tasks.registry.model_lineage.register_lineage`).

Keys in the sample logs are catalog keys (the MDS `key` column, without the source); a key
that two sources share counts toward the source ingested last.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pandas as pd
import yaml

from data_quality.terms import license_ends
from kiln_config import QualityConfig
from kiln_config.errors import MissingInput, NotFound
from tasks.catalog.view import scan_view
from tasks.storage.layout import Layout, is_published

__all__ = [
    "REPORT_ARTIFACT",
    "contributors_report",
    "dataset_rows",
    "earliest_license_end",
    "resolve_image",
    "run_draws",
    "stage_draws",
]

REPORT_ARTIFACT = "lineage/contributors.csv"  # on the registered version's training run
UNKNOWN = "(unknown)"  # a drawn key not in the dataset's rows (a mixed-in dataset's)


def _mds_keys(folder: Path) -> list[str]:
    """The `key` column of one MDS dataset (index.json and its shards), in sample order."""
    from streaming.base.format import reader_from_json  # seconds to import: here, not above

    index = json.loads((folder / "index.json").read_text())
    keys: list[str] = []
    for info in index["shards"]:
        shard = reader_from_json(str(folder), None, info)
        keys += [shard[i]["key"] for i in range(shard.samples)]
    return keys


def _stage_datasets(base: Path) -> dict[str, list[Path]]:
    """{stage name ("32", "32-val"): its MDS folders (one, or one per aspect bucket)}."""
    out = {}
    for d in sorted(p for p in base.iterdir() if p.is_dir()):
        name = d.name
        if not (name.split("-")[0].isdigit() and name.removesuffix("-val").isdigit()):
            continue  # latents and partial folders
        if not is_published(d):
            continue
        buckets = d / "buckets.json"
        if buckets.is_file():
            out[name] = [d / b["name"] for b in json.loads(buckets.read_text())["buckets"]]
        else:
            out[name] = [d]
    return out


def dataset_rows(root: str | Path, version: str, rules: QualityConfig | None = None):
    """The rows dataset `version` holds: source, key, sha256, the contributor, license and
    license end columns (null where the catalog lacks them) and `stages` ("32,48,64-val").

    Read from the version's shards the first time, then from `Layout.dataset_rows(version)`.

    Raises:
        FileNotFoundError: no such dataset version under `root`.
    """
    rules = rules or QualityConfig()
    layout = Layout(Path(root))
    cached = layout.dataset_rows(version)
    if cached.is_file():
        return pd.read_parquet(cached)
    shards_json = layout.shards(version) / "shards.json"
    if not shards_json.is_file():
        raise MissingInput(f"dataset version {version!r}: no {shards_json}; run `kiln shard`")
    ingest_id = json.loads(shards_json.read_text())["ingest_id"]
    stages: dict[str, list[str]] = {}
    for name, folders in _stage_datasets(layout.shards(version)).items():
        for key in {k for f in folders for k in _mds_keys(f)}:
            stages.setdefault(key, []).append(name)
    lic = [rules.contributor_column, rules.license_column, rules.license_end_column]
    cols = ["source", "key", "sha256", *lic]
    view = pd.concat(
        [b for b in scan_view(layout, ingest_id, "accepted", cols) if len(b)]
        or [pd.DataFrame(columns=cols)],
        ignore_index=True,
    )
    view = view[view["key"].isin(stages)].drop_duplicates("key", keep="last")
    rows = view.assign(stages=[",".join(stages[k]) for k in view["key"]])
    rows = rows.rename(
        columns=dict(zip(lic, ["contributor", "license", "license_end"], strict=True))
    )
    rows = rows.astype(object).sort_values(["source", "key"]).reset_index(drop=True)
    tmp = cached.with_name(cached.name + ".tmp")
    rows.to_parquet(tmp, index=False)
    tmp.replace(cached)
    return rows


def earliest_license_end(rows: pd.DataFrame) -> str | None:
    """The earliest license end among `rows` (ISO date), or None when no license ends."""
    ends, _ = license_ends(rows["license_end"]) if len(rows) else (pd.Series([]), None)
    return None if not len(rows) or ends.isna().all() else ends.min().date().isoformat()


def _records(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # the last line of a process killed mid-write
    return out


def stage_draws(stage_dir: Path, accumulation: int | None = None) -> Counter:
    """How many times each key was drawn in one stage, summed over its ranks.

    A resumed rank logs again the steps after its checkpoint. In each rank's log a step that
    goes back drops the records from that step on; then each step keeps its last
    `accumulation` records (its micro-batches per optimizer step), those of the attempt
    that completed it.

    Args:
        stage_dir: The stage's folder (`runs/<run>/stage-<r>`), with `samples-rank<N>.jsonl`.
        accumulation: Micro-batches per optimizer step; default read from its stage.yaml.
    """
    if accumulation is None:
        spec = yaml.safe_load((stage_dir / "stage.yaml").read_text())
        stage = spec["train"]["stages"][int(spec["stage_index"])]
        accumulation = int(stage.get("gradient_accumulation_steps") or 1)
    total: Counter = Counter()
    for log in sorted(stage_dir.glob("samples-rank*.jsonl")):
        kept: list[dict] = []
        for rec in _records(log):
            if kept and kept[-1]["step"] > rec["step"]:
                kept = [r for r in kept if r["step"] < rec["step"]]
            kept.append(rec)
        per_step: dict[int, list[dict]] = {}
        for rec in kept:
            per_step.setdefault(int(rec["step"]), []).append(rec)
        for recs in per_step.values():
            for rec in recs[-accumulation:]:
                total.update(rec["keys"])
    return total


def run_draws(root: str | Path, run_id: str) -> dict[str, Counter]:
    """{stage resolution as text: draws per key} of a training run; a stage that did not log
    its samples (`train.log_sample_keys` off) is left out."""
    run = Layout(Path(root)).run(run_id)
    out = {}
    for d in sorted(run.glob("stage-*"), key=lambda p: int(p.name.split("-")[1])):
        if any(d.glob("samples-rank*.jsonl")):
            out[d.name.removeprefix("stage-")] = stage_draws(d)
    return out


def contributors_report(rows: pd.DataFrame, draws: dict[str, Counter]) -> pd.DataFrame:
    """The revenue-share table: one row per contributor with `images` in the dataset, their
    `licenses`, `earliest_license_end`, `draws_<stage>` per stage, `draws_total` and `share`
    of all draws (0 when nothing was drawn). Draws of keys outside `rows` go to "(unknown)"."""
    rows = rows.assign(contributor=rows["contributor"].fillna(UNKNOWN).astype(str))
    who = dict(zip(rows["key"], rows["contributor"], strict=True))
    out = rows.groupby("contributor", sort=True).agg(
        images=("key", "size"),
        licenses=("license", lambda s: ",".join(sorted({str(x) for x in s.dropna()}))),
    )
    out["earliest_license_end"] = [
        earliest_license_end(g) for _, g in rows.groupby("contributor", sort=True)
    ]
    for stage, counts in draws.items():
        per: Counter = Counter()
        for key, n in counts.items():
            per[who.get(key, UNKNOWN)] += n
        out = out.reindex(out.index.union(list(per)))
        out[f"draws_{stage}"] = pd.Series(per, dtype="int64").reindex(out.index).fillna(0)
    draw_cols = [c for c in out.columns if c.startswith("draws_")]
    out["images"] = out["images"].fillna(0).astype("int64")
    out[draw_cols] = out[draw_cols].fillna(0).astype("int64")
    out["draws_total"] = out[draw_cols].sum(axis=1).astype("int64")
    total = int(out["draws_total"].sum())
    out["share"] = (out["draws_total"] / total).round(6) if total else 0.0
    return out.reset_index(names="contributor")


def resolve_image(root: str | Path, key_or_path: str, rules: QualityConfig | None = None):
    """The catalog rows (source, key) that `key_or_path` names, in the newest catalog view: a
    key, or a path `<source>/<key>` (as a quarantine's detail prints it).

    Raises:
        LookupError: no row of the catalog matches.
    """
    layout = Layout(Path(root))
    ingest_id = layout.latest("catalog", "lineage")
    want = str(key_or_path).strip()
    hits = []
    for b in scan_view(layout, ingest_id, "accepted", ["source", "key"]):
        path = b["source"].astype(str).str.rstrip("/") + "/" + b["key"].astype(str)
        hits.append(b[(b["key"].astype(str) == want) | (path == want.rstrip("/"))])
    found = pd.concat(hits, ignore_index=True) if hits else pd.DataFrame()
    if not len(found):
        raise NotFound(
            f"image {key_or_path!r}: no catalog row has that key or path (<source>/<key>) in "
            f"catalog {ingest_id} under {root}"
        )
    return [(str(s), str(k)) for s, k in zip(found["source"], found["key"], strict=True)]
