"""The count of accepted images new since a training's catalog: from the rows ingested since
it when that catalog is behind in the chain, the same as comparing the two views whole."""

import json
import os
import shutil

import numpy as np
import pandas as pd

from kiln_config import IngestConfig
from kiln_demo.data import write_demo_dataset
from tasks.catalog.view import scan_view
from tasks.ingest.run import ingest_source
from tasks.registry.new_data import _view_identities, new_since
from tasks.storage.layout import Layout


def _whole(layout, ingest_id, trained):
    return int(
        (~np.isin(_view_identities(layout, ingest_id), _view_identities(layout, trained))).sum()
    )


def test_new_since_a_catalog_behind_matches_the_whole_comparison(tmp_path):
    src, more, root = tmp_path / "src", tmp_path / "more", tmp_path / "root"
    write_demo_dataset(src, n=20, seed=0)
    write_demo_dataset(more, n=12, seed=5)
    ing = lambda: ingest_source(IngestConfig(source=str(src)), str(root)).ingest_id  # noqa: E731
    layout = Layout(root)
    trained = ing()
    assert new_since(layout, trained, trained) == 0

    # Three new images, one recaptioned, one read again unchanged (a new mtime), one deleted.
    rows = [json.loads(ln) for ln in (src / "metadata.jsonl").read_text().splitlines()]
    names = sorted(p.name for p in more.glob("0000[0-2].jpg"))
    for name in names:
        shutil.copy(more / name, src / f"new-{name}")
        rows.append(
            {
                **next(r for r in rows if r["file_name"].endswith(".jpg")),
                "file_name": f"new-{name}",
                "text": f"a new photo {name}",
            }
        )
    recaptioned, touched, deleted = "00000.jpg", "00001.jpg", "00002.jpg"
    for r in rows:
        if r["file_name"] == recaptioned:
            r["text"] = "the same photo, captioned again"
    (src / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    st = (src / touched).stat()
    os.utime(src / touched, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    (src / deleted).unlink()
    later = ing()
    assert later != trained

    since = pd.concat(scan_view(layout, later, "accepted", ["key"], after_seq=1))["key"]
    assert touched in set(since) and recaptioned in set(since), "both were read again"
    got = new_since(layout, later, trained)
    assert got == _whole(layout, later, trained) == len(names) + 1
    # A trained catalog that is not behind (here: ahead) is compared whole.
    assert new_since(layout, trained, later) == _whole(layout, trained, later) == 2
