import io
import json
import tarfile

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln_config import IngestConfig, QualityConfig
from tasks.catalog.admin import query
from tasks.catalog.clean import read_clean
from tasks.catalog.view import read_view
from tasks.ingest.run import ingest_source
from tasks.quality.validate import validate_catalog
from tasks.storage.layout import Layout
from tasks.storage.objects import ObjectTooLarge, Storage


def _cat(root, ingest_id, name="view_accepted"):
    """The view after `ingest_id`, whole: its accepted or its quarantined rows."""
    acc, q, _ = read_view(Layout(root), ingest_id)
    frame = acc if name == "view_accepted" else q
    return frame.sort_values(["source", "key"], kind="stable").reset_index(drop=True)


def test_hostile_files_are_accepted_or_quarantined_with_a_reason(tmp_path, hostile_src):
    src, expected = hostile_src
    root = tmp_path / "root"
    ing = ingest_source(IngestConfig(source=str(src), workers=2), str(root))
    rules = QualityConfig(min_side=32, max_caption_chars=500, max_reject_fraction=1.0)
    val = validate_catalog.fn(str(root), ing.ingest_id, rules)

    q = pd.read_parquet(root / "quality" / ing.ingest_id / "quarantine.parquet")
    clean = read_clean(str(root), ing.ingest_id)
    got = dict(zip(q["key"], q["reason"], strict=True))
    got |= {k: f"ok:{c}" for k, c in zip(clean["key"], clean["conversion"], strict=True)}
    assert got == expected
    files = [k for k in expected if not k.startswith(("metadata", "gone", "../"))]
    assert val.listed == len(files) == ing.listed
    assert val.clean + (q["step"] != "ingest-manifest").sum() == val.listed
    assert ing.accepted + ing.quarantined == ing.listed
    rot = clean.set_index("key").loc["rotated.jpg"]
    assert (rot["width"], rot["height"]) == (40, 80), "size after EXIF orientation"
    assert clean["phash"].str.fullmatch("[0-9a-f]{16}").all()
    summary = json.loads((root / "catalog" / ing.ingest_id / "summary.json").read_text())
    assert summary["reasons"]["too_many_pixels"] == 1 and summary["listed"] == len(files)


def _tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_sidecar_tar_and_key_hazards(tmp_path, s3_bucket, s3_endpoint):
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (48, 48), (9, 90, 200)).save(buf, format="JPEG")
    jpg = buf.getvalue()
    bucket, client = s3_bucket
    put = lambda key, data: client.put_object(Bucket=bucket, Key=f"raw/{key}", Body=data)  # noqa: E731
    put(
        "00000.tar",
        _tar_bytes(
            [
                ("good.jpg", jpg),
                ("good.txt", b"a blue square"),
                ("badcap.jpg", jpg),
                ("badcap.txt", b"\xff\xfe caption"),
                ("../../evil.jpg", jpg),
                ("../../evil.txt", b"escape"),
                ("lonely.txt", b"no image here"),
                ("badjson.jpg", jpg),
                ("badjson.txt", b"fine"),
                ("badjson.json", b"{oops"),
            ]
        ),
    )
    whole = _tar_bytes([("x1.jpg", jpg), ("x1.txt", b"one"), ("x2.jpg", jpg * 20)])
    put("00001.tar", whole[:5000])  # cut inside x2's image
    put("sub/../../sneaky.tar", whole)
    res = ingest_source(
        IngestConfig(source=f"s3://{bucket}/raw"), str(tmp_path / "root"), endpoint_url=s3_endpoint
    )
    assert res.layout == "webdataset"
    acc = _cat(tmp_path / "root", res.ingest_id)
    q = _cat(tmp_path / "root", res.ingest_id, "view_quarantine")
    got = dict(zip(q["key"], q["reason"], strict=True))
    assert got == {
        "00000.tar/badcap": "caption_not_utf8",
        "00000.tar/../../evil": "unsafe_key",
        "00000.tar/lonely": "no_image",
        "00000.tar/badjson": "sidecar_bad_json",
        "00001.tar": "tar_error",
        "sub/../../sneaky.tar": "unsafe_key",
    }
    assert set(acc["key"]) == {"00000.tar/good", "00001.tar/x1"}
    good = acc.set_index("key").loc["00000.tar/good"]
    assert good["object"] == "00000.tar" and good["length"] == len(jpg) and good["offset"] > 0
    assert res.accepted + res.quarantined == res.listed == 8


