import json

import pandas as pd

from tasks.ingest import ingest_source


def _tables(root, ingest_id):
    cat = root / "catalog" / ingest_id
    return pd.read_parquet(cat / "accepted.parquet"), pd.read_parquet(cat / "quarantine.parquet")


def test_local_ingest_accounts_for_every_file(tmp_path, demo_src):
    root = tmp_path / "root"
    res = ingest_source.fn(str(demo_src), str(root), workers=2)
    acc, q = _tables(root, res.ingest_id)
    assert res.listed == 60 and res.accepted + res.quarantined == res.listed
    assert len(acc) == res.accepted and len(q) == res.quarantined
    reasons = dict(zip(q["key"], q["reason"], strict=True))
    assert reasons == {
        "bad-truncated.jpg": "decode_error",
        "bad-empty.jpg": "empty_file",
        "bad-text.jpg": "not_an_image",
    }
    assert {"key", "sha256", "width", "height", "caption"} <= set(acc.columns)
    assert acc.loc[acc["key"] == "bad-no-caption.jpg", "caption"].item() == ""
    assert (acc["width"] > 0).all() and acc["sha256"].str.len().eq(64).all()
    assert (root / "catalog" / "LATEST").read_text().strip() == res.ingest_id


def test_unchanged_source_is_reused(tmp_path, demo_src):
    root = tmp_path / "root"
    first = ingest_source.fn(str(demo_src), str(root), workers=1)
    again = ingest_source.fn(str(demo_src), str(root), workers=1)
    assert again.reused and again.ingest_id == first.ingest_id


def test_manifest_problems_and_unlisted_files(tmp_path):
    from tasks.demo_data import write_demo_dataset

    src = tmp_path / "src"
    write_demo_dataset(src, n=10)
    with open(src / "metadata.jsonl", "a") as f:
        f.write("{not json\n")
        f.write(json.dumps({"file_name": "gone.jpg", "text": "missing file"}) + "\n")
    (src / "notes.txt").write_text("not an image")
    res = ingest_source.fn(str(src), str(tmp_path / "root"), workers=1)
    _, q = _tables(tmp_path / "root", res.ingest_id)
    by_reason = q.groupby("reason")["key"].apply(list).to_dict()
    assert by_reason["manifest_bad_json"] == ["metadata.jsonl:11"]
    assert by_reason["manifest_missing_file"] == ["gone.jpg"]
    assert by_reason["unsupported_extension"] == ["notes.txt"]
    assert res.accepted + res.quarantined == res.listed == 11
    assert res.manifest_problems == 2


def test_s3_source_through_moto_matches_local(
    tmp_path, demo_src, s3_bucket, s3_endpoint, upload_dir
):
    bucket, client = s3_bucket
    upload_dir(client, bucket, "raw", demo_src)
    local = ingest_source.fn(str(demo_src), str(tmp_path / "a"), workers=1)
    remote = ingest_source.fn(
        f"s3://{bucket}/raw", str(tmp_path / "b"), workers=2, endpoint_url=s3_endpoint
    )
    acc_l, q_l = _tables(tmp_path / "a", local.ingest_id)
    acc_r, q_r = _tables(tmp_path / "b", remote.ingest_id)
    assert remote.source == f"s3://{bucket}/raw"
    cols = ["key", "sha256", "width", "height", "caption"]
    pd.testing.assert_frame_equal(
        acc_l[cols].reset_index(drop=True), acc_r[cols].reset_index(drop=True)
    )
    assert list(q_l["reason"]) == list(q_r["reason"])
