"""Automatic scores of a comparison's images, to set against the raters' votes.

Each regular pair gets its two images' CLIP score with the pair's prompt (the cosine of the
configured CLIP's normalised embeddings, as the curation rule computes it), and, with an
aesthetic head, their aesthetic scores. The embedder is models/embed_content.py's, run here
in-process: a comparison holds a few hundred images. `kiln rate report` hands the result to
`human_eval.report.proxy_agreement`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from data_quality.content.clip import AestheticHead, clip_scores
from human_eval.store import RatingStore
from kiln_config.errors import InputError

__all__ = ["pair_proxy_scores"]


def pair_proxy_scores(
    store: RatingStore,
    comparison_id: str,
    clip_model: str,
    aesthetic_head: str | None = None,
    batch_size: int = 32,
) -> tuple[dict[str, dict[int, tuple[float, float]]], dict[str, str]]:
    """({"clip_score": {pair id: (A's, B's)}, "aesthetic": ... (with a head)} over the
    comparison's regular pairs, {proxy: why it was skipped}): a head that does not load or
    fit the CLIP skips the aesthetic proxy alone.

    Raises:
        MetricUnavailable: the CLIP does not load.
    """
    # torch, transformers and streaming load here, when a report has a CLIP to run, not with
    # every `kiln rate` command.
    from models.embed_content import embed_captions, embed_images
    from models.evaluation.image_metrics import load_clip

    model, processor = load_clip(clip_model)
    pairs = [p for p in store.pairs(comparison_id) if not p.gold]
    paths = store.image_paths(comparison_id)
    ids = sorted({i for p in pairs for i in (p.image_a, p.image_b)})
    emb = {}
    for s in range(0, len(ids), batch_size):
        chunk = ids[s : s + batch_size]
        images = []
        for i in chunk:
            with Image.open(Path(paths[i])) as img:
                images.append(img.convert("RGB"))
        emb.update(zip(chunk, embed_images(model, processor, images), strict=True))
    prompts = sorted({p.prompt for p in pairs})
    text = dict(zip(prompts, embed_captions(model, processor, prompts), strict=True))
    out: dict[str, dict[int, tuple[float, float]]] = {"clip_score": {}}
    for p in pairs:
        t = np.stack([text[p.prompt], text[p.prompt]])
        a, b = clip_scores(np.stack([emb[p.image_a], emb[p.image_b]]), t)
        out["clip_score"][p.id] = (float(a), float(b))
    skipped = {}
    if aesthetic_head is not None:
        try:
            head = AestheticHead.load(aesthetic_head)
            out["aesthetic"] = {
                p.id: tuple(
                    float(x) for x in head.scores(np.stack([emb[p.image_a], emb[p.image_b]]))
                )
                for p in pairs
            }
        except InputError as e:
            skipped["aesthetic"] = str(e)
    return out, skipped
