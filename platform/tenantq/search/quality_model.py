"""The capacity-aware sampler's quality model: additive, started from a prior, corrected by data.

A plan's loss is predicted as the reference plan's measured loss plus a non-negative loss per
(parameter, value) where the plan departs from the reference. Each value's loss starts at its
prior (the per-tensor sensitivity profile's KL for that tensor and format, times a scale fitted
to the measurements; 0, i.e. optimistic, without a profile) and is pulled toward the measured
plans by ridge regression toward the prior, clipped at 0. Exploration rule: a value with a
prior is planned with at its lower confidence bound max(0, w - BETA * s / sqrt(1 + n)), s the
fit's residual RMS and n the measured plans holding that value, so a value whose prior is too
pessimistic is still tried until measurements confirm it; a value without a prior is free
until measured. It cannot get stuck: measured plans are never proposed again.
`prediction_metrics` says how well the model predicted each plan.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

RIDGE = 1e-2  # pull of the prior (or of 0) against the data, in units of the largest loss
BETA = 1.0  # confidence-bound width, in residual standard deviations
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

    def weight(self, f: Feature) -> float:
        w = self.weights.get(f)
        return self.prior_scale * self.prior.get(f, 0.0) if w is None else w

    def lcb(self, f: Feature) -> float:
        """The loss the sampler plans with (the exploration rule): for a value with a prior,
        its lower confidence bound; for one without, the fit (0, optimistic, until measured:
        on synthetic 168-plan landscapes a bound there cost coverage, 62% vs 72% at 25)."""
        if f not in self.prior:
            return max(0.0, self.weight(f))
        return max(0.0, self.weight(f) - BETA * self.sigma / math.sqrt(1 + self.counts.get(f, 0)))

    def predict(self, features: Sequence[Feature]) -> float:
        return self.base + sum(self.weight(f) for f in features)


def fit(
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
