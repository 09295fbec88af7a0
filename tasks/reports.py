"""The markdown each step publishes as a Prefect artifact: pure functions of the step's result.

Kept out of the flows so that each flow reads top to bottom as its steps. Nothing here may
show a credential: tracking URIs go through `kiln_config.redact_uri`. One function draws
rather than writes markdown: `write_loss_curves`, the PNG a stage's report links.
"""

from __future__ import annotations

import json
from pathlib import Path

from data_quality.suite import INGEST_REASONS
from data_quality.verdict import ValidateResult, reasons_table
from kiln_config import redact_uri
from tasks.ingest.run import IngestResult
from tasks.registry.new_data import NewData

__all__ = [
    "compaction_report",
    "ingest_report",
    "pipeline_report",
    "quality_report",
    "registered_report",
    "shards_report",
    "stage_report",
    "study_report",
    "write_loss_curves",
]

CURVES = "loss-curves.png"


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
        f"## Ingest `{r.ingest_id}` ({r.layout} source)\n\n"
        f"Source `{r.source}`: {state}.\n\n"
        f"**{r.listed}** items listed = **{r.accepted}** accepted + **{r.quarantined}** "
        f"quarantined. Manifest problems: {r.manifest_problems}. The catalog view of this root "
        f"now holds {r.view_accepted} accepted rows.\n\n"
        f"| reason | items | meaning |\n|---|---:|---|\n{reasons or '| - | 0 | |'}\n"
    )


def compaction_report(c: dict | None) -> str:
    """What the compaction after an ingest did (`tasks.catalog.upkeep`); empty when none ran."""
    if c is None:
        return ""
    head = f"\n### Catalog compaction (ingest_seq {c['ingest_seq']})\n\n"
    if "error" in c:
        return head + f"Failed, the ingest is committed: `{c['error']}`.\n"
    rows = "\n".join(
        f"| {t} | {d['files_removed']} ({d['bytes_removed']} B) | {d['files_added']} "
        f"({d['bytes_added']} B) | {d['vacuumed']} ({d['vacuumed_bytes']} B) | "
        f"{d['retain_hours']} | {d['version']} |"
        for t, d in c["tables"].items()
    )
    return head + (
        "| table | files merged | files written | files vacuumed | horizon (h) | version |\n"
        f"|---|---:|---:|---:|---:|---:|\n{rows}\n"
    )


def new_data_report(d: NewData) -> str:
    """What the ingest means for retraining: the `kiln.ingest.completed` event's numbers."""
    since = (
        f"since the catalog `{d.trained_ingest_id}` that run `{d.trained_run_id}` trained on"
        if d.trained_ingest_id
        else "with no finished training run yet"
    )
    if d.retrain_due and d.server:
        verdict = "**due**: the `weekly-retrain` deployment's trigger starts it"
    elif d.retrain_due:
        verdict = (
            "**due**, but no Prefect server got the event (`PREFECT_API_URL` is unset), "
            "so no trigger starts it: run `kiln run` with the retrain config"
        )
    elif d.trained_run_id is None:
        verdict = (
            "not asked for: no finished training to continue from (train the first "
            "model from scratch: the `from-scratch` deployment or `kiln run`)"
        )
    elif not d.standalone:
        verdict = "not asked for: this ingest is the first step of a training pipeline"
    elif d.root_busy:
        verdict = "not asked for: a training holds this root"
    else:
        verdict = f"not due ({d.new_since_training} < {d.min_new_images})"
    return (
        f"\n### New data\n\n{d.new_since_training} accepted images are new or changed {since}; "
        f"`retrain.min_new_images` is {d.min_new_images}. Retrain: {verdict}. Event "
        "`kiln.ingest.completed` emitted.\n"
    )


def quality_report(summary: dict, docs_url: str | None = None) -> str:
    """The gate's verdict and quarantined counts in one sentence, then reasons and expectations.

    Args:
        summary: The quality step's summary.json.
        docs_url: An http URL of the Data Docs (a browser refuses file:// links from the UI).
    """
    result = ValidateResult.from_dict(summary)
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
        f"**Licensing terms:** {result.takedowns} rows on the takedown list, "
        f"{result.license_expired} with an ended (or unreadable) license end; both are "
        "quarantined whatever else they pass, and are not counted against the limit.\n\n"
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
        pub = (
            f"Published to `{published['remote']}`: {published['uploaded']} objects "
            f"({published['bytes'] / 1e6:.2f} MB) sent; {published['already_there']} were "
            "there already.\n\n"
        )
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


