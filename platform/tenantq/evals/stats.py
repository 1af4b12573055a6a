"""Paired statistics: is a candidate's difference from the bf16 baseline real, and allowed?

The interval follows the metric's kind: continuous metrics (KL, perplexity, agreement) get a
paired percentile bootstrap; pass/fail deltas get Tango's score interval, whose coverage at
16-100 examples is checked by exact enumeration (the bootstrap's is not: 55% at n=16). The
verdict is non-inferiority against a tolerance; `changed` is a separate two-sided test (exact
McNemar for pass/fail), and its power is computed by exact enumeration, not a normal formula.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy import stats as _sps

DEFAULT_RESAMPLES = 10_000
# Resampled index matrices are built in blocks of at most this many entries (about 32 MB of
# int64), so 10,000 resamples of a 50,000-example task never allocate 4 GB at once.
_BLOCK_ENTRIES = 4_000_000

# The gate's decision: the CI's bad-side bound within the tolerance, or not. It is a
# non-inferiority test (one-sided at (1 - confidence) / 2), not a test of change.
NON_INFERIOR = "non-inferior"
NOT_SHOWN_NON_INFERIOR = "not shown non-inferior"
VERDICTS = (NON_INFERIOR, NOT_SHOWN_NON_INFERIOR)
# The two-sided `changed` flag's words (summary `changed.<metric>`, MLflow tag, report, CLI).
CHANGED_WORDS = {True: "yes", False: "no"}
DEFAULT_ALPHA = 0.05


@dataclass(frozen=True)
class PairedCI:
    """A paired difference (candidate minus baseline, or another contrast) and its CI."""

    baseline: float
    candidate: float
    delta: float
    ci_low: float
    ci_high: float
    n: int


def paired_bootstrap(
    baseline: np.ndarray,
    candidate: np.ndarray,
    *,
    weights: np.ndarray | None = None,
    contrast: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
    resamples: int = DEFAULT_RESAMPLES,
    confidence: float = 0.95,
    seed: int = 0,
) -> PairedCI:
    """Percentile bootstrap CI of `contrast(mean(candidate), mean(baseline))` over examples.

    Examples are resampled with replacement, the same draw for baseline and candidate (the
    pairing); `weights` makes the means weighted (e.g. tokens per sequence, so a per-token
    mean is resampled by whole sequences). `contrast` defaults to the difference c - b; it
    receives arrays of resampled means and must be vectorized (e.g. a perplexity ratio
    `lambda c, b: np.exp(c - b)` on mean NLLs). Seeded: the same inputs give the same CI.
    """
    b = np.asarray(baseline, np.float64).ravel()
    c = np.asarray(candidate, np.float64).ravel()
    if b.shape != c.shape:
        raise ValueError(f"paired data need equal lengths, got {b.size} and {c.size}")
    if b.size == 0:
        raise ValueError("paired_bootstrap needs at least one example")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    w = np.ones_like(b) if weights is None else np.asarray(weights, np.float64).ravel()
    if w.shape != b.shape or (w < 0).any() or w.sum() <= 0:
        raise ValueError("weights must be non-negative, one per example, not all zero")
    fn = contrast or (lambda cand, base: cand - base)
    n = b.size
    point = float(fn(np.asarray(np.dot(w, c) / w.sum()), np.asarray(np.dot(w, b) / w.sum())))
    rng = np.random.default_rng(seed)
    block = max(1, _BLOCK_ENTRIES // n)
    deltas = np.empty(resamples)
    wb, wc = w * b, w * c
    for start in range(0, resamples, block):
        stop = min(resamples, start + block)
        idx = rng.integers(0, n, size=(stop - start, n))
        wsum = w[idx].sum(axis=1)
        wsum = np.where(wsum > 0, wsum, np.nan)  # a draw of only zero-weight examples
        deltas[start:stop] = fn(wc[idx].sum(axis=1) / wsum, wb[idx].sum(axis=1) / wsum)
    tail = (1.0 - confidence) / 2.0
    low, high = np.nanquantile(deltas, [tail, 1.0 - tail])
    return PairedCI(
        baseline=float(np.dot(w, b) / w.sum()),
        candidate=float(np.dot(w, c) / w.sum()),
        delta=point,
        ci_low=float(low),
        ci_high=float(high),
        n=int(n),
    )


def discordant_counts(baseline_pass: np.ndarray, candidate_pass: np.ndarray) -> tuple[int, int]:
    """(correct -> wrong, wrong -> correct): the flips of a pass/fail task against baseline."""
    b = np.asarray(baseline_pass, bool)
    c = np.asarray(candidate_pass, bool)
    if b.shape != c.shape:
        raise ValueError(f"paired data need equal lengths, got {b.size} and {c.size}")
    return int(np.sum(b & ~c)), int(np.sum(~b & c))


def mcnemar_exact(correct_to_wrong: int, wrong_to_correct: int) -> float:
    """Two-sided exact McNemar p-value: the discordant pairs as Binomial(b + c, 1/2).

    p = min(1, 2 * P[X <= min(b, c)]) with X ~ Bin(b + c, 0.5); 1.0 when nothing flipped.
    """
    b, c = int(correct_to_wrong), int(wrong_to_correct)
    if b < 0 or c < 0:
        raise ValueError(f"discordant counts must be >= 0, got {b} and {c}")
    if b + c == 0:
        return 1.0
    return float(min(1.0, 2.0 * _sps.binom.cdf(min(b, c), b + c, 0.5)))


_TINY_VARIANCE = 1e-300
# Bisection halvings of a bound's bracket (width <= 2): 2 * 2**-52, below float64's step at 1.
_BISECTIONS = 52


def _tango_score(to_better, to_worse, n, delta):
    """Tango's score statistic for H0: p(to_better) - p(to_worse) = delta (vectorized).

    With n12 = to_better, n21 = to_worse and delta = p12 - p21, the multinomial likelihood
    restricted to p12 = p21 + delta is maximized by p21 = (sqrt(W^2 + 8 n n21 delta (1 -
    delta)) - W) / (4n), W = -n12 - n21 + (2n - n12 + n21) delta (the root of a quadratic;
    Tango 1998, eq. 3), and Z = (n12 - n21 - n delta) / sqrt(n (2 p21 + delta (1 - delta))).
    """
    w = -to_better - to_worse + (2 * n - to_better + to_worse) * delta
    p21 = (np.sqrt(np.maximum(w * w + 8 * n * to_worse * delta * (1 - delta), 0.0)) - w) / (4 * n)
    var = n * (2 * p21 + delta * (1 - delta))
    # var = 0 only at a delta the observed table sits on (e.g. -1 when every example was
    # lost), where the numerator is 0 too: the floor makes that 0, no evidence against it
    return (to_better - to_worse - n * delta) / np.sqrt(np.maximum(var, _TINY_VARIANCE))


def tango_interval(
    correct_to_wrong, wrong_to_correct, n, *, confidence: float = 0.95
) -> tuple[np.ndarray, np.ndarray]:
    """Tango's score CI of a paired difference of proportions, candidate minus baseline.

    Tango (1998), "Equivalence test and confidence interval for the difference in proportions
    for the paired-sample design", Statistics in Medicine 17:891-908: the interval is every
    delta whose score test (`_tango_score`) is not rejected at 1 - confidence, found here by
    bisection on each side of the point (w2c - c2w) / n (the statistic falls as delta rises).
    Fagerland, Lydersen & Laake (2014, Statistics in Medicine 33:2850-2875) recommend it for
    small samples; tests/evals/test_stats.py checks its coverage by exact enumeration. With no
    flips it still has width (n=32: +-0.107), unlike a bootstrap of identical pairs.
    Vectorized over the counts; returns (low, high) arrays shaped like the broadcast counts.
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    worse = np.asarray(correct_to_wrong, np.float64)
    better = np.asarray(wrong_to_correct, np.float64)
    total = np.asarray(n, np.float64)
    if (worse < 0).any() or (better < 0).any() or (worse + better > total).any():
        raise ValueError("need 0 <= correct_to_wrong + wrong_to_correct <= n")
    if (total <= 0).any():
        raise ValueError("need n > 0 paired examples")
    worse, better, total = np.broadcast_arrays(worse, better, total)
    z = _sps.norm.ppf(0.5 + confidence / 2)
    point = (better - worse) / total

    def solve(target, lo, hi):
        for _ in range(_BISECTIONS):
            mid = (lo + hi) / 2
            above = _tango_score(better, worse, total, mid) > target
            lo, hi = np.where(above, mid, lo), np.where(above, hi, mid)
        return (lo + hi) / 2

    low = solve(z, np.full_like(point, -1.0), point)
    high = solve(-z, point, np.ones_like(point))
    return low, high


