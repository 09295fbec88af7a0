"""The pixel-level caption check that the learning benchmark scores generated images with."""

import json

import numpy as np
import pytest
from PIL import Image

from kiln_demo.data import write_demo_dataset
from kiln_demo.faithfulness import faithfulness, parse_caption, score_image


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    d = tmp_path_factory.mktemp("demo")
    write_demo_dataset(d, n=80, seed=5)
    rows = [json.loads(line) for line in (d / "metadata.jsonl").read_text().splitlines()]
    rows = [r for r in rows if not r["file_name"].startswith("bad")]
    return [Image.open(d / r["file_name"]).convert("RGB") for r in rows], [r["text"] for r in rows]


def test_true_images_match_their_captions_far_above_chance(demo):
    images, captions = demo
    full = faithfulness(images, captions)
    assert full["colour_match"] == 1.0 and full["relation_match"] == 1.0
    assert full["colour_match_chance"] < 0.2 and full["relation_match_chance"] < 0.1
    assert full["background_match"] == 1.0 and full["background_match_chance"] < 0.6
    # At the tiny preset's 32 px, as the model generates them.
    small = faithfulness([i.resize((32, 32), Image.BICUBIC) for i in images], captions)
    assert small["colour_match"] >= 0.9 and small["relation_match"] >= 0.9
    assert small["background_match"] == 1.0


def test_noise_scores_at_chance(demo):
    _, captions = demo
    rng = np.random.default_rng(0)
    noise = [Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)) for _ in captions]
    r = faithfulness(noise, captions)
    assert r["colour_match"] < 0.3
    assert abs(r["colour_match"] - r["colour_match_chance"]) < 0.15


def test_background_is_read_from_the_border():
    img = Image.new("RGB", (32, 32), (15, 12, 20))  # near black
    img.paste((250, 250, 250), (6, 6, 26, 26))  # a big white square inside
    caption = "a blue circle above a red square on a {} background"
    assert score_image(img, caption.format("black")).background_match
    assert not score_image(img, caption.format("grey")).background_match
    assert not score_image(img, caption.format("white")).background_match


def test_relation_is_read_from_the_pixels():
    img = Image.new("RGB", (32, 32), (250, 250, 250))
    img.paste((220, 40, 40), (8, 2, 24, 14))  # red on top
    img.paste((40, 80, 220), (8, 18, 24, 30))  # blue below
    above = "a red square above a blue circle on a white background"
    below = "a red square below a blue circle on a white background"
    assert score_image(img, above).relation_match
    assert score_image(img, below).colour_match and not score_image(img, below).relation_match
    assert not score_image(
        img, "a green square above a blue circle on a white background"
    ).colour_match


def test_bad_captions_are_named():
    with pytest.raises(ValueError, match="not a demo-style caption"):
        parse_caption("a photo of a cat")
    with pytest.raises(ValueError, match="unknown colour 'pink'"):
        parse_caption("a pink circle above a blue square on a white background")
    with pytest.raises(ValueError, match="at least two"):
        faithfulness(
            [Image.new("RGB", (4, 4))], ["a red circle above a blue square on a white background"]
        )
