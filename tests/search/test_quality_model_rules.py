"""The quality model's rules one at a time (tenantq.search.quality_model): the prior's trust
against a ridge written in its primal form (the model solves the n x n dual), the trust's
edge cases where no-prior predicts perfectly, and which trials the prediction metrics count.

The reference below is the module docstring's objective solved directly:
w = (X'X + D)^-1 (X'y + D m), D = diag(RIDGE + trust * PRIOR_PLANS * [f has a prior]),
m = trust * PRIOR_PLANS * s * p / D, s the least-squares scale of the prior on the data;
single values clipped at 0; an unmeasured value weighs max(0, m_f).
"""

from __future__ import annotations

import random

import numpy as np
import optuna
import pytest

from tenantq.search import quality_model as qm

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _primal(rows, ys, base, prior, trust=1.0):
    """(weights of the measured values, s, kappa) of the objective solved directly."""
    feats = sorted({f for r in rows for f in r}, key=repr)
    y = np.array(ys, float) - base
    x = np.array([[float(f in r) for f in feats] for r in rows])
    p = np.array([prior.get(f, 0.0) for f in feats])
    xp = x @ p
    s = max(float(xp @ y / (xp @ xp)), 0.0) if xp @ xp > 0 else 1.0
    kappa = trust * qm.PRIOR_PLANS if prior else 0.0
    d = qm.RIDGE + kappa * np.array([f in prior for f in feats], float)
    m = kappa * s * p / d
    w = np.linalg.solve(x.T @ x + np.diag(d), x.T @ y + d * m)
    return dict(zip(feats, np.maximum(w, 0.0), strict=True)), s, kappa


def _primal_predict(rows, ys, base, prior, target):
    """The model's prediction of plan `target` fitted on (rows, ys), at trust 1 (or none)."""
    weight, s, kappa = _primal(rows, ys, base, prior)
    out = base
    for f in target:
        if f in weight:
            out += weight[f]
        else:  # never measured: its prior's pull (0 without a prior)
            pull = kappa if f in prior else 0.0
            out += max(0.0, pull * s * prior.get(f, 0.0) / (qm.RIDGE + pull))
    return out


def _reference_trust(rows, ys, base, prior, history):
    n = len(rows)
    first = max(qm.TRUST_START, n - qm.TRUST_WINDOW)
    if n - first < qm.TRUST_MIN:
        return 1.0
    err_with = err_none = 0.0
    for k in range(first, n):
        lo = max(0, k - history)
        err_with += (_primal_predict(rows[lo:k], ys[lo:k], base, prior, rows[k]) - ys[k]) ** 2
        err_none += (_primal_predict(rows[lo:k], ys[lo:k], base, {}, rows[k]) - ys[k]) ** 2
    return min(1.0, max(0.0, 1.0 - err_with / err_none))


def _overlapping_plans(n, seed):
    # plans of 1-3 of 5 values each, so every prediction rests on values measured before
    rng = random.Random(seed)
    values = [(f"w.t{i}", "int4") for i in range(5)]
    cost = {f: rng.uniform(0.05, 0.5) for f in values}
    prior = {f: c * rng.uniform(0.4, 1.8) for f, c in cost.items()}
    rows = [tuple(rng.sample(values, rng.randint(1, 3))) for _ in range(n)]
    ys = [0.3 + sum(cost[f] for f in r) + rng.uniform(-0.05, 0.05) for r in rows]
    return rows, ys, prior


@pytest.mark.parametrize(("n", "seed"), [(6, 1), (13, 2)])
def test_the_prior_trust_matches_a_primal_ridge_on_overlapping_plans(n, seed):
    # bound: the two solutions of one linear system agree to rounding (rel 1e-6)
    rows, ys, prior = _overlapping_plans(n, seed)
    expected = _reference_trust(rows, ys, 0.3, prior, qm.TRUST_HISTORY)
    assert 0.0 < expected < 1.0  # an intermediate trust: neither clip decides it
    assert qm.prior_trust(rows, ys, 0.3, prior) == pytest.approx(expected, rel=1e-6)


