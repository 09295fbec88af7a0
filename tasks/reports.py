"""The markdown each step publishes as a Prefect artifact: pure functions of the step's result.

Kept out of the flows so that each flow reads top to bottom as its steps. Nothing here may
show a credential: tracking URIs go through `models.config.redact_uri`.
"""

from __future__ import annotations

from data_quality.suite import INGEST_REASONS
from models.config import redact_uri
from tasks.ingest import IngestResult
from tasks.quality import ValidateResult, reasons_table

__all__ = [
    "ingest_report",
    "pipeline_report",
    "quality_report",
    "registered_report",
    "shards_report",
    "stage_report",
    "study_report",
]


def ingest_report(r: IngestResult) -> str:
    """Counts of one ingest, and what each quarantine reason means."""
    reasons = "\n".join(
        f"| `{k}` | {v} | {INGEST_REASONS.get(k, '')} |" for k, v in sorted(r.reasons.items())
    )
    state = (
        "unchanged, nothing decoded"
        if r.reused
        else (
            f"{r.new_items} new or changed items decoded ({r.decoded_accepted} accepted, "
            f"{r.decoded_quarantined} quarantined), {r.unchanged_items} unchanged, "
            f"{r.removed_items} removed"
        )
    )
    return (
        f"## Ingest `{r.ingest_id}` ({r.layout} layout)\n\n"
        f"Source `{r.source}`: {state}.\n\n"
        f"**{r.listed}** items listed = **{r.accepted}** accepted + **{r.quarantined}** "
        f"quarantined. Manifest problems: {r.manifest_problems}. The catalog view of this root "
        f"now holds {r.view_accepted} accepted rows.\n\n"
        f"| reason | items | meaning |\n|---|---:|---|\n{reasons or '| - | 0 | |'}\n"
    )


def quality_report(summary: dict, docs_url: str | None = None) -> str:
    """The gate's verdict and quarantined counts in one sentence, then reasons and expectations.

    Args:
        summary: The quality step's summary.json.
        docs_url: An http URL of the Data Docs (a browser refuses file:// links from the UI).
    """
    result = ValidateResult(**{k: v for k, v in summary.items() if k != "passed"})
    rows = "\n".join(
        f"| `{e['expectation']}` | `{e['column']}` | {'pass' if e['success'] else 'FAIL'} "
        f"| {e['unexpected']} |"
        for e in result.expectations
    )
    verdict = "passed" if result.passed else "FAILED"
    quarantined = result.rejected_ingest + result.rejected_validate
    sentence = (
        f"**Quality gate {verdict}: {result.clean} of {result.listed} files are clean; "
        f"{quarantined} were quarantined ({result.rejected_ingest} at ingest, "
        f"{result.rejected_validate} by the suite), {result.reject_fraction:.1%} against a limit "
        f"of {result.max_reject_fraction:.1%}.** Quarantined rows are kept with their reason; an "
        "expectation marked FAIL below counts the rows it sent to quarantine."
    )
    docs = (
        f"Data Docs: [open in the MLflow UI]({docs_url}) (a local tracking store needs "
        "`kiln mlflow-ui` running)\n\n"
        if docs_url
        else ""
    )
    if result.data_docs:
        docs += f"Data Docs on disk: `{result.data_docs}`\n\n"
    return (
        f"## Quality gate {verdict} for `{result.ingest_id}`\n\n{sentence}\n\n{docs}"
        f"Near-duplicates flagged: {result.near_duplicates}. Manifest problems: "
        f"{result.manifest_problems}.\n\n"
        f"### Quarantine reasons\n{reasons_table(result.reasons)}\n\n"
        f"### Expectations\n| expectation | column | result | rows |\n|---|---|---|---:|\n{rows}\n"
    )


def _gate_note(gate: dict) -> str:
    if not gate.get("overridden"):
        return ""
    state = "had no verdict" if gate["passed"] is None else "FAILED the quality gate"
    return f"**The catalog {state}; sharded with --allow-failed-gate.**\n\n"


def shards_report(result, ingest_id: str, path: str, published: dict | None) -> str:
    """One row per stage (samples, held-out validation samples, shards, bytes, buckets), the
    gate override, the publish."""
    pub = ""
    if published:
        pub = (f"Published to `{published['remote']}`: {published['uploaded']} objects "
               f"({published['bytes'] / 1e6:.2f} MB) sent; {published['already_there']} were "
               "there already.\n\n")  # fmt: skip
    rows = "\n".join(
        f"| {r}px | {s['samples']} | {s.get('val_samples', 0)} | {s['shards']} | "
        f"{s['bytes'] / 1e6:.2f} MB | "
        f"{', '.join(f'{b}: {n}' for b, n in s.get('buckets', {}).items()) or 'square'} |"
        for r, s in result.stages.items()
    )
    return (
        f"## Dataset `{result.dataset_version}`{' (reused)' if result.reused else ''}\n\n"
        f"From catalog `{ingest_id}`, at `{path}`.\n\n"
        f"{_gate_note(result.quality_gate)}{pub}"
        "| stage | samples | val samples | shards | bytes | buckets |\n"
        f"|---|---:|---:|---:|---:|---|\n{rows}\n"
    )