def test_webdataset_members_in_every_configured_image_format_are_images(tmp_path):
    """`ingest.image_extensions` (the config's list) decides which tar members are images."""
    from PIL import Image

    def encoded(fmt: str) -> bytes:
        buf = io.BytesIO()
        Image.new("RGB", (40, 40), (200, 60, 10)).save(buf, format=fmt)
        return buf.getvalue()

    src = tmp_path / "src"
    src.mkdir()
    members = []
    for stem, ext, fmt in (("a", "bmp", "BMP"), ("b", "gif", "GIF"), ("c", "tif", "TIFF")):
        members += [(f"{stem}.{ext}", encoded(fmt)), (f"{stem}.txt", f"a {fmt} image".encode())]
    (src / "00000.tar").write_bytes(_tar_bytes(members))
    res = ingest_source(IngestConfig(source=str(src), workers=1), str(tmp_path / "root"))
    q = _cat(tmp_path / "root", res.ingest_id, "view_quarantine")
    assert dict(zip(q["key"], q["reason"], strict=True)) == {}
    acc = _cat(tmp_path / "root", res.ingest_id).set_index("key")
    assert dict(acc["format"]) == {
        "00000.tar/a": "BMP",
        "00000.tar/b": "GIF",
        "00000.tar/c": "TIFF",
    }
    assert acc.loc["00000.tar/c", "caption"] == "a TIFF image"
    # The list is the config's: without .gif, the GIF sample has no image.
    narrow = IngestConfig(source=str(src), workers=1, image_extensions=[".bmp", ".tif"])
    res = ingest_source(narrow, str(tmp_path / "narrow"))
    q = _cat(tmp_path / "narrow", res.ingest_id, "view_quarantine")
    assert dict(zip(q["key"], q["reason"], strict=True)) == {"00000.tar/b": "no_image"}


def test_img2dataset_caption_not_utf8(tmp_path):
    src = tmp_path / "src" / "00000"
    src.mkdir(parents=True)
    from PIL import Image

    for stem in ("a", "b", "c"):
        Image.new("RGB", (40, 40), (1, 2, 3)).save(src / f"{stem}.jpg")
    (src / "a.txt").write_text("fine")
    (src / "b.txt").write_bytes(b"caf\xe9 latin-1")
    (src / "c.txt").write_text("fine too")
    (src / "c.json").write_text("[not, an, object")
    res = ingest_source(IngestConfig(source=str(tmp_path / "src")), str(tmp_path / "root"))
    q = _cat(tmp_path / "root", res.ingest_id, "view_quarantine")
    assert res.layout == "img2dataset"
    assert dict(zip(q["key"], q["reason"], strict=True)) == {
        "00000/b.jpg": "caption_not_utf8",
        "00000/c.jpg": "sidecar_bad_json",
    }


@pytest.mark.parametrize("kind", ["imagefolder", "img2dataset", "webdataset"])
def test_layouts_local_and_s3_give_the_same_catalog(
    tmp_path, layouts, kind, s3_bucket, s3_endpoint, upload_dir
):
    src = tmp_path / "src"
    keys = layouts(kind, src)
    bucket, client = s3_bucket
    upload_dir(client, bucket, "raw", src)
    cols = ["key", "caption", "sha256", "phash", "width", "height", "license"]
    local = ingest_source(
        IngestConfig(source=str(src), workers=2, metadata_columns=("license",)), str(tmp_path / "a")
    )
    remote = ingest_source(
        IngestConfig(source=f"s3://{bucket}/raw", workers=2, metadata_columns=("license",)),
        str(tmp_path / "b"),
        endpoint_url=s3_endpoint,
    )
    assert local.layout == remote.layout == kind
    a, b = _cat(tmp_path / "a", local.ingest_id), _cat(tmp_path / "b", remote.ingest_id)
    assert dict(zip(a["key"], a["caption"], strict=True)) == keys
    assert (a["license"] == "cc0").all()
    pd.testing.assert_frame_equal(a[cols], b[cols])
    assert local.accepted == remote.accepted == 6 and remote.quarantined == 0


