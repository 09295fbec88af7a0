"""Preference statistics as pure functions over plain arrays.

- A's preference rate counts a tie as half a win (Imagen's DrawBench protocol).
- Its 95% interval comes from a bootstrap that resamples *prompts*, not votes: the votes on
  one prompt (several raters, several seeds) are correlated, and resampling them one by one
  would give intervals that are too narrow.
- Inter-rater agreement is Krippendorff's alpha (nominal), from the `krippendorff` package.
- A ranking of three or more models is a Bradley-Terry fit from `choix` (I-LSR on a matrix
  of win counts), its intervals from as many resamples as the preference's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = [
    "SCORES",
    "bootstrap_ci",
    "bradley_terry",
    "krippendorff_alpha",
    "preference",
    "scores_of",
]

# A vote's score for side A: a win, a loss, or half for a tie ("indifferent").
SCORES = {"a": 1.0, "b": 0.0, "tie": 0.5}


def scores_of(answers: Sequence[str]) -> np.ndarray:
    """Answers (a / b / tie) as A's scores (1 / 0 / 0.5)."""
    try:
        return np.array([SCORES[a] for a in answers], dtype=float)
    except KeyError as e:
        raise ValueError(f"answer must be one of {sorted(SCORES)} (got {e.args[0]!r})") from None


def preference(scores: np.ndarray) -> tuple[float, float]:
    """(A's preference rate with ties as half, share of ties); NaNs when there are no votes."""
    scores = np.asarray(scores, dtype=float)
    if scores.size == 0:
        return float("nan"), float("nan")
    return float(scores.mean()), float(np.mean(scores == 0.5))


def bootstrap_ci(
    scores: np.ndarray,
    clusters: Sequence,
    *,
    n_resamples: int,
    level: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile interval of the preference rate, resampling clusters (prompts).

    Each resample draws as many clusters as there are, with replacement, and pools their
    votes: the rate is (sum of the drawn clusters' scores) / (their vote count).

    Args:
        scores: A's score per vote (1, 0, 0.5).
        clusters: the prompt of each vote; votes of one prompt are drawn together.
        n_resamples: bootstrap resamples (`human_eval.bootstrap_resamples`).
        level: coverage of the interval.
        seed: the generator's seed; the same inputs and seed give the same interval.
    """
    scores = np.asarray(scores, dtype=float)
    if scores.size == 0:
        return float("nan"), float("nan")
    if len(clusters) != scores.size:
        raise ValueError(f"clusters: one per vote needed ({scores.size}), got {len(clusters)}")
    _, inverse = np.unique(np.asarray(clusters, dtype=object).astype(str), return_inverse=True)
    sums = np.bincount(inverse, weights=scores)
    counts = np.bincount(inverse).astype(float)
    idx = draw_clusters(len(sums), n_resamples, seed)
    rates = sums[idx].sum(axis=1) / counts[idx].sum(axis=1)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(rates, [tail, 100 - tail])
    return float(low), float(high)


def draw_clusters(n_clusters: int, n_resamples: int, seed: int) -> np.ndarray:
    """The cluster indices of every resample, (n_resamples, n_clusters)."""
    return np.random.default_rng(seed).integers(0, n_clusters, size=(n_resamples, n_clusters))


def krippendorff_alpha(
    units: dict, *, values: Sequence[str] = ("a", "b", "tie")
) -> tuple[float, int]:
    """Krippendorff's alpha (nominal) over units rated by several raters.

    Args:
        units: unit (pair) -> the answers given by its raters (any number each).
        values: the answer categories.

    Returns:
        (alpha, number of units it used: those with two answers or more); alpha is NaN when
        fewer than two units qualify or every answer is the same.
    """
    import krippendorff

    code = {v: i for i, v in enumerate(values)}
    rows = [[code[a] for a in answers] for answers in units.values() if len(answers) >= 2]
    if len(rows) < 2:
        return float("nan"), len(rows)
    counts = np.zeros((len(rows), len(values)), dtype=int)
    for i, row in enumerate(rows):
        np.add.at(counts[i], row, 1)
    if np.count_nonzero(counts.sum(axis=0)) < 2:
        return float("nan"), len(rows)  # one category only: agreement is undefined
    alpha = krippendorff.alpha(value_counts=counts, level_of_measurement="nominal")
    return float(alpha), len(rows)


def bradley_terry(
    n_models: int,
    outcomes: Sequence[tuple[int, int, float]],
    *,
    n_resamples: int,
    level: float = 0.95,
    seed: int = 0,
) -> dict:
    """Bradley-Terry strengths of `n_models` from pairwise outcomes, with bootstrap intervals.

    Args:
        outcomes: (i, j, score of i): 1 when i won, 0 when j won, 0.5 for a tie. A tie counts
            as half a win each way: every outcome enters `choix` twice, a tie once each way.
        n_resamples: bootstrap resamples of the outcomes for the intervals
            (`human_eval.bootstrap_resamples`).

    Returns:
        {"strength": [...], "ci": [[low, high], ...], "order": model indices, strongest
        first}; strengths are log-scale and centred on 0.
    """
    import choix

    data = np.asarray(outcomes, dtype=float).reshape(-1, 3)
    if data.shape[0] == 0:
        raise ValueError("bradley_terry: no outcomes")

    def fit(rows: np.ndarray) -> np.ndarray:
        # Wins as counts, wins[i, j]: times i beat j (in half-outcomes); the dense form of
        # the same I-LSR fit, so that a resample costs array sums, not a Python list.
        i, j = rows[:, 0].astype(int), rows[:, 1].astype(int)
        wins = np.zeros((n_models, n_models))
        np.add.at(wins, (i, j), np.round(2 * rows[:, 2]))
        np.add.at(wins, (j, i), np.round(2 * (1 - rows[:, 2])))
        # A small L2 penalty keeps the fit finite when one model never loses.
        return choix.ilsr_pairwise_dense(wins, alpha=0.01)

    strength = fit(data)
    rng = np.random.default_rng(seed)
    boots = np.array([fit(data[rng.integers(0, len(data), len(data))]) for _ in range(n_resamples)])
    tail = (1 - level) / 2 * 100
    ci = np.percentile(boots, [tail, 100 - tail], axis=0).T
    return {
        "strength": strength.tolist(),
        "ci": ci.tolist(),
        "order": [int(k) for k in np.argsort(-strength)],
    }
