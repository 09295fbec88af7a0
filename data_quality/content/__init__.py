"""Curation by content: what an image shows and what its caption says, as quality rules.

- `unsafe`: NudeNet's packaged ONNX detector, an unsafe probability per image;
- `language`: Lingua's packaged models, a caption's language and the confidence in it;
- `clip`: a team's CLIP (a local folder), image and caption embeddings, their cosine (the
  CLIP score) and a LAION-style linear aesthetic head on the image embedding;
- `semdedup`: SemDeDup over the image embeddings (faiss k-means, then cosine similarity
  within each cluster);
- `store`: the scores and embeddings, once per image content hash (sha256) and per caption,
  in Delta tables beside the catalog, so a changed threshold re-decides without recomputing.

tasks/quality/content.py runs them for `kiln validate`; models/embed_content.py is the
accelerate launch that computes the CLIP embeddings.
"""

from importlib import metadata

__all__ = ["package_version"]


def package_version(name: str) -> str:
    """An installed distribution's version ("missing" without it): part of a scorer's name,
    so that a new version scores again."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "missing"