@pytest.mark.integration
def test_dask_cluster_gives_the_same_catalog_as_a_local_run(tmp_path, hostile_src):
    from distributed import LocalCluster

    src, _ = hostile_src
    local = ingest_source(
        IngestConfig(source=str(src), workers=2, partition_size=3), str(tmp_path / "a")
    )
    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
    ) as cluster:
        remote = ingest_source(
            IngestConfig(source=str(src), partition_size=3),
            str(tmp_path / "b"),
            dask_address=cluster.scheduler_address,
        )
        assert "decode_partition" in cluster.scheduler.task_prefixes, "decoding ran on Dask"
    assert remote.ingest_id == local.ingest_id
    for name in ("view_accepted", "view_quarantine"):
        pd.testing.assert_frame_equal(
            _cat(tmp_path / "a", local.ingest_id, name),
            _cat(tmp_path / "b", remote.ingest_id, name),
        )


def test_changed_ingest_settings_rebuild_every_row(tmp_path, layouts):
    src, root = tmp_path / "src", tmp_path / "root"
    layouts("img2dataset", src)
    first = ingest_source(IngestConfig(source=str(src)), str(root))
    assert "license" not in _cat(root, first.ingest_id).columns
    again = ingest_source(IngestConfig(source=str(src)), str(root))
    assert again.reused and again.new_items == 0
    more = ingest_source(IngestConfig(source=str(src), metadata_columns=("license",)), str(root))
    assert more.new_items == 6 and more.removed_items == 0
    view = _cat(root, more.ingest_id)
    assert len(view) == 6 and (view["license"] == "cc0").all(), "old rows backfilled"


