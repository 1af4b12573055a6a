"""The capacity-aware sampler's quality model: additive (plus pairwise), started from a prior,
corrected by data.

A plan's loss is predicted as the reference plan's measured loss plus a non-negative loss per
(parameter, value) where the plan departs from the reference, plus (where the data show one)
an interaction term per (weight value, KV value) pair. Fitted by generalized ridge regression:
minimize sum over measured plans (y - Xw)^2 + sum_f d_f (w_f - m_f)^2, where a value with a
prior (the per-tensor sensitivity profile's KL, times its least-squares scale s on the data)
is pulled toward it with strength `trust * PRIOR_PLANS` (in measured plans), every term toward
0 with RIDGE. So the prior is a shrinkage the measurements overcome as they accumulate: a
value measured in n plans moves from the prior toward the data in proportion n : PRIOR_PLANS;
a value never measured sits at trust * PRIOR_PLANS / (trust * PRIOR_PLANS + RIDGE) of s * p.

Trust (`prior_trust`): how much better the prior predicted the last measured plans (each from
the plans before it) than no prior did, in [0, 1]; a prior no better than none gets 0 and the
model is then the model without a prior.

Exploration rule (when predictions are trusted): the sampler plans with each value's lower
confidence bound, fitted loss - BETA * its posterior standard deviation (the residual RMS over
the measured plans times sqrt of the value's diagonal of (X'X + D)^-1; for a value never
measured, residual / sqrt(d_f)). BETA is 0 (one deviation drove most values to 0 and
multiplied `bench prior`'s regret), so the rule is the trust: a value no plan measured and no
trusted prior covers is free (optimistic) and gets tried, and a distrusted prior is dropped,
so a wrong prior is corrected by measurement. Measured plans are never proposed again, so the
search cannot get stuck.

Pairwise rule: a (weight value, KV value) term is a candidate once PAIR_MIN measured plans hold
both and each value was measured without the other; the candidates are kept when they lower
the fit's leave-one-out squared error by PAIR_GAIN (the data show an interaction), else the
model stays additive. `prediction_metrics` says how well the model predicted each plan.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

RIDGE = 1e-4  # pull of every term toward 0, in measured plans (0.01% of one plan's weight)
PRIOR_PLANS = 1.0  # the prior's pull at trust 1, in measured plans (one plan meets it halfway)
BETA = 0.0  # confidence-bound width, in posterior sds (1 did far worse: the guide's bench prior)
PAIR_MIN = 2  # measured plans holding both values before their pairwise term is a candidate
PAIR_GAIN = 0.1  # pairwise terms kept when they cut the leave-one-out squared error by 10%
TRUST_START = 1  # the first plan predicted from those before it (in measurement order)
TRUST_MIN = 3  # plans predicted before the prior's trust is judged (full trust until then)
TRUST_WINDOW = 10  # the last plans predicted to judge it
TRUST_HISTORY = 200  # plans each of those predictions is fitted on, at most
PREDICTED_ATTR = "capacity_aware.predicted"  # trial system attribute: the model's prediction

Feature = tuple[str, Hashable]
Pair = tuple[Feature, Feature]  # (weight-side value, KV-side value)


@dataclass(frozen=True)
class Fit:
    """The fitted model: loss = base + the plan's feature weights + its pairs' terms."""

    base: float
    weights: dict[Feature, float]
    prior_scale: float
    prior: dict[Feature, float]
    sigma: float
    counts: dict[Feature, int]
    trust: float = 1.0  # the prior's weight (`prior_trust`)
    pairs: dict[Pair, float] = field(default_factory=dict)
    std: dict[Feature, float] = field(default_factory=dict)  # posterior sd of measured values

    def _pull(self, f: Feature) -> tuple[float, float]:
        """(target m_f, penalty d_f) of a value no plan measured."""
        kappa = self.trust * PRIOR_PLANS if f in self.prior else 0.0
        d = RIDGE + kappa
        return kappa * self.prior_scale * self.prior.get(f, 0.0) / d, d

    def weight(self, f: Feature) -> float:
        w = self.weights.get(f)
        return max(0.0, self._pull(f)[0]) if w is None else w

    def sd(self, f: Feature) -> float:
        """The posterior standard deviation of f's loss (see the module docstring)."""
        if f in self.std:
            return self.std[f]
        return self.sigma / math.sqrt(self._pull(f)[1])

    def lcb(self, f: Feature) -> float:
        """The loss the sampler plans with: the fit less BETA posterior deviations, >= 0."""
        return max(0.0, self.weight(f) - BETA * self.sd(f))

    def pair(self, f: Feature, g: Feature) -> float:
        return self.pairs.get((f, g), 0.0)

    def predict(self, features: Sequence[Feature]) -> float:
        out = self.base + sum(self.weight(f) for f in features)
        if self.pairs:
            have = set(features)
            out += sum(v for (f, g), v in self.pairs.items() if f in have and g in have)
        return out


