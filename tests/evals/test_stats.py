"""tenantq.evals.stats against hand-computed tables and a known-delta simulation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tenantq.evals import stats


def test_mcnemar_matches_hand_computed_binomial_table() -> None:
    # b=1, c=6: P[X<=1] for X~Bin(7, 1/2) = (1 + 7)/128, two-sided p = 16/128 = 0.125.
    assert stats.mcnemar_exact(1, 6) == pytest.approx(16 / 128, abs=1e-12)
    # b=0, c=5: 2 * (1/32) = 0.0625.
    assert stats.mcnemar_exact(0, 5) == pytest.approx(0.0625, abs=1e-12)
    # b=c: the p-value is capped at 1; nothing discordant is 1.
    assert stats.mcnemar_exact(3, 3) == 1.0 and stats.mcnemar_exact(0, 0) == 1.0
    # b=2, c=10: 2 * (1 + 12 + 66) / 4096.
    assert stats.mcnemar_exact(2, 10) == pytest.approx(2 * 79 / 4096, abs=1e-12)


def test_discordant_counts() -> None:
    base = np.array([1, 1, 0, 0, 1], bool)
    cand = np.array([1, 0, 1, 0, 0], bool)
    assert stats.discordant_counts(base, cand) == (2, 1)


def test_bootstrap_identical_data_has_zero_width_ci_and_is_seeded() -> None:
    x = np.random.default_rng(0).normal(size=200)
    ci = stats.paired_bootstrap(x, x)
    assert ci.delta == 0.0 and ci.ci_low == 0.0 and ci.ci_high == 0.0
    a = stats.paired_bootstrap(x, x + np.random.default_rng(1).normal(size=200), seed=3)
    b = stats.paired_bootstrap(x, x + np.random.default_rng(1).normal(size=200), seed=3)
    assert a == b


def test_bootstrap_ci_of_weighted_mean_contains_the_point() -> None:
    rng = np.random.default_rng(2)
    b, c, w = rng.normal(size=50), rng.normal(size=50) + 0.5, rng.integers(1, 10, 50)
    ci = stats.paired_bootstrap(b, c, weights=w, resamples=2000)
    assert ci.delta == pytest.approx(np.dot(w, c - b) / w.sum())
    assert ci.ci_low < ci.delta < ci.ci_high


@pytest.mark.slow
def test_bootstrap_coverage_is_nominal_on_known_delta() -> None:
    # 600 repetitions of paired normal data with a true delta of 0.3: a 95% CI must cover it
    # in 93-97% of repetitions (binomial sd at 600 reps is 0.9 points, so +-2 is > 2 sd).
    rng = np.random.default_rng(7)
    reps, n, delta = 600, 60, 0.3
    covered = 0
    for r in range(reps):
        base = rng.normal(size=n)
        cand = base + delta + rng.normal(scale=0.8, size=n)
        ci = stats.paired_bootstrap(base, cand, resamples=2000, seed=r)
        covered += ci.ci_low <= delta <= ci.ci_high
    assert 0.93 <= covered / reps <= 0.97, covered / reps


def test_verdicts_against_tolerance() -> None:
    # accuracy may drop at most 2 points: regression when the CI's lower bound is below -0.02
    assert stats.verdict(-0.03, 0.01, 0.02, higher_is_better=True) == "regression"
    assert stats.verdict(-0.01, 0.01, 0.02, higher_is_better=True) == "no detectable change"
    assert stats.verdict(0.01, 0.05, 0.02, higher_is_better=True) == "improvement"
    assert stats.verdict(0.0, 0.011, 0.01, higher_is_better=False) == "regression"
    assert stats.verdict(0.0, 0.0, 0.0, higher_is_better=False) == "no detectable change"
    assert stats.constraint(-0.03, 0.0, 0.02, higher_is_better=True) == pytest.approx(0.01)
    assert stats.constraint(0.0, 0.004, 0.01, higher_is_better=False) == pytest.approx(-0.006)


def test_power_helper_matches_connor_formula_and_inverts() -> None:
    # Connor (1987): drop 0.05, discordance 0.10 -> n = (1.96*sqrt(.1) + 0.8416*sqrt(.0975))^2
    # / 0.0025 = 306.3 -> 307.
    expected = (1.959964 * math.sqrt(0.1) + 0.841621 * math.sqrt(0.0975)) ** 2 / 0.0025
    n = stats.mcnemar_examples_needed(0.05, 0.10)
    assert n == math.ceil(expected)
    assert stats.mcnemar_power(n, 0.05, 0.10) == pytest.approx(0.8, abs=0.01)
    with pytest.raises(ValueError, match="discordance_rate"):
        stats.mcnemar_examples_needed(0.2, 0.1)


def test_noise_floor_is_zero_for_constant_data_and_grows_with_spread() -> None:
    assert stats.noise_floor(np.ones(20)) == 0.0
    rng = np.random.default_rng(0)
    small, large = (
        stats.noise_floor(rng.normal(size=100)),
        stats.noise_floor(3 * rng.normal(size=100)),
    )
    # the half-difference of n=100 unit normals has sd 0.2; its 95% |.| quantile ~ 0.39
    assert 0.3 < small < 0.5 and large > 2 * small


def test_clopper_pearson_matches_closed_forms_and_tables() -> None:
    # 0 of n: the upper bound solves (1 - p)^n = alpha / 2 (closed form, Clopper-Pearson 1934)
    low, high = stats.clopper_pearson(0, 20)
    assert low == 0.0 and high == pytest.approx(1 - 0.025 ** (1 / 20), abs=1e-12)
    # n of n: the mirror image
    assert stats.clopper_pearson(20, 20) == pytest.approx((0.025 ** (1 / 20), 1.0), abs=1e-12)
    # 5 of 10: 0.187 .. 0.813 (the exact binomial CI as tabulated, 3 decimals)
    assert stats.clopper_pearson(5, 10) == pytest.approx((0.187, 0.813), abs=5e-4)
    with pytest.raises(ValueError, match="passed <= n"):
        stats.clopper_pearson(11, 10)
