"""The unsafe probability of an image: NudeNet's packaged detector (YOLOv8n at 320 px, ONNX).

NudeNet's own `NudeDetector.detect` keeps boxes scoring 0.2 or more after non-maximum
suppression; a quality rule wants one number per image with its full range, so this reads the
detector's raw output instead: the highest class score of an exposed-body class over all of
its anchors (`UNSAFE_CLASSES`). Pre-processing is NudeNet's: pad to a square at the bottom and
right with black, resize to 320 x 320, RGB scaled to [0, 1].

The `nudenet` wheel (3.4.2) and its model ship under the GNU AGPL-3.0 (the wheel's LICENSE
file; its metadata says MIT): running it inside a team's own pipeline does not distribute it,
but a team that ships Kiln with it to others must honour the AGPL.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
from PIL import Image

from data_quality.content import package_version
from kiln_config.errors import InputError

__all__ = ["SCORER", "UNSAFE_CLASSES", "UnsafeDetector", "detector", "preprocess"]

# NudeNet 3.x's class order (nudenet/nudenet.py `__labels`); the raw output's rows are four
# box coordinates, then one score per class in this order.
_LABELS = [
    "FEMALE_GENITALIA_COVERED",
    "FACE_FEMALE",
    "BUTTOCKS_EXPOSED",
    "FEMALE_BREAST_EXPOSED",
    "FEMALE_GENITALIA_EXPOSED",
    "MALE_BREAST_EXPOSED",
    "ANUS_EXPOSED",
    "FEET_EXPOSED",
    "BELLY_COVERED",
    "FEET_COVERED",
    "ARMPITS_COVERED",
    "ARMPITS_EXPOSED",
    "FACE_MALE",
    "BELLY_EXPOSED",
    "MALE_GENITALIA_EXPOSED",
    "ANUS_COVERED",
    "FEMALE_BREAST_COVERED",
    "BUTTOCKS_COVERED",
]
UNSAFE_CLASSES = (
    "FEMALE_GENITALIA_EXPOSED",
    "MALE_GENITALIA_EXPOSED",
    "FEMALE_BREAST_EXPOSED",
    "BUTTOCKS_EXPOSED",
    "ANUS_EXPOSED",
)
SIZE = 320


SCORER = f"nudenet-{package_version('nudenet')}-320n"
"""Names the detector whose scores the content store holds: a new version scores again."""


def preprocess(img: Image.Image) -> np.ndarray:
    """NudeNet's input for one RGB image: float32 (3, 320, 320) in [0, 1]."""
    side = max(img.size)
    canvas = Image.new("RGB", (side, side))
    canvas.paste(img.convert("RGB"), (0, 0))
    arr = np.asarray(canvas.resize((SIZE, SIZE), Image.BILINEAR), np.float32) / 255.0
    return arr.transpose(2, 0, 1)


class UnsafeDetector:
    """NudeNet's ONNX session; `scores(images)` gives each image's unsafe probability."""

    def __init__(self, threads: int = 0):
        try:
            import nudenet
            import onnxruntime
        except ImportError as e:
            raise InputError(
                "quality.max_unsafe needs NudeNet: pip install nudenet (a dependency of "
                "Kiln), or unset it"
            ) from e
        opts = onnxruntime.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        model = Path(nudenet.__file__).with_name("320n.onnx")
        self.session = onnxruntime.InferenceSession(
            str(model), opts, providers=["CPUExecutionProvider"]
        )
        self.input = self.session.get_inputs()[0].name
        self.rows = np.array([4 + _LABELS.index(c) for c in UNSAFE_CLASSES])

    def scores(self, images: list[Image.Image], batch: int = 16) -> np.ndarray:
        """The unsafe probability of each image (float32 in [0, 1])."""
        out = np.zeros(len(images), np.float32)
        for s in range(0, len(images), batch):
            x = np.stack([preprocess(i) for i in images[s : s + batch]])
            raw = self.session.run(None, {self.input: x})[0]  # (batch, 4 + classes, anchors)
            out[s : s + len(x)] = raw[:, self.rows, :].max(axis=(1, 2))
        return out


_DETECTOR: UnsafeDetector | None = None
_LOCK = threading.Lock()


def detector() -> UnsafeDetector:
    """One detector per process (its session is safe to run from several threads)."""
    global _DETECTOR
    with _LOCK:
        if _DETECTOR is None:
            _DETECTOR = UnsafeDetector()
        return _DETECTOR
