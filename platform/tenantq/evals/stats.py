"""Paired statistics: is a candidate's difference from the bf16 baseline real?

Every quality delta is paired (same examples, baseline and candidate resampled jointly) and
carries a percentile bootstrap CI; pass/fail tasks also get the exact McNemar p-value on the
discordant pairs. A verdict compares the CI with a tolerance, the noise floor says how far
two halves of the baseline differ on their own, and the power helper sizes a task.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy import stats as _sps

DEFAULT_RESAMPLES = 10_000
# Resampled index matrices are built in blocks of at most this many entries (about 32 MB of
# int64), so 10,000 resamples of a 50,000-example task never allocate 4 GB at once.
_BLOCK_ENTRIES = 4_000_000

VERDICTS = ("regression", "no detectable change", "improvement")


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


def verdict(ci_low: float, ci_high: float, tolerance: float, *, higher_is_better: bool) -> str:
    """`regression`, `no detectable change` or `improvement` for a delta's CI.

    Higher is better (accuracy): regression when the CI's lower bound is below -tolerance
    (a drop larger than allowed cannot be ruled out), improvement when the whole CI is above
    zero. Lower is better (KL, perplexity): mirrored, with +tolerance on the upper bound.
    """
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    if higher_is_better:
        if ci_low < -tolerance:
            return "regression"
        return "improvement" if ci_low > 0 else "no detectable change"
    if ci_high > tolerance:
        return "regression"
    return "improvement" if ci_high < 0 else "no detectable change"


def constraint(ci_low: float, ci_high: float, tolerance: float, *, higher_is_better: bool) -> float:
    """How far the CI bound is beyond tolerance: <= 0 within it (Optuna's `set_constraint`)."""
    return (-tolerance - ci_low) if higher_is_better else (ci_high - tolerance)


def noise_floor(
    values: np.ndarray,
    *,
    weights: np.ndarray | None = None,
    splits: int = 1000,
    quantile: float = 0.95,
    seed: int = 0,
) -> float:
    """The baseline against itself: `quantile` of |mean(half A) - mean(half B)| over random
    disjoint halves of the examples. A delta smaller than this is within what two samples of
    the unchanged model already differ by. Vectorized over `splits` seeded permutations."""
    x = np.asarray(values, np.float64).ravel()
    n = x.size
    if n < 2:
        raise ValueError("noise_floor needs at least two examples")
    w = np.ones_like(x) if weights is None else np.asarray(weights, np.float64).ravel()
    rng = np.random.default_rng(seed)
    perms = rng.permuted(np.tile(np.arange(n), (splits, 1)), axis=1)
    half = n // 2
    a, b = perms[:, :half], perms[:, half : 2 * half]
    mean_a = (w[a] * x[a]).sum(1) / np.maximum(w[a].sum(1), 1e-300)
    mean_b = (w[b] * x[b]).sum(1) / np.maximum(w[b].sum(1), 1e-300)
    return float(np.quantile(np.abs(mean_a - mean_b), quantile))


def mcnemar_examples_needed(
    drop: float, discordance_rate: float, *, alpha: float = 0.05, power: float = 0.8
) -> int:
    """Paired examples needed to detect an accuracy `drop` with McNemar's test.

    Connor (1987), "Sample size for testing differences in proportions for the paired-sample
    design", Biometrics 43:207-211: n = (z_{a/2} sqrt(psi) + z_b sqrt(psi - d^2))^2 / d^2,
    with psi the discordance rate (share of examples that flip either way) and d the drop.
    """
    d, psi = abs(float(drop)), float(discordance_rate)
    if d <= 0:
        raise ValueError(f"drop must be non-zero, got {drop}")
    if not d <= psi <= 1:
        raise ValueError(
            f"discordance_rate must be in [|drop|, 1] (a drop of {d} needs at least that "
            f"share of flips), got {psi}"
        )
    z_a = _sps.norm.ppf(1 - alpha / 2)
    z_b = _sps.norm.ppf(power)
    n = (z_a * math.sqrt(psi) + z_b * math.sqrt(psi - d * d)) ** 2 / (d * d)
    return int(math.ceil(n))


def mcnemar_power(n: int, drop: float, discordance_rate: float, *, alpha: float = 0.05) -> float:
    """Power of McNemar's test with `n` paired examples for a true `drop` (Connor 1987)."""
    d, psi = abs(float(drop)), float(discordance_rate)
    if n <= 0 or d <= 0 or not d <= psi <= 1:
        raise ValueError("need n > 0 and 0 < |drop| <= discordance_rate <= 1")
    if psi - d * d <= 0:
        return 1.0
    z_a = _sps.norm.ppf(1 - alpha / 2)
    z = (d * math.sqrt(n) - z_a * math.sqrt(psi)) / math.sqrt(psi - d * d)
    return float(_sps.norm.cdf(z))


def clopper_pearson(passed: int, n: int, *, alpha: float = 0.05) -> tuple[float, float]:
    """Exact (Clopper-Pearson 1934) two-sided 1 - alpha CI of a pass rate `passed` / `n`."""
    if not 0 <= passed <= n or n <= 0:
        raise ValueError(f"need 0 <= passed <= n and n > 0, got passed={passed}, n={n}")
    low = 0.0 if passed == 0 else float(_sps.beta.ppf(alpha / 2, passed, n - passed + 1))
    high = 1.0 if passed == n else float(_sps.beta.ppf(1 - alpha / 2, passed + 1, n - passed))
    return low, high