def test_each_trust_prediction_is_fitted_on_at_most_trust_history_plans(monkeypatch):
    # TRUST_HISTORY 3: plan k is predicted from plans k-3..k-1 only (the reference fits
    # exactly those); the answer differs from the one on every earlier plan
    rows, ys, prior = _overlapping_plans(13, 2)
    monkeypatch.setattr(qm, "TRUST_HISTORY", 3)
    short = _reference_trust(rows, ys, 0.3, prior, 3)
    assert short != pytest.approx(_reference_trust(rows, ys, 0.3, prior, 200), rel=1e-3)
    assert qm.prior_trust(rows, ys, 0.3, prior) == pytest.approx(short, rel=1e-6)


def test_a_prior_is_fully_trusted_when_both_predict_every_plan_exactly():
    # every loss equals the reference's: without a prior each prediction is exact (0 error),
    # and the prior's scale fits to 0, so with it too: trust 1, not 0/0
    rows = [(("a", "int4"),), (("b", "int4"),), (("a", "int4"),), (("b", "int4"),)]
    assert qm.prior_trust(rows, [0.2] * 4, 0.2, {("a", "int4"): 1.0, ("b", "int4"): 2.0}) == 1.0


def test_a_prior_is_distrusted_when_only_no_prior_predicts_exactly():
    # plan 0 costs 1 (prior 1); plans 1-3 quantize fresh values that cost nothing. Without a
    # prior each fresh value is predicted 0: exact. The prior predicts s * p for each (s = 1,
    # 1/2, 1/3 from the plans before: errors ~1 + 1/4 + 1/9 > 1): any error against none is
    # no trust
    rows = [(("a", "int4"),), (("b", "int4"),), (("c", "int4"),), (("d", "int4"),)]
    prior = {r[0]: 1.0 for r in rows}
    assert qm.prior_trust(rows, [1.0, 0.0, 0.0, 0.0], 0.0, prior) == 0.0
    # a small error against none (under 1 in squares) is still no trust
    small = {r[0]: (1.0 if r[0][0] == "a" else 0.01) for r in rows}
    assert qm.prior_trust(rows, [1.0, 0.0, 0.0, 0.0], 0.0, small) == 0.0


def _study_with(trials, directions=("minimize", "minimize")):
    """trials: (prediction dict or None, values, state)."""
    study = optuna.create_study(directions=list(directions))
    for predicted, values, state in trials:
        trial = study.ask()
        if predicted is not None:
            study._storage.set_trial_system_attr(trial._trial_id, qm.PREDICTED_ATTR, predicted)
        if state == "pruned":
            trial.report(values[0], 0)
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:
            study.tell(trial, values)
    return study


def test_metrics_count_completed_plans_with_a_prediction_and_a_finite_measurement():
    # the reference plan (no prediction) comes first and is skipped, not the end of the list;
    # a plan measured inf (a failed gate's value) is left out of its objective
    study = _study_with(
        [
            (None, [0.0, 0.0], "complete"),
            ({"0": 0.1}, [0.1, 1.0], "complete"),
            ({"0": 0.2}, [0.25, 1.0], "complete"),
            ({"0": 5.0, "1": 9.0}, [float("inf"), 1.0], "complete"),
            ({"0": 0.4}, [0.5, 1.0], "complete"),
        ]
    )
    m = qm.prediction_metrics(study)
    assert m == {
        "capacity_aware.obj0.rank_corr": pytest.approx(1.0),
        "capacity_aware.obj0.median_rel_error": pytest.approx(0.2),
        "capacity_aware.obj0.predicted_plans": 3.0,
    }


def test_a_pruned_trials_last_report_is_not_a_measurement():
    # Optuna gives a pruned single-objective trial its last reported value: not a plan measured
    study = _study_with(
        [
            ({"0": 0.1}, [0.1], "complete"),
            ({"0": 0.2}, [0.25], "complete"),
            ({"0": 0.4}, [0.5], "complete"),
            ({"0": 0.3}, [9.0], "pruned"),
        ],
        directions=("minimize",),
    )
    m = qm.prediction_metrics(study, prefix="p")
    assert m["p.obj0.predicted_plans"] == 3.0
    assert m["p.obj0.rank_corr"] == pytest.approx(1.0)


