"""The capacity-aware sampler's quality model: additive, started from a prior, corrected by data.

A plan's loss is predicted as the reference plan's measured loss plus a non-negative loss per
(parameter, value) where the plan departs from the reference. Each value's loss starts at its
prior (the per-tensor sensitivity profile's KL for that tensor and format, times a scale fitted
to the measurements; 0, i.e. optimistic, without a profile) and is pulled toward the measured
plans by ridge regression toward the prior, clipped at 0.

Exploration rule (when predictions are trusted): the prior is weighted by `prior_trust`, how
much better it predicted the last measured plans (each from the plans before it) than no prior
did; a prior no better than none gets weight 0, and the sampler then plans exactly as without
one: a value never measured is free (optimistic) and is tried, so a wrong prior is corrected by
measurement. Measured plans are never proposed again, so the search cannot get stuck.
The weight acts as a switch: `_fit` refits the prior's scale by least squares, which undoes
any weight in (0, 1] once a measured plan holds a value the prior covers; only 0 then
changes a prediction.
(A lower confidence bound of the plan-level residual on every tensor's value, BETA = 1, was the
rule before: with a wrong prior it did worse than no prior; BETA is now 0.)
`prediction_metrics` says how well the model predicted each plan.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

RIDGE = 1e-2  # pull of the prior (or of 0) against the data, in units of the largest loss
BETA = 0.0  # confidence-bound width, in residual standard deviations (0: the trust rule alone)
TRUST_START = 1  # the first plan predicted from those before it (in measurement order)
TRUST_MIN = 3  # plans predicted before the prior's trust is judged (full trust until then)
TRUST_WINDOW = 10  # the last plans predicted to judge it
TRUST_HISTORY = 200  # plans each of those predictions is fitted on, at most
PREDICTED_ATTR = "capacity_aware.predicted"  # trial system attribute: the model's prediction

Feature = tuple[str, Hashable]


@dataclass(frozen=True)
class Fit:
    """The fitted additive model: loss = base + sum of the plan's feature weights."""

    base: float
    weights: dict[Feature, float]
    prior_scale: float
    prior: dict[Feature, float]
    sigma: float
    counts: dict[Feature, int]
    trust: float = 1.0  # the prior's weight (`prior_trust`)

    def weight(self, f: Feature) -> float:
        w = self.weights.get(f)
        return self.prior_scale * self.prior.get(f, 0.0) if w is None else w

    def lcb(self, f: Feature) -> float:
        """The loss the sampler plans with: the fit (a value never measured: trust x its
        scaled prior, 0 without one), less BETA residual deviations for a value with a prior
        (BETA = 0: see the module docstring)."""
        if f not in self.prior:
            return max(0.0, self.weight(f))
        return max(0.0, self.weight(f) - BETA * self.sigma / math.sqrt(1 + self.counts.get(f, 0)))

    def predict(self, features: Sequence[Feature]) -> float:
        return self.base + sum(self.weight(f) for f in features)


def prior_trust(
    rows: Sequence[Sequence[Feature]],
    losses: Sequence[float],
    base: float,
    prior: dict[Feature, float],
) -> float:
    """How far to trust the prior, in [0, 1], from how it predicted the measured plans.

    Prequentially: each of the last TRUST_WINDOW measured plans (in measurement order) is
    predicted by the fit to the plans before it, once with the prior and once without;
    trust = 1 - (squared error with the prior) / (squared error without), clipped to [0, 1]. A
    prior that predicts no better than none gets 0 (the sampler then plans as with no prior),
    so a wrong prior costs at most the plans it takes to see it is wrong. 1 (full trust) until
    TRUST_MIN plans have been predicted."""
    n = len(rows)
    first = max(TRUST_START, n - TRUST_WINDOW)
    if not prior or n - first < TRUST_MIN:
        return 1.0
    err_prior = err_none = 0.0
    for k in range(first, n):
        lo = max(0, k - TRUST_HISTORY)
        with_prior = _fit(rows[lo:k], losses[lo:k], base, prior)
        without = _fit(rows[lo:k], losses[lo:k], base, {})
        err_prior += (with_prior.predict(rows[k]) - losses[k]) ** 2
        err_none += (without.predict(rows[k]) - losses[k]) ** 2
    if err_none <= 0:
        return 1.0 if err_prior <= 0 else 0.0
    return float(min(1.0, max(0.0, 1.0 - err_prior / err_none)))