def stage_report(
    run_id: str, i: int, res: int, manifest: dict, plan: dict | None, curves: str | None = None
) -> str:
    """A finished stage: last-window metrics, the validation loss and conditioning gap at its
    end, the loss curves (`curves`, a PNG path) and, when `kiln plan` ran, plan vs actual."""
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
    lines += _val_section(manifest.get("val"), manifest.get("val_history") or [], m)
    if curves:
        lines += [
            f"\nTraining and validation loss curves: [{CURVES}]({Path(curves).as_uri()}) "
            f"(`{curves}`, also in the MLflow run's artifacts).\n"
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


def _val_section(val: dict | None, history: list[dict], window: dict) -> list[str]:
    """The held-out loss and conditioning gap at the stage's end, EMA and raw weights, per
    timestep too; and what the evaluations cost."""
    if not val:
        return ["\nNo validation loss: this stage has no validation split (`shards.val_fraction`)."]
    kinds = [k for k in ("ema", "raw") if f"{k}/val/loss" in val]
    prefix = f"{kinds[0]}/val/loss_t"
    steps = sorted(int(k.removeprefix(prefix)) for k in val if k.startswith(prefix))
    rows = [
        ("loss (mean)", "loss"),
        ("conditioning gap", "cond_gap"),
        *((f"loss at t={t}", f"loss_t{t}") for t in steps),
        *((f"gap at t={t}", f"cond_gap_t{t}") for t in steps),
    ]
    spent = sum(e.get("val/eval_s", 0.0) for e in history)
    step_s = window.get("step_time_s")
    cost = f"; a training step took {step_s:.3g} s" if step_s else ""
    return [
        f"\n### Validation at step {val['step']} (held-out split, fixed timesteps and noise)\n",
        "| | " + " | ".join(kinds) + " |",
        "|---|" + "---:|" * len(kinds),
        *(
            f"| {name} | " + " | ".join(f"{val[f'{k}/val/{key}']:.5g}" for k in kinds) + " |"
            for name, key in rows
        ),
        f"\nThe gap is the loss with the captions rolled by one minus the loss with the right "
        f"ones: 0 for a model that ignores its text. {len(history)} evaluation(s) took "
        f"{spent:.3g} s in all ({val.get('val/eval_s', 0.0):.3g} s the last){cost}.",
    ]


def write_loss_curves(stage_dir: str | Path) -> Path | None:
    """Draw the stage's training loss (each logged window) and validation loss (EMA and raw)
    against the step, and the conditioning gap beside them, from its metrics.jsonl into
    `<stage_dir>/loss-curves.png`; None when nothing was logged. A relaunch's lines for steps
    already logged replace the earlier ones."""
    from matplotlib.figure import Figure  # the object API: no pyplot state, no GUI backend

    path = Path(stage_dir) / "metrics.jsonl"
    if not path.is_file():
        return None
    train: dict[int, float] = {}
    val: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "step" not in rec:
            continue
        if "loss" in rec:
            train[rec["step"]] = rec["loss"]
        if any(k.endswith("/val/loss") for k in rec):
            val[rec["step"]] = rec
    if not train and not val:
        return None
    fig = Figure(figsize=(10, 4), dpi=100)
    ax_loss, ax_gap = fig.subplots(1, 2)
    if train:
        ax_loss.plot(list(train), list(train.values()), label="train (window mean)", alpha=0.6)
    for kind, style, colour in (("ema", "o-", "C1"), ("raw", "s--", "C2")):
        pts = [
            (s, r[f"{kind}/val/loss"], r[f"{kind}/val/cond_gap"])
            for s, r in sorted(val.items())
            if f"{kind}/val/loss" in r
        ]
        if pts:
            steps, losses, gaps = zip(*pts, strict=True)
            ax_loss.plot(steps, losses, style, color=colour, label=f"validation ({kind})")
            ax_gap.plot(steps, gaps, style, color=colour, label=kind)
    ax_loss.set(xlabel="optimizer step", ylabel="denoising loss (MSE)", title="Loss")
    ax_gap.axhline(0.0, color="grey", linewidth=0.8)
    ax_gap.set(
        xlabel="optimizer step",
        ylabel="loss(rolled captions) - loss",
        title="Conditioning gap (validation)",
    )
    for ax in (ax_loss, ax_gap):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.suptitle(Path(stage_dir).name)
    fig.tight_layout()
    out = Path(stage_dir) / CURVES
    fig.savefig(out)
    return out


def study_report(
    study_id: str, items: list[dict], seeds: list[int], path: str, prompts: str
) -> str:
    """Images per prompt category of one study; `prompts` names its prompt set
    (`tasks.evaluation.prompts.prompt_set_name`)."""
    cats: dict[str, int] = {}
    for it in items:
        cats[it["category"]] = cats.get(it["category"], 0) + 1
    return (
        f"## Study `{study_id}` ({prompts} prompts)\n\n{len(items)} images "
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
        (
            "ingest",
            f"`{ing['ingest_id']}`",
            f"{ing['listed']} listed, {ing['accepted']} accepted, {ing['quarantined']} quarantined",
        ),
        (
            "validate",
            f"`{q['ingest_id']}`",
            f"gate {verdict}: {q['clean']} clean, "
            f"{q['rejected_ingest'] + q['rejected_validate']} quarantined",
        ),
        (
            "shard",
            f"`{sh['dataset_version']}`",
            ", ".join(
                f"{r}px: {s['samples']} (+{s.get('val_samples', 0)} val)"
                for r, s in sh["stages"].items()
            ),
        ),
        (
            "train",
            f"`{run['run_id']}`",
            f"stages {', '.join(f'{r}px' for r in stages)}; final loss {loss:.4f}; "
            f"{gpu_h:.4g} GPU-hours",
        ),
        (
            "evaluate",
            f"`{st['study_id']}`",
            f"{st['images']} images of the {st['prompts']} prompts at `{st['path']}`",
        ),
        (
            "register",
            f"`{model['name']}` v{model['version']}",
            f"alias `{model['alias']}`: `{model['uri_by_alias']}`",
        ),
    ]
    return "## Kiln pipeline\n\n| step | output | result |\n|---|---|---|\n" + "\n".join(
        f"| {a} | {b} | {c} |" for a, b, c in rows
    )


def model_card(record: dict, shards: dict, study: dict | None = None) -> str:
    """A registered version's model card (markdown, the version's description): the data,
    each stage's steps and samples seen, the final metrics, GPU-hours and cost, the study.

    Args:
        record: The training run's run.json (stages with their manifests).
        shards: The dataset version's shards.json.
        study: {"study_id", "prompts" (its prompt set's name), and "clip_score"/"fid" when
            computed}.
    """
    st = shards.get("stages", {})
    counts = ", ".join(
        f"{r}px {s.get('samples', '?')} train + {s.get('val_samples', 0)} val"
        for r, s in st.items()
    )
    lines = [
        "## Model card\n",
        f"**Data**: dataset version `{record['dataset_version']}` (catalog "
        f"`{record['ingest_id']}`): {counts or 'counts not recorded'}.",
    ]
    warm = record.get("init_from_model")
    lines.append(
        f"**Start**: warm-started from `{warm.get('resolved', warm['ref'])}`."
        if warm
        else "**Start**: random initialisation (trained from scratch)."
    )
    lines += [
        "",
        "| stage | steps | samples seen | final loss | val loss (EMA) | cond. gap "
        "| GPU-hours | cost $ |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    gpu_h = cost = 0.0
    for res, m in record.get("stages", {}).items():
        met = m.get("metrics", {})
        seen = m.get("samples_seen")
        val = m.get("val") or {}
        loss = m["losses"][-1] if m.get("losses") else None
        gpu_h += met.get("gpu_hours", 0.0)
        cost += met.get("cost_usd", 0.0)
        lines.append(
            f"| {res}px | {m['final_step']} | {_num(seen)} | {_num(loss)} | "
            f"{_num(val.get('ema/val/loss'))} | {_num(val.get('ema/val/cond_gap'))} | "
            f"{_num(met.get('gpu_hours'))} | {_num(met.get('cost_usd'))} |"
        )
    lines += ["", f"**Compute**: {gpu_h:.4g} GPU-hours, ${cost:,.2f}."]
    if study:
        scores = ", ".join(f"{k} {study[k]:.4g}" for k in ("clip_score", "fid") if k in study)
        on = f" on the {study['prompts']} prompts" if study.get("prompts") else ""
        lines.append(
            f"**Evaluation study**: `{study['study_id']}`{on}"
            + (f" ({scores})." if scores else ".")
        )
    lines.append("**Human evaluation**: none yet (see `kiln rate`; added here when reported).")
    return "\n".join(lines)


def _num(x) -> str:
    if x is None:
        return "–"
    return f"{x:,}" if isinstance(x, int) else f"{x:.4g}"