def test_three_predicted_plans_are_enough_and_each_objective_is_counted_alone():
    # objective 0 has 2 predicted plans (left out), objective 1 has 3 (reported): a short
    # objective does not end the loop over the others
    study = _study_with(
        [
            ({"0": 0.1, "1": 0.3}, [0.1, 0.3], "complete"),
            ({"0": 0.2, "1": 0.1}, [0.2, 0.2], "complete"),
            ({"1": 0.2}, [0.5, 1.0], "complete"),
        ]
    )
    m = qm.prediction_metrics(study)
    assert set(m) == {
        "capacity_aware.obj1.rank_corr",
        "capacity_aware.obj1.median_rel_error",
        "capacity_aware.obj1.predicted_plans",
    }
    assert m["capacity_aware.obj1.predicted_plans"] == 3.0
    # predicted 0.3, 0.1, 0.2 for 0.3, 0.2, 1.0: ranks (3,1,2) vs (2,1,3): rho = 0.5; a
    # measured 1 is a measurement like any other (only a measured 0 is left out)
    assert m["capacity_aware.obj1.rank_corr"] == pytest.approx(0.5)
    assert m["capacity_aware.obj1.median_rel_error"] == pytest.approx(0.5)  # 0, .5, .8


def test_the_priors_pull_is_trust_times_prior_plans_measured_plans(monkeypatch):
    # PRIOR_PLANS 2 at trust 0.5: a pull of 1 measured plan. The measured values match the
    # primal solution; a value never measured sits at 1 / (1 + RIDGE) of s * p, and its
    # posterior sd is sigma / sqrt(RIDGE + 1)
    monkeypatch.setattr(qm, "PRIOR_PLANS", 2.0)
    rows, ys, prior = _overlapping_plans(8, 3)
    fresh = ("w.fresh", "int4")
    prior = {**prior, fresh: 0.7}
    fit = qm.fit(rows, ys, 0.3, prior, trust=0.5)
    weight, s, kappa = _primal(rows, ys, 0.3, prior, trust=0.5)
    assert kappa == 1.0 and fit.prior_scale == pytest.approx(s)
    for f, w in weight.items():
        assert fit.weight(f) == pytest.approx(w, rel=1e-6, abs=1e-12)
    assert fit.weight(fresh) == pytest.approx(s * 0.7 / (1.0 + qm.RIDGE))
    assert fit.sd(fresh) == pytest.approx(fit.sigma / np.sqrt(1.0 + qm.RIDGE))


A, B, K = ("w.a", "int4"), ("w.b", "int4"), ("kv.key_format", "int4")


def _is_kv(f) -> bool:
    return f[0].startswith("kv.")


def test_a_pair_counts_only_for_a_plan_holding_both_values():
    # loss = 0.2 a + 0.3 k + 0.5 [a and k]: the paired fit keeps the (a, k) term, and a plan
    # holding a alone (or k alone) is predicted without it; a pair never fitted adds 0
    plans = [(A,), (K,), (A, K), (B,), (A, B), (B, K)] * 2
    ys = [0.2 * (A in p) + 0.3 * (K in p) + 0.1 * (B in p) + 0.5 * (A in p and K in p)
          for p in plans]  # fmt: skip
    fit = qm.fit(plans, ys, 0.0, is_kv=_is_kv)
    assert fit.pair(A, K) == pytest.approx(0.5, rel=0.02)
    assert fit.predict((A,)) == pytest.approx(fit.base + fit.weight(A))
    assert fit.predict((K,)) == pytest.approx(fit.base + fit.weight(K))
    assert fit.predict((A, K)) == pytest.approx(fit.weight(A) + fit.weight(K) + fit.pair(A, K))
    assert (K, A) not in fit.pairs and fit.pair(K, A) == 0.0  # (weight, KV) order only
    assert fit.pair(("w.z", "int8"), K) == 0.0


