"""The artifacts' markdown: the quality sentence and the pipeline's one table."""

from __future__ import annotations

from tasks.reports import pipeline_report, quality_report, registered_report


def _summary(**kw) -> dict:
    base = {
        "ingest_id": "ing-1",
        "listed": 60,
        "clean": 50,
        "rejected_ingest": 4,
        "rejected_validate": 6,
        "reject_fraction": 10 / 60,
        "max_reject_fraction": 0.25,
        "reasons": {"decode_error": 4, "caption_blank": 6},
        "expectations": [
            {
                "expectation": "expect_column_values_to_not_be_null",
                "column": "caption",
                "success": False,
                "unexpected": 6,
            },
        ],
        "data_docs": "/r/quality/ing-1/index.html",
        "passed": True,
    }
    return {**base, **kw}


def test_quality_verdict_and_quarantine_are_one_sentence():
    md = quality_report(_summary(), docs_url="http://127.0.0.1:5000/#/x")
    assert (
        "**Quality gate passed: 50 of 60 files are clean; 10 were quarantined (4 at ingest, 6 by "
        "the suite), 16.7% against a limit of 25.0%.**" in md
    )
    assert "[open in the MLflow UI](http://127.0.0.1:5000/#/x)" in md and "file://" not in md
    assert "| FAIL | 6 |" in md  # the failing expectation, explained by the sentence above
    failed = quality_report(_summary(clean=30, rejected_validate=26, reject_fraction=0.5))
    assert "Quality gate FAILED: 30 of 60" in failed


def test_pipeline_table_links_every_step():
    result = {
        "ingest": {"ingest_id": "ing-1", "listed": 60, "accepted": 55, "quarantined": 5},
        "quality": {
            "ingest_id": "ing-1",
            "clean": 50,
            "rejected_ingest": 5,
            "rejected_validate": 5,
            "passed": True,
        },
        "shards": {"dataset_version": "ds-abc", "stages": {"32": {"samples": 50}}},
        "study": {
            "study_id": "run-1-xyz",
            "prompts": "tiny.csv",
            "images": 12,
            "path": "/r/eval/run-1-xyz",
        },
        "model": {
            "name": "kiln-t2i",
            "version": "3",
            "alias": "candidate",
            "uri_by_alias": "models:/kiln-t2i@candidate",
        },
    }
    run = {
        "run_id": "run-1",
        "stages": {
            "32": {"losses": [0.9, 0.5], "metrics": {"gpu_hours": 0.25}},
            "64": {"losses": [0.4, 0.2], "metrics": {"gpu_hours": 0.5}},
        },
    }
    md = pipeline_report(result, run)
    for text in (
        "`ing-1`",
        "gate passed: 50 clean, 10 quarantined",
        "`ds-abc`",
        "`run-1`",
        "final loss 0.2000",
        "0.75 GPU-hours",
        "`run-1-xyz`",
        "12 images of the tiny.csv prompts",
        "`kiln-t2i` v3",
        "models:/kiln-t2i@candidate",
    ):
        assert text in md, text


def test_registered_report_redacts_the_tracking_uri():
    info = {"name": "m", "version": "1", "alias": "candidate", "uri_by_alias": "models:/m@c"}
    md = registered_report(info, {"run_id": "r"}, "postgresql://kiln:s3cret-pw@db:5432/mlflow")
    assert "s3cret-pw" not in md and "db:5432" in md


def _stage_manifest(val: dict | None) -> dict:
    history = [] if val is None else [{**val, "step": 2, "val/eval_s": 0.5}, val]
    return {
        "final_step": 4,
        "num_processes": 1,
        "export": "/r/final",
        "losses": [1.0, 0.9],
        "metrics": {"loss": 0.9, "step_time_s": 0.25},
        "val": val,
        "val_history": history,
    }


VAL = {
    "step": 4,
    "val/eval_s": 0.75,
    **{
        f"{k}/val/{m}": v
        for k, off in (("ema", 0.0), ("raw", 0.01))
        for m, v in (
            ("loss", 0.5 + off),
            ("cond_gap", 0.02 + off),
            ("loss_t250", 0.7 + off),
            ("loss_t750", 0.3 + off),
            ("cond_gap_t250", 0.03 + off),
            ("cond_gap_t750", 0.01 + off),
        )
    },
}


def test_stage_report_shows_the_validation_loss_gap_and_curves(tmp_path):
    from tasks.reports import stage_report

    md = stage_report("run-1", 0, 32, _stage_manifest(VAL), None, str(tmp_path / "c.png"))
    assert "### Validation at step 4" in md and "| | ema | raw |" in md
    assert "| loss (mean) | 0.5 | 0.51 |" in md and "| conditioning gap | 0.02 | 0.03 |" in md
    assert "| loss at t=250 | 0.7 | 0.71 |" in md and "| gap at t=750 | 0.01 | 0.02 |" in md
    assert "2 evaluation(s) took 1.25 s in all (0.75 s the last); a training step took 0.25 s" in md
    assert f"(`{tmp_path / 'c.png'}`" in md
    plain = stage_report("run-1", 0, 32, _stage_manifest(None), None)
    assert "No validation loss: this stage has no validation split" in plain
    assert "loss-curves.png" not in plain


def test_loss_curves_png_from_metrics_jsonl(tmp_path):
    import json

    from PIL import Image

    from tasks.reports import write_loss_curves

    assert write_loss_curves(tmp_path) is None, "no metrics.jsonl: no curves"
    lines = [{"event": "perf", "flops_per_sample": 1.0}]
    lines += [{"step": s, "loss": 1.0 / s, "lr": 1e-3} for s in range(1, 7)]
    lines += [
        {
            "step": s,
            "val/eval_s": 0.1,
            **{k: v / s for k, v in VAL.items() if "/val/" in k and k != "val/eval_s"},
        }
        for s in (2, 4, 6)
    ]
    lines += [{"step": 6, "loss": 0.2}]  # a relaunch logging step 6 again
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    png = write_loss_curves(tmp_path)
    assert png == tmp_path / "loss-curves.png"
    with Image.open(png) as img:
        assert img.format == "PNG" and img.size == (1000, 400)
        colours = img.convert("RGB").getcolors(1 << 20)
    assert len(colours) > 10, "the figure has drawn lines, not a blank canvas"


def test_a_study_is_named_by_its_prompt_set():
    from tasks.reports import model_card, study_report

    items = [{"category": "Colors"}, {"category": "Counting"}]
    md = study_report("run-1-xyz", items, [0], "/r/eval/run-1-xyz", "tiny.csv")
    assert md.startswith("## Study `run-1-xyz` (tiny.csv prompts)") and "DrawBench" not in md
    record = {"dataset_version": "ds-abc", "ingest_id": "ing-1", "stages": {}}
    card = model_card(record, {}, {"study_id": "run-1-xyz", "prompts": "DrawBench"})
    assert "**Evaluation study**: `run-1-xyz` on the DrawBench prompts." in card
