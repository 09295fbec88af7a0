"""A caption's language: Lingua's packaged n-gram models (Apache-2.0, in the wheel).

Lingua holds every language it can tell apart in memory once loaded (about 1.3 GB and 4 s for
all 75 in its high-accuracy mode); Kiln loads the common ones (`CANDIDATES`) plus the
allowed, about 600 MB and 2 s once per process, and detects about 7,000 captions a second on
two cores (docs/benchmarks.md, "Content rules"). Its low-accuracy mode took a Spanish caption
for Azerbaijani here, so it is not used. A caption's language is its top candidate; below
quality.min_language_confidence it is `und` (undetermined): short captions ("a cat") are
often ambiguous.
"""

from __future__ import annotations

import hashlib
import threading

import numpy as np

from data_quality.content import package_version
from kiln_config.errors import InputError

__all__ = ["CANDIDATES", "UNDETERMINED", "detect", "scorer"]

UNDETERMINED = "und"
# The widespread written languages of web-scale caption sets (ISO 639-1).
CANDIDATES = [
    "en",
    "de",
    "fr",
    "es",
    "it",
    "pt",
    "nl",
    "pl",
    "ru",
    "uk",
    "cs",
    "sv",
    "da",
    "nb",
    "fi",
    "tr",
    "ar",
    "fa",
    "he",
    "hi",
    "ja",
    "ko",
    "zh",
    "vi",
    "id",
    "th",
    "el",
    "hu",
    "ro",
]


def scorer(extra: list[str] | None = None) -> str:
    """The content store's name for the languages `detect` tells apart with `extra`: another
    candidate set (or Lingua version) labels again."""
    codes = sorted({*CANDIDATES, *(extra or [])})
    digest = hashlib.sha256(" ".join(codes).encode()).hexdigest()[:8]
    return f"lingua-{package_version('lingua-language-detector')}-{len(codes)}-{digest}"


_DETECTORS: dict[tuple[str, ...], object] = {}
_LOCK = threading.Lock()


def _detector(codes: tuple[str, ...]):
    try:
        from lingua import IsoCode639_1, LanguageDetectorBuilder
    except ImportError as e:
        raise InputError(
            "quality.allowed_languages needs Lingua: pip install lingua-language-detector "
            "(a dependency of Kiln), or unset it"
        ) from e
    with _LOCK:
        if codes not in _DETECTORS:
            isos = []
            for c in codes:
                iso = getattr(IsoCode639_1, c.upper(), None)
                if iso is None:
                    raise InputError(f"quality.allowed_languages: Lingua has no language {c!r}")
                isos.append(iso)
            _DETECTORS[codes] = LanguageDetectorBuilder.from_iso_codes_639_1(*isos).build()
        return _DETECTORS[codes]


def detect(captions: list[str], extra: list[str] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(ISO 639-1 code, confidence) of each caption's top language among `CANDIDATES` and
    `extra`; an empty caption gives ('und', 0)."""
    codes = tuple(sorted({*CANDIDATES, *(extra or [])}))
    det = _detector(codes)
    lang = np.full(len(captions), UNDETERMINED, dtype=object)
    conf = np.zeros(len(captions), np.float32)
    todo = [i for i, c in enumerate(captions) if isinstance(c, str) and c.strip()]
    values = det.compute_language_confidence_values_in_parallel([captions[i] for i in todo])
    for i, vals in zip(todo, values, strict=True):
        if vals:
            lang[i] = vals[0].language.iso_code_639_1.name.lower()
            conf[i] = vals[0].value
    return lang, conf