def fit(
    rows: Sequence[Sequence[Feature]],
    losses: Sequence[float],
    base: float,
    prior: dict[Feature, float] | None = None,
) -> Fit:
    """The fit with the prior weighted by `prior_trust` (see `_fit`; its least-squares scale
    undoes a weight in (0, 1], so the prior is in effect dropped at trust 0 and kept else)."""
    prior = prior or {}
    trust = prior_trust(rows, losses, base, prior) if prior else 1.0
    if trust < 1.0:
        prior = {f: trust * v for f, v in prior.items()}
    out = _fit(rows, losses, base, prior)
    return dataclasses.replace(out, trust=trust)


def _fit(
    rows: Sequence[Sequence[Feature]],
    losses: Sequence[float],
    base: float,
    prior: dict[Feature, float] | None = None,
) -> Fit:
    """Fit the excess losses (loss - base) of measured plans (`rows`: their features).

    w = s*p + X^T (X X^T + lam I)^-1 (y - X s p), clipped at 0: ridge regression toward the
    prior s*p (solved in the n x n form, so the cost does not grow with the feature count);
    s >= 0 is the least-squares scale of the prior on the data (1 with no data)."""
    prior = prior or {}
    feats = sorted({f for r in rows for f in r}, key=repr)
    y = np.asarray(losses, float) - base
    counts: dict[Feature, int] = {}
    for r in rows:
        for f in set(r):
            counts[f] = counts.get(f, 0) + 1
    if not feats:
        return Fit(base, {}, 1.0, prior, 0.0, counts)
    col = {f: j for j, f in enumerate(feats)}
    x = np.zeros((len(rows), len(feats)))
    for i, r in enumerate(rows):
        for f in r:
            x[i, col[f]] = 1.0
    p = np.array([prior.get(f, 0.0) for f in feats])
    xp = x @ p
    scale = float(xp @ y / (xp @ xp)) if xp @ xp > 0 else 1.0
    scale = max(scale, 0.0)
    unit = max(float(np.max(np.abs(y))), 1e-12)
    lam = RIDGE * unit**2
    r = y - x @ (scale * p)
    alpha = np.linalg.solve(x @ x.T + lam * np.eye(len(rows)), r)
    w = np.maximum(scale * p + x.T @ alpha, 0.0)
    resid = y - x @ w
    sigma = float(np.sqrt(np.mean(resid**2))) if len(rows) >= 2 else unit
    return Fit(base, dict(zip(feats, w.tolist(), strict=True)), scale, prior, sigma, counts)


def prediction_metrics(study, prefix: str = "capacity_aware") -> dict[str, float]:
    """How well the model predicted each measured plan, from the predictions the sampler
    stored on its trials: Spearman rank correlation and median relative error per quality
    objective (index in the study's values; the relative error over plans measured non-zero).
    Empty when fewer than 3 plans carry one."""
    from optuna.trial import TrialState
    from scipy.stats import spearmanr

    pairs: dict[int, list[tuple[float, float]]] = {}
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        predicted = t.system_attrs.get(PREDICTED_ATTR)
        if not predicted or t.values is None:
            continue
        for index, value in predicted.items():
            measured = t.values[int(index)]
            if value is not None and math.isfinite(measured):
                pairs.setdefault(int(index), []).append((float(value), float(measured)))
    out: dict[str, float] = {}
    for index, ps in sorted(pairs.items()):
        if len(ps) < 3:
            continue
        pred, meas = np.array(ps).T
        tag = f"{prefix}.obj{index}"
        rho = spearmanr(pred, meas).statistic
        if np.isfinite(rho):
            out[f"{tag}.rank_corr"] = float(rho)
        nonzero = meas != 0  # a relative error of a measured 0 is undefined: left out
        if nonzero.any():
            rel = np.abs(pred[nonzero] - meas[nonzero]) / np.abs(meas[nonzero])
            out[f"{tag}.median_rel_error"] = float(np.median(rel))
        out[f"{tag}.predicted_plans"] = float(len(ps))
    return out
