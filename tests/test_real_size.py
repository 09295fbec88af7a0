"""The sd2-base recipe at its real widths through the real commands, as a user runs them.

`benchmarks/real_size.py --reduced` (the full-size run is the same script without
`--reduced`; docs/benchmarks.md, "Real-size run"): SD2-base's UNet widths (320/640/1280/1280),
head dimensions and 1024-wide cross-attention with one layer per block (583M parameters), the
real SD VAE and a 2-layer, 1024-wide text encoder, all with random weights from local folders
loaded through `pretrained:` paths. It runs `kiln demo-data`, `ingest`, `validate`, `shard`
(images, and precomputed latents and text states), `train` on the precomputed shards (two
stages, 64 -> 128 px, EMA on in bfloat16, the second's training process SIGKILLed after its
first checkpoint and resumed by the flow), `evaluate`, `register`, and loads the export in a
fresh process with diffusers. The killed stage is trained again without the kill, and both
must end bit-identical.

Two stages, not the benchmark's three: the second starts from the first's export, is killed
and resumed, and its export is what evaluate, register and the consumer load; a third stage
would repeat the hand-over at a larger size (the benchmark runs it). The first stage trains
one step: its export is all the second needs, and each step and checkpoint at this size costs
tens of seconds; the killed stage trains two, so that the kill lands between checkpoints.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent
REDUCED_UNET_PARAMETERS = 583_480_964  # SD2-base's UNet with layers_per_block 1


@pytest.fixture(scope="module")
def real_size(tmp_path_factory, _prefect_api):
    from prefect.settings import PREFECT_API_URL

    work = tmp_path_factory.mktemp("real-size")
    # The session's Prefect server, as tests/test_learning.py does: each `kiln` command would
    # otherwise start a temporary one.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["PREFECT_API_URL"] = PREFECT_API_URL.value()
    out = work / "real_size.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "real_size.py"),
            "--reduced",
            "--steps",
            "1,2",
            "--train-on",
            "latents",
            "--reference",
            "--resolutions",
            "64,128",
            "--work",
            str(work / "w"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=1500,
    )
    log = work / "w" / "commands.log"
    tail = log.read_text()[-4000:] if log.is_file() else ""
    try:
        assert proc.returncode == 0, proc.stderr[-3000:] + tail
        yield json.loads(out.read_text()), work / "w"
    finally:
        # About 26 GB of exports, shards and the registry's copy: pytest keeps the temporary
        # folders of its last three sessions, which would hold three of these.
        shutil.rmtree(work, ignore_errors=True)


def test_three_stages_trained_and_the_killed_one_resumed_exactly(real_size):
    r, _ = real_size
    assert r["steps"]["train"]["killed"], "the training process was SIGKILLed mid-stage"
    stages = r["stages"]
    assert [stages[k]["final_step"] for k in ("64", "128")] == [1, 2]
    assert stages["128"]["resumed"] and not stages["64"]["resumed"]
    ref = r["reference"]
    assert ref["bit_exact"] == {"final/unet": True, "final-raw/unet": True}
    assert ref["losses_equal"]


def test_bf16_ema_halves_its_checkpoint_share(real_size):
    files = real_size[0]["stages"]["128"]["checkpoint_files_gib"]
    model, ema = files["model.safetensors"], files["custom_checkpoint_0.pkl"]
    assert 0.45 < ema / model < 0.55, files


def test_export_loads_with_diffusers_at_the_real_widths(real_size):
    r, work = real_size
    c = r["consumer"]
    assert c["unet_parameters"] == REDUCED_UNET_PARAMETERS
    assert (c["text_width"], c["text_layers"], c["scaling_factor"]) == (1024, 2, 0.18215)
    assert c["size"] == [128, 128]
    assert (work / "generated.png").stat().st_size > 0


def test_study_and_registry(real_size):
    r, _ = real_size
    assert r["study"]["images"] == 2
    assert r["registered"]["alias"] == "candidate" and int(r["registered"]["version"]) >= 1
