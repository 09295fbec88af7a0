"""How `catalog/` here was written: Kiln's chain-layout ingest (one folder per ingest, rows in
its own `accepted.parquet` / `quarantine.parquet`, `superseded.parquet` naming the units that
left the view; read by `tasks.catalog.legacy`). Run with such a Kiln on PYTHONPATH:

    python make.py OUT_DIR
"""

import json
import sys
from pathlib import Path

from kiln_config import IngestConfig
from kiln_demo.data import write_demo_dataset
from tasks.ingest.run import ingest_source


def main() -> None:
    from PIL import Image

    base = Path(sys.argv[1])
    a, b, root = base / "src-a", base / "src-b", base / "root"
    write_demo_dataset(a, n=12, seed=1)
    write_demo_dataset(b, n=8, seed=2)
    ingest_source(IngestConfig(source=str(a), workers=1), str(root))
    ingest_source(IngestConfig(source=str(b), workers=1), str(root))
    for i in range(3):
        Image.new("RGB", (64, 64), (10 * i, 120, 240)).save(a / f"new-{i}.jpg", quality=90)
    with open(a / "metadata.jsonl", "a") as f:
        f.writelines(
            json.dumps({"file_name": f"new-{i}.jpg", "text": f"new {i}"}) + "\n" for i in range(3)
        )
    victim = sorted(p for p in a.glob("*.jpg") if not p.name.startswith("new-"))[0]
    victim.unlink()
    ingest_source(IngestConfig(source=str(a), workers=1), str(root))


if __name__ == "__main__":
    main()