def paired_proportion_ci(
    baseline_pass: np.ndarray, candidate_pass: np.ndarray, *, confidence: float = 0.95
) -> PairedCI:
    """A pass/fail task's paired accuracy delta (candidate - baseline) with Tango's score CI."""
    b = np.asarray(baseline_pass, bool).ravel()
    c = np.asarray(candidate_pass, bool).ravel()
    if b.size == 0:
        raise ValueError("paired_proportion_ci needs at least one example")
    worse, better = discordant_counts(b, c)
    low, high = tango_interval(worse, better, b.size, confidence=confidence)
    return PairedCI(
        baseline=float(b.mean()),
        candidate=float(c.mean()),
        delta=float(c.mean() - b.mean()),
        ci_low=float(low),
        ci_high=float(high),
        n=int(b.size),
    )


def constraint(ci_low: float, ci_high: float, tolerance: float, *, higher_is_better: bool) -> float:
    """How far the CI bound is beyond tolerance: <= 0 within it (Optuna's `set_constraint`)."""
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    return (-tolerance - ci_low) if higher_is_better else (ci_high - tolerance)


def verdict(ci_low: float, ci_high: float, tolerance: float, *, higher_is_better: bool) -> str:
    """`non-inferior` when the delta's CI rules out a change worse than `tolerance`, else
    `not shown non-inferior`.

    Higher is better (accuracy): non-inferior when the CI's lower bound is >= -tolerance.
    Lower is better (KL, perplexity): when its upper bound is <= +tolerance. This says
    nothing about whether anything changed (`changed` does): a significant small loss can be
    non-inferior, and a single flip of 32 can leave non-inferiority unshown.
    """
    c = constraint(ci_low, ci_high, tolerance, higher_is_better=higher_is_better)
    return NON_INFERIOR if c <= 0 else NOT_SHOWN_NON_INFERIOR


