"""Statistics against known answers: simulated rates, a literature example, a direct loop."""

import numpy as np
import pytest

from human_eval.stats import (
    bootstrap_ci,
    bradley_terry,
    draw_clusters,
    krippendorff_alpha,
    preference,
    scores_of,
)


def test_ties_count_half():
    rate, ties = preference(scores_of(["a", "b", "tie", "tie"]))
    assert rate == pytest.approx(0.5)
    assert ties == pytest.approx(0.5)
    rate, ties = preference(scores_of(["a", "a", "a", "tie"]))
    assert rate == pytest.approx(3.5 / 4)
    assert ties == pytest.approx(0.25)
    with pytest.raises(ValueError, match="answer must be one of"):
        scores_of(["left"])


def _simulate(rng, n_prompts=200, raters=5, p_a=0.6, p_tie=0.2):
    """Votes with a prompt effect: each prompt has its own chance of A (mean p_a)."""
    q = rng.beta(6 * p_a, 6 * (1 - p_a), n_prompts)
    prompts = np.repeat(np.arange(n_prompts), raters)
    u = rng.random(prompts.size)
    tie = u < p_tie
    a_wins = rng.random(prompts.size) < q[prompts]
    scores = np.where(tie, 0.5, a_wins.astype(float))
    return scores, prompts


def test_bootstrap_ci_covers_the_true_rate():
    """>= 93 of 100 simulated comparisons with a known rate (0.8 * 0.6 + 0.2 / 2 = 0.58)."""
    rng = np.random.default_rng(1234)
    truth = 0.8 * 0.6 + 0.1
    covered = 0
    for k in range(100):
        scores, prompts = _simulate(rng)
        low, high = bootstrap_ci(scores, prompts, n_resamples=2000, seed=k)
        covered += low <= truth <= high
    assert covered >= 93, covered


def test_bootstrap_matches_a_direct_computation():
    rng = np.random.default_rng(7)
    scores, prompts = _simulate(rng, n_prompts=30, raters=3)
    low, high = bootstrap_ci(scores, prompts, n_resamples=500, seed=3)
    # The same draws, pooled vote by vote in a plain loop.
    clusters = sorted(set(prompts.tolist()), key=str)
    rates = []
    for draw in draw_clusters(len(clusters), 500, 3):
        pooled = [s for c in draw for s, p in zip(scores, prompts, strict=True) if p == clusters[c]]
        rates.append(sum(pooled) / len(pooled))
    assert (low, high) == pytest.approx(tuple(np.percentile(rates, [2.5, 97.5])))
    assert bootstrap_ci(scores, prompts, n_resamples=500, seed=3) == (low, high)  # seeded


def test_krippendorff_alpha_binary_example_worked_by_hand():
    """Krippendorff (2011), "Computing Krippendorff's Alpha-Reliability", section A."""
    a = [0, 1, 0, 0, 0, 0, 0, 0, 1, 0]
    b = [1, 1, 1, 0, 0, 1, 0, 0, 0, 0]
    units = {i: [str(x), str(y)] for i, (x, y) in enumerate(zip(a, b, strict=True))}
    alpha, used = krippendorff_alpha(units, values=("0", "1"))
    # By hand: coincidences o00 = 10, o01 = o10 = 4, o11 = 2; n0 = 14, n1 = 6, n = 20.
    d_observed = (4 + 4) / 20
    d_expected = (14 * 6 + 6 * 14) / (20 * 19)
    assert alpha == pytest.approx(1 - d_observed / d_expected)
    assert round(alpha, 3) == 0.095
    assert used == 10


def test_krippendorff_alpha_with_missing_data_example():
    """The same paper's 4 observers x 12 units with missing values: nominal alpha 0.743."""
    obs = [
        "1 2 3 3 2 1 4 1 2 . . .",
        "1 2 3 3 2 2 4 1 2 5 . 3",
        ". 3 3 3 2 3 4 2 2 5 1 .",
        "1 2 3 3 2 4 4 1 2 5 1 .",
    ]
    grid = [row.split() for row in obs]
    units = {u: [r[u] for r in grid if r[u] != "."] for u in range(12)}
    alpha, used = krippendorff_alpha(units, values=tuple("12345"))
    assert round(alpha, 3) == 0.743
    assert used == 11  # unit 12 has one value only


def test_bradley_terry_recovers_the_order_of_three_models():
    rng = np.random.default_rng(0)
    strength = {0: -1.0, 1: 1.0, 2: 0.0}  # true order: 1, 2, 0
    outcomes = []
    for i, j in [(0, 1), (0, 2), (1, 2)]:
        p = 1 / (1 + np.exp(strength[j] - strength[i]))
        for _ in range(150):
            u = rng.random()
            outcomes.append((i, j, 0.5 if u < 0.1 else float(rng.random() < p)))
    bt = bradley_terry(3, outcomes, n_resamples=100, seed=0)
    assert bt["order"] == [1, 2, 0]
    # The best and the worst model's intervals do not overlap.
    assert bt["ci"][1][0] > bt["ci"][0][1]
    for k in range(3):
        assert bt["ci"][k][0] <= bt["strength"][k] <= bt["ci"][k][1]


def test_bradley_terry_is_choix_fit_with_a_tie_as_half_a_win_each_way():
    """The fit on win counts equals choix's fit on (winner, loser) pairs: a win entered
    twice, a tie once each way."""
    import choix

    outcomes = [(0, 1, 1.0), (0, 1, 0.5), (1, 2, 1.0), (2, 1, 0.0), (0, 2, 0.0), (2, 0, 0.5)]
    pairs = [
        (0, 1),
        (0, 1),
        (0, 1),
        (1, 0),
        (1, 2),
        (1, 2),
        (1, 2),
        (1, 2),
        (2, 0),
        (2, 0),
        (2, 0),
        (0, 2),
    ]
    expected = choix.ilsr_pairwise(3, pairs, alpha=0.01)
    got = bradley_terry(3, outcomes, n_resamples=100, seed=0)["strength"]
    assert got == pytest.approx(expected.tolist(), abs=1e-9)