def stage_report(run_id: str, i: int, res: int, manifest: dict, plan: dict | None) -> str:
    """A finished stage: last-window metrics and, when `kiln plan` ran, plan against actual."""
    m = manifest["metrics"]
    loss = manifest["losses"][-1] if manifest["losses"] else float("nan")
    lines = [
        f"## Stage {res}px of `{run_id}`\n",
        f"{manifest['final_step']} steps on {manifest['num_processes']} process(es). "
        f"Final loss {loss:.4f}. Export: `{manifest['export']}`\n",
        "| metric | last window |",
        "|---|---:|",
        *(f"| {k} | {v:.4g} |" for k, v in m.items()),
    ]
    if plan and i < len(plan["stages"]) and plan["stages"][i]["resolution"] == res:
        p = plan["stages"][i]
        lines += [
            "\n### Plan vs actual (`kiln plan`)\n",
            "| | planned | actual |",
            "|---|---:|---:|",
            f"| img/s | {p['img_per_s']:.4g} | {m.get('samples_per_s', float('nan')):.4g} |",
            f"| GPU-hours | {p['gpu_hours']:.4g} | {m.get('gpu_hours', float('nan')):.4g} |",
            f"| cost $ | {p['cost_usd']:.4g} | {m.get('cost_usd', float('nan')):.4g} |",
        ]
    return "\n".join(lines)


def study_report(study_id: str, items: list[dict], seeds: list[int], path: str) -> str:
    """Images per DrawBench category of one study."""
    cats: dict[str, int] = {}
    for it in items:
        cats[it["category"]] = cats.get(it["category"], 0) + 1
    return (
        f"## DrawBench study `{study_id}`\n\n{len(items)} images "
        f"({len(seeds)} seed(s) per prompt) at `{path}`.\n\n"
        "| category | images |\n|---|---:|\n"
        + "\n".join(f"| {c} | {n} |" for c, n in sorted(cats.items()))
    )


def registered_report(info: dict, lineage: dict, tracking_uri: str) -> str:
    """How to load the new version, and its lineage. No credentials in it."""
    return (
        f"## `{info['name']}` version {info['version']} → alias `{info['alias']}`\n\n"
        "```python\nimport mlflow, pandas as pd\n"
        f"mlflow.set_tracking_uri({redact_uri(tracking_uri)!r})\n"
        f"model = mlflow.pyfunc.load_model({info['uri_by_alias']!r})\n"
        "out = model.predict(pd.DataFrame({'prompt': ['a red circle']}))\n```\n\n"
        + "\n".join(f"- {k}: `{v}`" for k, v in lineage.items())
    )


def pipeline_report(result: dict, run: dict) -> str:
    """The parent run's one table: each step's output, linked by its id.

    Args:
        result: `kiln_pipeline`'s return value.
        run: The training run's run.json (stages with their manifests).
    """
    ing, q, sh, st, model = (result[k] for k in ("ingest", "quality", "shards", "study", "model"))
    stages = run.get("stages", {})
    last = stages[list(stages)[-1]] if stages else {}
    loss = last.get("losses", [float("nan")])[-1] if last.get("losses") else float("nan")
    gpu_h = sum(m.get("metrics", {}).get("gpu_hours", 0.0) for m in stages.values())
    verdict = "passed" if q.get("passed", True) else "FAILED (overridden)"
    rows = [
        ("ingest", f"`{ing['ingest_id']}`",
         f"{ing['listed']} listed, {ing['accepted']} accepted, {ing['quarantined']} quarantined"),
        ("validate", f"`{q['ingest_id']}`",
         f"gate {verdict}: {q['clean']} clean, "
         f"{q['rejected_ingest'] + q['rejected_validate']} quarantined"),
        ("shard", f"`{sh['dataset_version']}`",
         ", ".join(f"{r}px: {s['samples']} (+{s.get('val_samples', 0)} val)"
                   for r, s in sh["stages"].items())),
        ("train", f"`{run['run_id']}`",
         f"stages {', '.join(f'{r}px' for r in stages)}; final loss {loss:.4f}; "
         f"{gpu_h:.4g} GPU-hours"),
        ("evaluate", f"`{st['study_id']}`", f"{st['images']} images at `{st['path']}`"),
        ("register", f"`{model['name']}` v{model['version']}",
         f"alias `{model['alias']}`: `{model['uri_by_alias']}`"),
    ]  # fmt: skip
    return "## Kiln pipeline\n\n| step | output | result |\n|---|---|---|\n" + "\n".join(
        f"| {a} | {b} | {c} |" for a, b, c in rows
    )