def changed(
    ci_low: float, ci_high: float, *, p_value: float | None = None, alpha: float = DEFAULT_ALPHA
) -> bool:
    """The two-sided test of "no change": for pass/fail deltas the exact McNemar `p_value`
    <= alpha (the test `mcnemar_power` sizes); for continuous ones the CI (of the delta from
    its no-change value, 0) excluding 0."""
    if p_value is not None:
        return bool(p_value <= alpha)
    return bool(ci_low > 0 or ci_high < 0)


def _mcnemar_critical(discordant: int, alpha: float) -> np.ndarray:
    """k[D] for D = 0..discordant: the largest min(b, c) that `mcnemar_exact` rejects at
    p <= alpha among D discordant pairs, -1 where none does (D < 6 at alpha 0.05)."""
    d = np.arange(discordant + 1)
    k = _sps.binom.ppf(alpha / 2, d, 0.5)  # smallest k with P[X <= k] >= alpha / 2
    rejects = np.minimum(1.0, 2.0 * _sps.binom.cdf(k, d, 0.5)) <= alpha  # equal: k rejects
    return np.where(rejects, k, k - 1).astype(np.int64)


def mcnemar_power(
    n: int, drop: float, discordance_rate: float, *, alpha: float = DEFAULT_ALPHA
) -> float:
    """Power of the exact McNemar test (`mcnemar_exact` <= alpha) with `n` paired examples,
    by exact enumeration of the outcomes.

    The true model: each example flips correct -> wrong with probability (psi + d) / 2 and
    wrong -> correct with (psi - d) / 2, psi = `discordance_rate`, d = |`drop`|. The number
    of discordant pairs D is Binomial(n, psi); given D, the test rejects when min(b, c) <=
    k[D] (`_mcnemar_critical`), and b is Binomial(D, (psi + d) / (2 psi)). Summing both
    tails over D is exact and O(n). `drop` = 0 gives the test's size (<= alpha).
    """
    d, psi = abs(float(drop)), float(discordance_rate)
    if n <= 0 or not 0 <= d <= psi <= 1 or psi == 0:
        raise ValueError(
            f"need n > 0 and 0 <= |drop| <= discordance_rate <= 1, discordance_rate > 0; got "
            f"n={n}, drop={drop}, discordance_rate={discordance_rate}"
        )
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    return _exact_power(int(n), d, psi, _mcnemar_critical(int(n), alpha))