def prior_trust(
    rows: Sequence[Sequence[Feature]],
    losses: Sequence[float],
    base: float,
    prior: dict[Feature, float],
) -> float:
    """How far to trust the prior, in [0, 1], from how it predicted the measured plans.

    Prequentially: each of the last TRUST_WINDOW measured plans (in measurement order) is
    predicted by the additive fit to the plans before it, once with the prior at full trust
    and once without; trust = 1 - (squared error with) / (squared error without), clipped to
    [0, 1]. A prior that predicts no better than none gets 0 (the model is then the model
    without a prior), so a wrong prior costs at most the plans it takes to see it is wrong.
    1 (full trust) until TRUST_MIN plans have been predicted."""
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
    *,
    trust: float | None = None,
    is_kv: Callable[[Feature], bool] | None = None,
) -> Fit:
    """The model for measured plans `rows` (their features) with excess losses `losses - base`.

    `trust`: the prior's weight in [0, 1] (None: `prior_trust` of the data). `is_kv`: which
    values are KV-side; with it, pairwise (weight value x KV value) terms are fitted where the
    pairwise rule (module docstring) finds an interaction."""
    prior = prior or {}
    if trust is None:
        trust = prior_trust(rows, losses, base, prior) if prior else 1.0
    additive = _fit(rows, losses, base, prior, trust)
    if is_kv is None:
        return additive
    pairs = candidate_pairs(rows, is_kv)
    if not pairs:
        return additive
    paired = _fit(rows, losses, base, prior, trust, pairs)
    if paired.loo_sq < (1.0 - PAIR_GAIN) * additive.loo_sq:  # 0 < 0: no cut, none kept
        return paired
    return additive


def candidate_pairs(rows: Sequence[Sequence[Feature]], is_kv) -> list[Pair]:
    """(weight value, KV value) pairs held together by >= PAIR_MIN plans, each value also
    measured without the other (else the pair's term and the values' own are one column)."""
    both: dict[Pair, int] = {}
    alone: dict[Feature, int] = {}
    for r in rows:
        fs = set(r)
        for f in fs:
            alone[f] = alone.get(f, 0) + 1
        for f in fs:
            if is_kv(f):
                continue
            for g in fs:
                if is_kv(g):
                    both[(f, g)] = both.get((f, g), 0) + 1
    return sorted(
        (p for p, n in both.items() if n >= PAIR_MIN and alone[p[0]] > n and alone[p[1]] > n),
        key=repr,
    )


@dataclass(frozen=True)
class _Fitted(Fit):
    loo_sq: float = 0.0  # leave-one-out sum of squared errors (the pairwise rule's judge)


def _fit(
    rows: Sequence[Sequence[Feature]],
    losses: Sequence[float],
    base: float,
    prior: dict[Feature, float] | None = None,
    trust: float = 1.0,
    pairs: Sequence[Pair] = (),
) -> _Fitted:
    """Generalized ridge toward the prior (module docstring), solved in the n x n form so the
    cost does not grow with the feature count: w = m + D^-1 X' (X D^-1 X' + I)^-1 (y - X m);
    single values clipped at 0; s >= 0 the least-squares scale of the (unweighted) prior."""
    prior = prior or {}
    feats = sorted({f for r in rows for f in r}, key=repr)
    y = np.asarray(losses, float) - base
    counts: dict[Feature, int] = {}
    for r in rows:
        for f in set(r):
            counts[f] = counts.get(f, 0) + 1
    if not feats:
        return _Fitted(base, {}, 1.0, prior, 0.0, counts, trust)
    cols: list = [*feats, *pairs]
    col = {f: j for j, f in enumerate(feats)}
    x = np.zeros((len(rows), len(cols)))
    for i, r in enumerate(rows):
        fs = set(r)
        for f in fs:
            x[i, col[f]] = 1.0
        for j, (f, g) in enumerate(pairs, start=len(feats)):
            x[i, j] = float(f in fs and g in fs)
    p = np.array([prior.get(f, 0.0) for f in feats] + [0.0] * len(pairs))
    xp = x @ p
    scale = max(float(xp @ y / (xp @ xp)) if xp @ xp > 0 else 1.0, 0.0)
    kappa = trust * PRIOR_PLANS
    has_prior = np.array([f in prior for f in feats] + [False] * len(pairs))
    d = RIDGE + kappa * has_prior
    m = kappa * scale * p / d
    kinv = np.linalg.inv((x / d) @ x.T + np.eye(len(rows)))
    alpha = kinv @ (y - x @ m)
    w = m + (x.T @ alpha) / d
    w[: len(feats)] = np.maximum(w[: len(feats)], 0.0)
    resid = y - x @ w
    unit = max(float(np.max(np.abs(y))), 1e-12)
    sigma = float(np.sqrt(np.mean(resid**2))) if len(rows) >= 2 else unit
    z = x / d  # diag of (X'X + D)^-1 = 1/d - diag(Z' K^-1 Z), Z = X D^-1
    var = 1.0 / d - np.einsum("if,ij,jf->f", z, kinv, z)
    std = sigma * np.sqrt(np.maximum(var, 0.0))
    loo = alpha / np.diag(kinv)  # leave-one-out residuals of the (unclipped) ridge fit
    return _Fitted(
        base,
        dict(zip(feats, w[: len(feats)].tolist(), strict=True)),
        scale,
        prior,
        sigma,
        counts,
        trust,
        {pr: float(v) for pr, v in zip(pairs, w[len(feats) :].tolist(), strict=True)},
        dict(zip(feats, std[: len(feats)].tolist(), strict=True)),
        float(loo @ loo),
    )


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