def test_rows_staged_partition_by_partition_commit_the_same_view(tmp_path):
    """An ingest stages each decode partition's rows on disk and commits them in one stream:
    partitions of 2 items give the rows one partition of all items gives, a metadata column
    null in the first partitions takes its type from the later ones, and no staging is left."""
    from PIL import Image

    src = tmp_path / "src"
    src.mkdir()
    lines = []
    for i in range(7):
        Image.new("RGB", (40 + i, 48), (30 * i, 90, 200)).save(src / f"im{i}.png")
        meta = {"file_name": f"im{i}.png", "text": f"a blue square number {i}"}
        if i >= 4:
            meta["score"] = 10 * i
        lines.append(json.dumps(meta))
    (src / "bad.png").write_bytes(b"not an image")
    (src / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    runs = {}
    for size in (2, 1000):
        root = tmp_path / f"root-{size}"
        cfg = IngestConfig(source=str(src), partition_size=size, metadata_columns=["score"])
        runs[size] = ingest_source(cfg, str(root))
        assert not list((root / "catalog").glob("*.staging")), "staging removed after commit"
    small, whole = runs[2], runs[1000]
    assert (small.accepted, small.quarantined, small.reasons) == (7, 1, whole.reasons)
    for name in ("view_accepted", "view_quarantine"):
        a = _cat(tmp_path / "root-2", small.ingest_id, name)
        b = _cat(tmp_path / "root-1000", whole.ingest_id, name)
        pd.testing.assert_frame_equal(a, b, check_dtype=False)
    acc = _cat(tmp_path / "root-2", small.ingest_id)
    assert acc.set_index("key")["score"].dropna().to_dict() == {
        "im4.png": 40,
        "im5.png": 50,
        "im6.png": 60,
    }
    # The partitions' small frames are gathered into the data file's row groups.
    files = list((tmp_path / "root-2" / "catalog" / "tables" / "accepted").rglob("*.parquet"))
    assert [pq.ParquetFile(f).metadata.num_row_groups for f in files] == [1]


def test_a_metadata_value_of_infinity_leaves_the_view_readable(tmp_path):
    """A float column's min or max that JSON cannot hold (infinity) is left out of the data
    file's statistics, so the statistics stay valid and the next ingest reads the view."""
    from PIL import Image

    src = tmp_path / "src"
    src.mkdir()
    rows = []
    for i, score in enumerate(["Infinity", "1.5", "-Infinity"]):
        Image.new("RGB", (48, 48), (80 * i, 10, 10)).save(src / f"im{i}.png")
        rows.append(f'{{"file_name": "im{i}.png", "text": "square {i}", "score": {score}}}')
    (src / "metadata.jsonl").write_text("\n".join(rows) + "\n")
    cfg = IngestConfig(source=str(src), metadata_columns=["score"])
    first = ingest_source(cfg, str(tmp_path / "root"))
    Image.new("RGB", (48, 48), (1, 2, 3)).save(src / "im9.png")
    second = ingest_source(cfg, str(tmp_path / "root"))
    assert (first.accepted, second.accepted, second.new_items) == (3, 4, 1)
    scores = _cat(tmp_path / "root", second.ingest_id).set_index("key")["score"]
    assert scores["im0.png"] == float("inf") and scores["im2.png"] == float("-inf")


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_manifest_problems_and_changes_in_csv_and_parquet(tmp_path, fmt, s3_bucket, s3_endpoint):
    """A CSV or Parquet manifest, read from S3: its second row for a file name, a file name
    that escapes the source and one the source lacks are problems with a reason; a caption changed
    in it re-reads that image alone, and a file gone from the source leaves the view."""
    from PIL import Image

    bucket, client = s3_bucket
    put = lambda key, data: client.put_object(Bucket=bucket, Key=f"m/{key}", Body=data)  # noqa: E731

    def jpg(i: int) -> bytes:
        buf = io.BytesIO()
        Image.new("RGB", (48, 48), (40 * i, 9, 9)).save(buf, format="JPEG")
        return buf.getvalue()

    def manifest(rows: list[tuple]) -> bytes:
        df = pd.DataFrame(rows, columns=["file_name", "text", "license"])
        buf = io.BytesIO()
        if fmt == "csv":
            buf.write(df.to_csv(index=False).encode())
        else:
            df.to_parquet(buf, index=False)
        return buf.getvalue()

    for i in range(4):
        put(f"im{i}.jpg", jpg(i))
    rows = [
        ("im0.jpg", "zero", "cc0"),
        ("im1.jpg", "one", "cc0"),
        ("im2.jpg", "two", "cc-by"),
        ("im1.jpg", "one again", "cc0"),
        ("../up.jpg", "escapes", "cc0"),
        ("gone.jpg", "not there", "cc0"),
    ]
    put(f"metadata.{fmt}", manifest(rows))
    cfg = IngestConfig(source=f"s3://{bucket}/m", metadata_columns=["license"])
    root = tmp_path / "root"
    first = ingest_source(cfg, str(root), endpoint_url=s3_endpoint)
    assert (first.layout, first.listed, first.accepted, first.manifest_problems) == (
        "imagefolder",
        4,
        4,
        3,
    )
    acc = _cat(root, first.ingest_id).set_index("key")
    assert acc.loc["im1.jpg", "caption"] == "one", "a file name's first row is used"
    assert acc.loc["im2.jpg", "license"] == "cc-by" and pd.isna(acc.loc["im3.jpg", "caption"])
    q = _cat(root, first.ingest_id, "view_quarantine")
    line = (
        (lambda n: f"metadata.csv:{n + 1}")
        if fmt == "csv"
        else (lambda n: f"metadata.parquet:row{n}")
    )
    assert dict(zip(q["key"], q["reason"], strict=True)) == {
        line(4): "manifest_duplicate_row",
        "../up.jpg": "manifest_unsafe_key",
        "gone.jpg": "manifest_missing_file",
    }

    rows[2] = ("im2.jpg", "two, recaptioned", "cc-by")
    put(f"metadata.{fmt}", manifest(rows))
    client.delete_object(Bucket=bucket, Key="m/im3.jpg")
    again = ingest_source(cfg, str(root), endpoint_url=s3_endpoint)
    assert (again.new_items, again.removed_items, again.unchanged_items) == (1, 1, 2)
    acc = _cat(root, again.ingest_id).set_index("key")
    assert sorted(acc.index) == ["im0.jpg", "im1.jpg", "im2.jpg"]
    assert acc.loc["im2.jpg", "caption"] == "two, recaptioned"
    assert len(_cat(root, again.ingest_id, "view_quarantine")) == 3, "problems replaced"
    listing = pd.read_parquet(root / "catalog" / again.ingest_id / "listing.parquet")
    assert sorted(listing["key"]) == ["im2.jpg", f"metadata.{fmt}"]
    superseded = pd.read_parquet(root / "catalog" / again.ingest_id / "superseded.parquet")
    assert sorted(superseded["unit"]) == ["im2.jpg", "im3.jpg"]


def test_in_order_holds_a_window_of_results():
    """`in_order` gives every result in order and never has more than `window` submitted and
    not yet taken."""
    from concurrent.futures import ThreadPoolExecutor

    from tasks.ingest.changes import in_order

    outstanding, peak = 0, 0

    def submit(a):
        nonlocal outstanding, peak
        outstanding += 1
        peak = max(peak, outstanding)
        return pool.submit(lambda: a * a)

    with ThreadPoolExecutor(2) as pool:
        got = []
        for a, r in in_order(submit, range(20), window=3):
            outstanding -= 1
            got.append((a, r))
    assert got == [(a, a * a) for a in range(20)] and peak == 3


def test_replaced_rows_are_checked_against_the_units_of_their_range():
    """A data file is checked against the replaced units between its smallest and largest
    unit; a file of another source, or whose range holds none, is not read."""
    import bisect

    import pyarrow as pa

    from tasks.catalog.staging import Replaced

    def sorted_units(units: list[str]):
        def between(lo, hi):
            i = 0 if lo is None else bisect.bisect_left(units, lo)
            j = len(units) if hi is None else bisect.bisect_right(units, hi)
            return pa.array(units[i:j], pa.string())

        return between

    r = Replaced("s3://b/src", sorted_units(["a.jpg", "k.jpg", "m.jpg", "z.jpg"]))
    act = {
        "min.source": "s3://b/src",
        "max.source": "s3://b/src",
        "min.unit": "j.jpg",
        "max.unit": "n.jpg",
    }
    assert r.in_range(act).to_pylist() == ["k.jpg", "m.jpg"]
    assert r.in_range({**act, "min.unit": "n1", "max.unit": "y"}) is None
    assert r.in_range({**act, "min.source": "s3://b/x", "max.source": "s3://b/y"}) is None
    t = pa.table(
        {
            "source": ["s3://b/src", "s3://b/src", "s3://b/other"],
            "unit": ["k.jpg", "l.jpg", "m.jpg"],
        }
    )
    assert r.mask(t, r.in_range(act)).to_pylist() == [True, False, False]
    steps = Replaced("s3://b/src", sorted_units([]), ("ingest-manifest",))
    assert steps.in_range(act).to_pylist() == [], "a file may hold a replaced step's rows"


def test_a_root_whose_path_has_quotes_and_braces(tmp_path):
    """The plan's SQL names its staged files by path: a root named with a quote and braces
    ingests, and an unchanged re-run finds nothing new."""
    from PIL import Image

    src, root = tmp_path / "src", tmp_path / "it's {a} root"
    src.mkdir()
    for i in range(2):
        Image.new("RGB", (48, 48), (90 * i, 9, 9)).save(src / f"im{i}.png")
    (src / "metadata.jsonl").write_text(
        "".join(
            json.dumps({"file_name": f"im{i}.png", "text": f"square {i}"}) + "\n" for i in range(2)
        )
    )
    first = ingest_source(IngestConfig(source=str(src)), str(root))
    assert (first.accepted, first.quarantined) == (2, 0)
    again = ingest_source(IngestConfig(source=str(src)), str(root))
    assert again.reused and again.unchanged_items == 2


def test_a_metadata_column_null_in_the_first_ingest_takes_the_type_of_later_values(tmp_path):
    """A metadata column that no row of the first ingest has is not fixed as a string: the
    ingest that first brings values adds it to the table with their type."""
    from deltalake import DeltaTable
    from PIL import Image

    src = tmp_path / "src"
    src.mkdir()
    rows = []
    for i in range(2):
        Image.new("RGB", (48, 48), (80 * i, 10, 10)).save(src / f"im{i}.png")
        rows.append(json.dumps({"file_name": f"im{i}.png", "text": f"square {i}"}))
    (src / "metadata.jsonl").write_text("\n".join(rows) + "\n")
    cfg = IngestConfig(source=str(src), metadata_columns=["score"])
    root = tmp_path / "root"
    first = ingest_source(cfg, str(root))
    table = root / "catalog" / "tables" / "accepted"
    assert "score" not in DeltaTable(str(table)).schema().to_arrow().names
    Image.new("RGB", (48, 48), (1, 2, 3)).save(src / "im9.png")
    rows.append(json.dumps({"file_name": "im9.png", "text": "square 9", "score": 2.5}))
    (src / "metadata.jsonl").write_text("\n".join(rows) + "\n")
    second = ingest_source(cfg, str(root))
    assert (first.accepted, second.accepted, second.new_items) == (2, 3, 1)
    assert pa.schema(DeltaTable(str(table)).schema().to_arrow()).field("score").type == pa.float64()
    scores = _cat(root, second.ingest_id).set_index("key")["score"]
    assert scores["im9.png"] == 2.5 and scores[["im0.png", "im1.png"]].isna().all()
    # A declared column with no value anywhere is still a column of the view: the licence
    # check quarantines rows without a licence rather than finding no such column.
    lic = ingest_source(
        IngestConfig(source=str(src), metadata_columns=["license"]), str(tmp_path / "lic")
    )
    assert "license" in _cat(tmp_path / "lic", lic.ingest_id).columns
    rules = QualityConfig(allowed_licenses=["cc0"], max_reject_fraction=1.0)
    got = validate_catalog(str(tmp_path / "lic"), lic.ingest_id, rules)
    assert (got.clean, sum(got.reasons.values())) == (0, 3), got.reasons
    n = query(str(tmp_path / "lic"), "SELECT count(*) AS n FROM accepted WHERE license IS NULL")
    assert n.column("n").to_pylist() == [3]


def test_an_oversized_member_or_object_is_quarantined_unread(tmp_path, s3_bucket, s3_endpoint):
    """`ingest.max_bytes`: a gzip-compressed tar whose member expands to 5 MB of zeros (a few
    KB on disk) is quarantined `too_large` from its header, and its other samples pass; an
    object over the cap is refused after reading at most the cap (S3: from its length)."""
    import gzip

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (48, 48), (9, 90, 200)).save(buf, format="JPEG")
    jpg = buf.getvalue()
    members = [("ok.jpg", jpg), ("ok.txt", b"a blue square"), ("bomb.jpg", bytes(5_000_000))]
    src = tmp_path / "src"
    src.mkdir()
    (src / "00000.tar").write_bytes(gzip.compress(_tar_bytes([*members, ("bomb.txt", b"x")])))
    assert (src / "00000.tar").stat().st_size < 50_000
    cfg = IngestConfig(source=str(src), workers=1, max_bytes=100_000)
    res = ingest_source(cfg, str(tmp_path / "root"))
    q = _cat(tmp_path / "root", res.ingest_id, "view_quarantine")
    assert dict(zip(q["key"], q["reason"], strict=True)) == {"00000.tar/bomb": "too_large"}
    assert q["detail"][0] == "member bomb.jpg is 5000000 bytes, over 100000 (ingest.max_bytes)"
    assert list(_cat(tmp_path / "root", res.ingest_id)["key"]) == ["00000.tar/ok"]

    bucket, client = s3_bucket
    client.put_object(Bucket=bucket, Key="big/a.jpg", Body=bytes(3000))
    for store, key in [
        (Storage(str(src)), "00000.tar"),
        (Storage(f"s3://{bucket}", s3_endpoint), "big/a.jpg"),
    ]:
        with pytest.raises(ObjectTooLarge, match=r"is over 1000 bytes \(ingest.max_bytes\)"):
            store.read_bytes(key, 1000)
        assert len(store.read_bytes(key, 1_000_000)) == len(store.read_bytes(key))