def _exact_power(n: int, d: float, psi: float, critical: np.ndarray) -> float:
    """`mcnemar_power`'s sum, given the critical values k[D] for D = 0..n (or more)."""
    discord = np.arange(n + 1)
    k = critical[: n + 1]
    worse = (psi + d) / (2 * psi)
    # both tails; k[D] < D / 2, so they never overlap; k = -1 gives 0 + 0
    reject = _sps.binom.cdf(k, discord, worse) + _sps.binom.sf(discord - k - 1, discord, worse)
    return float(np.dot(_sps.binom.pmf(discord, n, psi), reject))


def mcnemar_examples_needed(
    drop: float,
    discordance_rate: float,
    *,
    alpha: float = DEFAULT_ALPHA,
    power: float = 0.8,
    max_n: int = 20_000,
) -> int:
    """The smallest n at which the exact McNemar test detects an accuracy `drop` with
    `power` (`mcnemar_power`, exact enumeration; no normal approximation).

    The exact test's power saw-tooths in n (the rejection region moves in whole flips), so a
    few n just above the answer can fall slightly below `power` again.
    """
    d, psi = abs(float(drop)), float(discordance_rate)
    if d <= 0:
        raise ValueError(f"drop must be non-zero, got {drop}")
    if not d <= psi <= 1:
        raise ValueError(
            f"discordance_rate must be in [|drop|, 1] (a drop of {d} needs at least that "
            f"share of flips), got {psi}"
        )
    if not 0.0 < power < 1.0:
        raise ValueError(f"power must be in (0, 1), got {power}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    critical = _mcnemar_critical(max_n, alpha)
    for n in range(1, max_n + 1):
        if _exact_power(n, d, psi, critical) >= power:
            return n
    raise ValueError(
        f"a drop of {d} at discordance {psi} needs more than max_n={max_n} examples for "
        f"power {power}"
    )


def clopper_pearson(passed: int, n: int, *, alpha: float = 0.05) -> tuple[float, float]:
    """Exact (Clopper-Pearson 1934) two-sided 1 - alpha CI of a pass rate `passed` / `n`."""
    if not 0 <= passed <= n or n <= 0:
        raise ValueError(f"need 0 <= passed <= n and n > 0, got passed={passed}, n={n}")
    low = 0.0 if passed == 0 else float(_sps.beta.ppf(alpha / 2, passed, n - passed + 1))
    high = 1.0 if passed == n else float(_sps.beta.ppf(1 - alpha / 2, passed + 1, n - passed))
    return low, high