def test_the_fit_counts_the_plans_that_measured_each_value():
    # a value listed twice in one plan is one plan
    rows = [(A, A), (A, B), (B,), (K,)]
    fit = qm.fit(rows, [0.1, 0.2, 0.3, 0.4], 0.0)
    assert fit.counts == {A: 2, B: 2, K: 1}


def test_a_fit_without_a_prior_is_at_full_trust():
    # trust is the prior's weight; with no prior there is nothing to distrust (prior_trust: 1)
    assert qm.fit([(A,), (B,)], [0.1, 0.2], 0.0).trust == 1.0
    assert qm.fit([(A,), (B,)], [0.1, 0.2], 0.0, {}).trust == 1.0


def test_a_fit_given_no_trust_uses_the_priors_measured_trust():
    rows, ys, prior = _overlapping_plans(13, 2)
    trust = qm.prior_trust(rows, ys, 0.3, prior)
    assert 0.0 < trust < 1.0
    fit = qm.fit(rows, ys, 0.3, prior)
    assert fit.trust == pytest.approx(trust)
    at = qm.fit(rows, ys, 0.3, prior, trust=trust)
    for f in at.weights:
        assert fit.weight(f) == pytest.approx(at.weight(f))


def test_the_pairwise_model_keeps_the_prior_for_values_never_measured():
    plans = [(A,), (K,), (A, K), (B,), (A, B), (B, K)] * 2
    ys = [0.2 * (A in p) + 0.3 * (K in p) + 0.1 * (B in p) + 0.5 * (A in p and K in p)
          for p in plans]  # fmt: skip
    fresh = ("w.fresh", "int4")
    prior = {A: 0.2, B: 0.1, K: 0.3, fresh: 0.4}
    fit = qm.fit(plans, ys, 0.0, prior, trust=1.0, is_kv=_is_kv)
    assert fit.pairs and fit.prior == prior
    s = fit.prior_scale
    assert s > 0 and fit.weight(fresh) == pytest.approx(s * 0.4 / (1.0 + qm.RIDGE))


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        # held by 1 plan, each value measured 3 times: not a candidate (PAIR_MIN = 2)
        ([(A,), (A,), (K,), (K,), (A, K)], []),
        # held by exactly PAIR_MIN plans, each value also measured without the other
        ([(A, K), (A, K), (A,), (K,)], [(A, K)]),
        # the KV value never measured without the weight value: one column with the pair
        ([(A, K), (A, K), (A,)], []),
    ],
)
def test_candidate_pairs_follow_pair_min_and_need_each_value_alone(rows, expected):
    assert qm.candidate_pairs(rows, _is_kv) == expected


def test_every_weight_value_of_a_plan_is_paired_with_its_kv_values():
    # 20 weight values each held twice with k: all 20 pairs are candidates, whatever order
    # a plan's set of values iterates in
    ws = [(f"w.t{i:02d}", "int4") for i in range(20)]
    rows = [r for w in ws for r in ((w, K), (w, K), (w,), (w,), (w,))] + [(K,)]
    assert qm.candidate_pairs(rows, _is_kv) == sorted(((w, K) for w in ws), key=repr)


def test_values_of_mixed_types_are_ordered_without_error():
    # a value is any hashable (a sink token count is an int, a format a string): the fit
    # and the candidate pairs order them by repr, not by comparing an int with a string
    s0, s4, fmt = ("w.sink", 0), ("w.sink", "int4"), ("w.sink", 4)
    rows = [(s0, K), (s0, K), (s0,), (s4, K), (s4, K), (s4,), (fmt, K), (fmt,), (K,), (K,)] * 2
    pairs = qm.candidate_pairs(rows, _is_kv)
    assert pairs == sorted([(s0, K), (s4, K), (fmt, K)], key=repr)
    fit = qm.fit(rows, [0.1 * len(r) for r in rows], 0.0)
    assert set(fit.weights) == {s0, s4, fmt, K}


