"""The artifacts' markdown: the quality sentence and the pipeline's one table."""

from __future__ import annotations

from tasks.reports import pipeline_report, quality_report, registered_report


def _summary(**kw) -> dict:
    base = {
        "ingest_id": "ing-1", "listed": 60, "clean": 50, "rejected_ingest": 4,
        "rejected_validate": 6, "reject_fraction": 10 / 60, "max_reject_fraction": 0.25,
        "reasons": {"decode_error": 4, "caption_blank": 6}, "expectations": [
            {"expectation": "expect_column_values_to_not_be_null", "column": "caption",
             "success": False, "unexpected": 6},
        ], "data_docs": "/r/quality/ing-1/index.html", "passed": True,
    }  # fmt: skip
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
        "quality": {"ingest_id": "ing-1", "clean": 50, "rejected_ingest": 5,
                    "rejected_validate": 5, "passed": True},
        "shards": {"dataset_version": "ds-abc", "stages": {"32": {"samples": 50}}},
        "study": {"study_id": "run-1-xyz", "images": 12, "path": "/r/eval/run-1-xyz"},
        "model": {"name": "kiln-t2i", "version": "3", "alias": "candidate",
                  "uri_by_alias": "models:/kiln-t2i@candidate"},
    }  # fmt: skip
    run = {"run_id": "run-1", "stages": {
        "32": {"losses": [0.9, 0.5], "metrics": {"gpu_hours": 0.25}},
        "64": {"losses": [0.4, 0.2], "metrics": {"gpu_hours": 0.5}},
    }}  # fmt: skip
    md = pipeline_report(result, run)
    for text in ("`ing-1`", "gate passed: 50 clean, 10 quarantined", "`ds-abc`", "`run-1`",
                 "final loss 0.2000", "0.75 GPU-hours", "`run-1-xyz`", "`kiln-t2i` v3",
                 "models:/kiln-t2i@candidate"):  # fmt: skip
        assert text in md, text


def test_registered_report_redacts_the_tracking_uri():
    info = {"name": "m", "version": "1", "alias": "candidate", "uri_by_alias": "models:/m@c"}
    md = registered_report(info, {"run_id": "r"}, "postgresql://kiln:s3cret-pw@db:5432/mlflow")
    assert "s3cret-pw" not in md and "db:5432" in md
