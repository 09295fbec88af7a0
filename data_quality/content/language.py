"""A caption's language: Lingua's packaged n-gram models (Apache-2.0, in the wheel).

Lingua holds every language it can tell apart in memory once loaded (about 1.3 GB and 4 s for
all 75 in its high-accuracy mode); Kiln loads the common ones (`CANDIDATES`) plus the
allowed, about 600 MB and 2 s once per process, and detects about 7,000 captions a second on
two cores (docs/benchmarks.md, "Content rules"). Its low-accuracy mode took a Spanish caption
for Azerbaijani here, so it is not used. A caption's language is its top candidate; below
quality.min_language_confidence it is `und` (undetermined): short captions ("a cat") are
often ambiguous.

Short captions are mostly names, and a name reads as its own language: `finland flag` came out
Swedish, `kenya flag` Indonesian, `mikko virtanen` Finnish. So the rule judges on evidence
(`verdict`): a caption is of another language only when its top language is not allowed, at
`quality.min_language_confidence` or more, and either no allowed language is possible at all
(a caption in another script) or the caption has `quality.min_language_words` words or more
and no allowed language holds more than `quality.max_allowed_language_confidence` (Lingua
spreads about 1/30 over its candidates when a caption says nothing either way) or, from
`LONG_CAPTION_WORDS` words, the top language is `quality.min_language_ratio` times as likely
as the best allowed one. On the captions the tests build (tests/data/captions/: place and
people names in English captions, and captions in fifteen other languages) that keeps over 99%
of the English and finds most of the others, where the top language alone lost 16% of the
English (docs/benchmarks.md, "Caption language").
"""

from __future__ import annotations

import hashlib
import threading

import numpy as np

from data_quality.content import package_version
from kiln_config.errors import InputError

__all__ = ["CANDIDATES", "UNDETERMINED", "allowed_scorer", "detect", "scorer", "verdict"]

UNDETERMINED = "und"
LONG_CAPTION_WORDS = 5  # from here on, the likelihood ratio is evidence enough
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


def allowed_scorer(allowed: list[str]) -> str:
    """The content store's name for the best allowed language's confidence (`detect`'s third
    value): it depends on which languages are allowed."""
    return f"{scorer(allowed)}-allowed-{'-'.join(sorted(set(allowed)))}"


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


def detect(
    captions: list[str], allowed: list[str] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ISO 639-1 code, confidence) of each caption's top language among `CANDIDATES` and
    `allowed`, and the highest confidence of an `allowed` language; an empty caption gives
    ('und', 0, 0)."""
    codes = tuple(sorted({*CANDIDATES, *(allowed or [])}))
    det = _detector(codes)
    lang = np.full(len(captions), UNDETERMINED, dtype=object)
    conf = np.zeros(len(captions), np.float32)
    best_allowed = np.zeros(len(captions), np.float32)
    ok = set(allowed or [])
    todo = [i for i, c in enumerate(captions) if isinstance(c, str) and c.strip()]
    values = det.compute_language_confidence_values_in_parallel([captions[i] for i in todo])
    for i, vals in zip(todo, values, strict=True):
        if vals:
            lang[i] = vals[0].language.iso_code_639_1.name.lower()
            conf[i] = vals[0].value
            best_allowed[i] = max(
                (v.value for v in vals if v.language.iso_code_639_1.name.lower() in ok),
                default=0.0,
            )
    return lang, conf, best_allowed


def verdict(captions, code, conf, best_allowed, rules) -> np.ndarray:
    """Each caption's language for the rule: its top language where the evidence is clear (an
    allowed one at `min_language_confidence`; another one only as the module docstring says),
    else 'und', which passes.

    Args:
        captions: The captions (their word counts are evidence).
        code: `detect`'s top languages.
        conf: Their confidences.
        best_allowed: The best allowed language's confidence of each caption.
        rules: The `QualityConfig` (`allowed_languages` and the evidence settings).
    """
    code = np.asarray(code, dtype=object)
    conf = np.asarray(conf, dtype=float)
    words = np.array([len(str(c).split()) if isinstance(c, str) else 0 for c in captions])
    allowed = np.isin(code, list(rules.allowed_languages or []))
    best_allowed = np.asarray(best_allowed, dtype=float)
    against = (best_allowed <= rules.max_allowed_language_confidence) | (
        (words >= LONG_CAPTION_WORDS) & (conf >= rules.min_language_ratio * best_allowed)
    )
    # No allowed language at all (another script: Lingua rules out the languages whose
    # alphabet the caption does not use) is evidence however few its words; Chinese, Japanese
    # and Thai captions have no spaces to count.
    other = ((words >= rules.min_language_words) & against) | (best_allowed <= 0.0)
    clear = (conf >= rules.min_language_confidence) & (allowed | other)
    return np.where(clear, code, UNDETERMINED)