@pytest.mark.parametrize("rows", [[], [(), ()]])
def test_with_no_value_measured_the_model_is_the_prior_at_face_value(rows):
    # no plan measured (or only reference plans, which hold no value): the prior's scale is 1,
    # a value with a prior sits at trust / (trust + RIDGE) of it, one without at 0; nothing
    # was counted and there is no residual, so no deviation
    prior = {A: 0.2, K: 0.4}
    fit = qm.fit(rows, [0.1] * len(rows), 0.1, prior, trust=0.5)
    assert fit.base == 0.1 and fit.trust == 0.5 and fit.prior == prior
    assert fit.weights == {} and fit.counts == {} and fit.pairs == {}
    assert fit.prior_scale == 1.0 and fit.sigma == 0.0
    assert fit.weight(K) == pytest.approx(0.5 / (0.5 + qm.RIDGE) * 0.4)
    assert fit.weight(B) == 0.0 and fit.sd(K) == 0.0
    assert fit.predict((A, K, B)) == pytest.approx(0.1 + fit.weight(A) + fit.weight(K))


def test_a_prior_no_measured_plan_holds_is_taken_at_face_value():
    # the measured plans hold only values without a prior: the scale s cannot be fitted (X p
    # = 0) and is 1, so an unmeasured value with a prior sits at 1 / (1 + RIDGE) of it
    fit = qm.fit([(A,), (B,)], [0.3, 0.5], 0.0, {K: 0.4}, trust=1.0)
    assert fit.prior_scale == 1.0
    assert fit.weight(K) == pytest.approx(0.4 / (1.0 + qm.RIDGE))


def test_one_measured_plan_scales_its_deviation_by_its_own_loss():
    # one plan leaves no residual to speak of: sigma is the largest |loss - base| measured
    fit = qm.fit([(A,)], [0.35], 0.05)
    assert fit.sigma == pytest.approx(0.3)
    assert fit.sd(B) == pytest.approx(0.3 / np.sqrt(qm.RIDGE))


def test_two_measured_plans_scale_by_their_residual_rms():
    # from two plans on, sigma is the residual RMS (here each value measured once: its fit is
    # y / (1 + RIDGE), residual y * RIDGE / (1 + RIDGE))
    ys = np.array([0.3, 0.5])
    fit = qm.fit([(A,), (B,)], ys.tolist(), 0.0)
    resid = ys * qm.RIDGE / (1 + qm.RIDGE)
    assert fit.sigma == pytest.approx(float(np.sqrt(np.mean(resid**2))), rel=1e-6)


def test_plans_measured_at_the_base_loss_keep_the_model_additive():
    # every plan measured exactly at the reference's loss (a discrete metric, e.g. exact-match
    # accuracy, often ties): both fits have zero leave-one-out error, so the pairs cut nothing
    # and none is kept (the pairwise rule: kept only when they cut the error by PAIR_GAIN)
    plans = [(A,), (K,), (A, K), (B,), (A, B), (B, K)] * 2
    assert qm.candidate_pairs(plans, _is_kv)
    fit = qm.fit(plans, [0.25] * len(plans), 0.25, is_kv=_is_kv)
    assert fit.pairs == {}
    assert fit.weights == {A: 0.0, B: 0.0, K: 0.0}


class _FixedHash(str):
    """A name or value whose hash is fixed, so a plan's set of values iterates in one order
    on every run (a str's own hash changes with PYTHONHASHSEED)."""

    def __new__(cls, text: str, h: int):
        out = super().__new__(cls, text)
        out._h = h
        return out

    def __hash__(self) -> int:
        return self._h

    __eq__ = str.__eq__


def test_a_weight_value_is_paired_even_when_the_plan_lists_its_kv_value_first():
    # a plan's values are a set: the weight value must be paired whatever the set yields first.
    # The KV value's hash is chosen so that its plans' sets yield the KV value first (checked),
    # which makes the order this test exercises the same on every run.
    w = (_FixedHash("w.a", 1), _FixedHash("int4", 3))
    k = next(
        kv
        for h in range(64)
        if next(iter({w, kv := (_FixedHash("kv.key_format", h), _FixedHash("int4", 3))})) == kv
    )
    assert next(iter(set((w, k)))) == k and next(iter(set((k, w)))) == k
    rows = [(w, k), (k, w), (w,), (k,)]
    assert qm.candidate_pairs(rows, _is_kv) == [(w, k)]
