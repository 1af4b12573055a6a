"""The capacity-aware sampler: spend quality evaluations only where they can move the front.

Capacity is exact and costs about a millisecond, quality costs seconds, and generic samplers
ignore that asymmetry. `KnapsackSampler` (the `capacity_aware` kind, any space size) solves
the capacity side exactly as a knapsack over weight bytes (tenantq.search.knapsack) against an
additive quality model with a prior (tenantq.search.quality_model), and measures the plan
predicted to improve the front most; `build_problem` turns a study's space into that knapsack.
`CapacityAwareSampler` is issue 12's enumerating form over an explicit candidate list, kept
for synthetic landscapes and comparison (`choose`, `additive_fit`).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from optuna.distributions import CategoricalDistribution
from optuna.samplers import BaseSampler, RandomSampler
from optuna.trial import TrialState

from tenantq.search import knapsack
from tenantq.search.quality_model import PREDICTED_ATTR

RIDGE = 1e-3  # shrinks a parameter value's fitted loss toward 0 when data barely separate it


@dataclass(frozen=True)
class Candidate:
    """One plan of the finite space: the trial parameters, its tenants, its identity."""

    params: dict[str, Any]
    tenants: int
    key: str  # the plan fingerprint: candidates sharing one are one plan


def additive_fit(
    features: Sequence[Sequence[tuple[str, Any]]], losses: Sequence[float]
) -> dict[tuple[str, Any], float]:
    """Non-negative loss per (parameter, value) so that a plan's loss is their sum, by NNLS
    with a small ridge; values absent from `features` are not in the result (predicted 0)."""
    from scipy.optimize import nnls

    names = sorted({f for row in features for f in row}, key=repr)
    if not names:
        return {}
    col = {f: j for j, f in enumerate(names)}
    a = np.zeros((len(features) + len(names), len(names)))
    for i, row in enumerate(features):
        for f in row:
            a[i, col[f]] = 1.0
    scale = max(float(np.max(np.abs(losses))), 1e-12) if len(losses) else 1.0
    a[len(features) :, :] = math.sqrt(RIDGE) * np.eye(len(names))
    b = np.concatenate([np.asarray(losses, float) / scale, np.zeros(len(names))])
    weights, _ = nnls(a, b)
    return {f: float(w) * scale for f, w in zip(names, weights, strict=True)}


def choose(
    candidates: Sequence[Candidate],
    measured: dict[str, float],
    exclude: set[str] = frozenset(),
) -> Candidate | None:
    """The next plan to measure, given losses measured so far (key -> loss, lower is better).

    The reference is the plan with the fewest tenants (the most precise one); it is measured
    first. A plan's predicted loss is the reference's plus the fitted loss of each parameter
    value where it differs from the reference (`additive_fit`; unmeasured values cost 0). Gain
    = relative improvement of the prediction over the best measured loss among plans with at
    least its tenants (infinite when none has as many); the largest gain wins, ties to more
    tenants. None when every plan is measured or excluded."""
    reference = min(candidates, key=lambda c: c.tenants)
    if reference.key not in measured and reference.key not in exclude:
        return reference
    base = measured.get(reference.key, 0.0)

    def deviations(c: Candidate) -> tuple[tuple[str, Any], ...]:
        return tuple(sorted((k, v) for k, v in c.params.items() if reference.params[k] != v))

    seen = {c.key: c for c in candidates if c.key in measured and c.key != reference.key}
    fit = additive_fit([deviations(c) for c in seen.values()], [measured[k] - base for k in seen])
    by_tenants = sorted((c for c in candidates if c.key in measured), key=lambda c: -c.tenants)
    best: tuple[float, int, int] | None = None
    pick = None
    for i, c in enumerate(candidates):
        if c.key in measured or c.key in exclude:
            continue
        predicted = base + sum(fit.get(f, 0.0) for f in deviations(c))
        incumbent = min(
            (measured[s.key] for s in by_tenants if s.tenants >= c.tenants), default=math.inf
        )
        if math.isinf(incumbent):
            gain = math.inf
        elif incumbent > 0:
            gain = (incumbent - predicted) / incumbent
        else:
            gain = incumbent - predicted
        score = (gain, c.tenants, -i)
        if best is None or score > best:
            best, pick = score, c
    return pick


class CapacityAwareSampler(BaseSampler):
    """Optuna sampler over a finite list of candidates (see the module docstring).

    `quality_index` is the position of the quality objective in the study's values;
    `quality_sign` is +1 when it is minimized and -1 when it is maximized (loss = sign *
    value). Tenants come from the candidates (exact), not from the study."""

    def __init__(
        self,
        candidates: Sequence[Candidate],
        *,
        quality_index: int,
        quality_sign: float = 1.0,
        seed: int | None = None,
        distributions: dict[str, Any] | None = None,
        failure_budget: int = 1,
    ):
        if not candidates:
            raise ValueError("capacity_aware sampler: the space has no candidate plans")
        self.candidates = list(candidates)
        self.quality_index = quality_index
        self.quality_sign = quality_sign
        self.failure_budget = failure_budget  # failed attempts a plan may have (1 + retries)
        self._by_params = {_params_key(c.params): c for c in self.candidates}
        # The distributions `space.suggest` asks with (an int range is an IntDistribution):
        # declaring another kind makes Optuna refuse the suggestion and fail every trial.
        self._space = distributions or {
            name: CategoricalDistribution(
                list(dict.fromkeys(c.params[name] for c in self.candidates))
            )
            for name in self.candidates[0].params
        }
        self._fallback = RandomSampler(seed=seed)

    def reseed_rng(self) -> None:
        self._fallback.reseed_rng()

    def infer_relative_search_space(self, study, trial) -> dict[str, CategoricalDistribution]:
        return dict(self._space)

    def sample_relative(self, study, trial, search_space) -> dict[str, Any]:
        if not search_space:
            return {}
        measured: dict[str, float] = {}
        pending: set[str] = set()  # in flight, or failed for good: not to be proposed again
        failed = []
        trials = study.get_trials(deepcopy=False)
        by_number = {t.number: t for t in trials}
        for t in trials:
            c = self._by_params.get(_params_key(t.params))
            if c is None:
                continue
            if t.state == TrialState.COMPLETE and t.values is not None:
                loss = self.quality_sign * t.values[self.quality_index]
                measured[c.key] = min(loss, measured.get(c.key, math.inf))
            elif t.state == TrialState.FAIL:
                failed.append((c.key, failure_weight(t, by_number)))
            elif t.state in (TrialState.RUNNING, TrialState.WAITING) and t.number != trial.number:
                pending.add(c.key)
        pending |= failed_for_good(failed, self.failure_budget)
        pick = choose(self.candidates, measured, pending)
        if pick is None:  # everything measured or in flight: any plan (answered from the study)
            return {}
        return {k: v for k, v in pick.params.items() if k in search_space}

    def sample_independent(self, study, trial, param_name, param_distribution) -> Any:
        return self._fallback.sample_independent(study, trial, param_name, param_distribution)


def _params_key(params: dict[str, Any]) -> tuple:
    return tuple(sorted(params.items(), key=lambda kv: kv[0]))


def failure_weight(trial, by_number: dict | None = None) -> str | None:
    """What a FAILed trial says about its plan, read from the study by the ledger's own rule
    (`tenantq.search.ledger.failure_of`, as `Ledger.restore` reads it): "settles" (the plan's
    own failure: error, nan, plan, or a re-proposal of a plan already failed for good),
    "counts" (one retryable failure: worker_died, timeout, driver_died, of a trial that ran
    its plan itself), or None (it blames no plan: driver_stopped, duplicate, not_run, a trial
    copied by --continue-as, a retry killed before it ran). Records older than the ledger's
    marks are read as the ledger reads them (their reason from their own error text), so the
    sampler never proposes a plan the ledger would refuse as failed before. `by_number`: the
    study's trials by number (a retry's inherited attributes are told from its own); a FAIL
    of a study not run by tenantq's driver (no fingerprint, no reason) counts once."""
    from tenantq.search.ledger import (
        COPIED_ATTR,
        FINGERPRINT_ATTR,
        REASON_ATTR,
        RETRYABLE,
        failure_of,
    )

    attrs = trial.user_attrs
    if COPIED_ATTR in attrs:
        return None
    if FINGERPRINT_ATTR not in attrs and REASON_ATTR not in attrs:
        return "counts"  # a foreign study's FAIL (e.g. Optuna's stale-trial fail)
    reason, ran = failure_of(trial, by_number or {})
    if reason in ("driver_stopped", "duplicate", "not_run"):
        return None
    if reason in RETRYABLE:
        return "counts" if ran else None
    return "settles"


def attempts_left(failed: Sequence[tuple[Any, str | None]], budget: int) -> dict:
    """Attempts left per failed plan (key), from (key, failure_weight) pairs: 0 after one
    settling failure, else `budget` (= 1 + study.max_trial_retries) less its retryable ones
    (the ledger's count, `Ledger.restore`)."""
    budget = max(1, budget)
    left: dict[Any, int] = {}
    for key, weight in failed:
        n = left.get(key, budget)
        if weight == "settles":
            n = 0
        elif weight == "counts":
            n = max(0, n - 1)
        left[key] = n
    return left


def failed_for_good(failed: Sequence[tuple[Any, str | None]], budget: int) -> set:
    """Plans (keys) that failed for good (`attempts_left` 0); any other failed plan may be
    proposed again."""
    return {key for key, n in attempts_left(failed, budget).items() if n == 0}


# ---------------------------------------------------------------- any space: the knapsack sampler
MAX_TRIES = 256  # DP picks checked against the study per ask before falling back to random
MAX_RERANKS = 32  # plans located anew to re-rank at an SLO per ask; then the best is taken
# At most this many parameter sets: every plan is scored (the DP gives one best plan per KV
# plan and tenant level, so once that plan is measured a level's second best is never seen;
# on the 168-plan space that left one front level unmeasured at 40 evaluations).
ENUMERATE_LIMIT = 5000
TIE_DIGITS = 9  # gains (in units of the known losses' range) are compared to 1e-9


class KnapsackSampler(BaseSampler):
    """The capacity-aware sampler for a space of any size (tenantq.search.knapsack).

    Each ask: fit the quality model (tenantq.search.quality_model) to the study's measured
    plans, solve the weight knapsack per section with each value at its planning loss
    (`Fit.lcb`), and for every KV plan and tenant level t take the least predicted loss at >= t
    tenants; the pick is the level whose prediction improves most on the best measured loss at
    >= t tenants (infinite where none is measured; ties to more tenants), skipping plans the
    study holds (measured, in flight, failed for good: `failure_weight`; a plan whose
    retryable failures are under `failure_budget` may be proposed again, and one stopped with
    the driver always may). The most precise plan is measured first. A space of at most
    ENUMERATE_LIMIT parameter sets is scored plan by plan with the same model and rule.
    Several quality objectives are scalarised: a weight vector drawn per ask from (seed,
    completed trials) on the simplex, each objective scaled by its measured range. Everything
    is decided from the study's trials, so a resumed study picks up where it stopped.

    `locate(params)` -> (plan fingerprint, exact tenants) is the study's own count
    (`StudyContext.plan_and_budget`); `quality` lists (objective index, +1 minimize / -1
    maximize)."""

    def __init__(
        self,
        problem: knapsack.Problem,
        *,
        quality: Sequence[tuple[int, float]],
        locate,
        distributions: dict[str, Any],
        prior: dict | None = None,
        seed: int | None = None,
        weight_seed: int | None = None,
        failure_budget: int = 1,
    ):
        knapsack.check_problem(problem)
        if not quality:
            raise ValueError("capacity_aware sampler: no quality objective")
        self.problem = problem
        self.quality = list(quality)
        self._locate_fn = locate
        self._located: dict[tuple, tuple[str, int]] = {}
        self._space = dict(distributions)
        self.prior = prior or {}
        self.failure_budget = failure_budget  # failed attempts a plan may have (1 + retries)
        # the scalarisation's draws: the spec's seed, not this start's, so a resumed study
        # draws what an uninterrupted one would
        self.seed = weight_seed if weight_seed is not None else (0 if seed is None else seed)
        self._fallback = RandomSampler(seed=seed)
        self.reference = _reference(problem)
        self._kv_names = {n for k in problem.kv for n in k.params}
        self.last_pick: dict[str, Any] | None = None  # what the last ask chose and why

    def reseed_rng(self) -> None:
        self._fallback.reseed_rng()

    def infer_relative_search_space(self, study, trial) -> dict[str, Any]:
        return dict(self._space)

    def sample_independent(self, study, trial, param_name, param_distribution) -> Any:
        return self._fallback.sample_independent(study, trial, param_name, param_distribution)

    def locate(self, params: dict[str, Any]) -> tuple[str, int]:
        key = _params_key(params)
        if key not in self._located:
            self._located[key] = self._locate_fn(params)
        return self._located[key]

    def _is_kv(self, feature) -> bool:
        return feature[0] in self._kv_names

    def features(self, params: dict[str, Any]) -> tuple:
        ref = self.reference
        return tuple((k, params[k]) for k in sorted(params) if k in ref and ref[k] != params[k])

    # -- the study's state
    def _state(self, study, trial):
        self._believed: dict[str, tuple[int, list[float]]] = {}  # in flight: predicted losses
        measured: dict[str, tuple[int, list[float], tuple]] = {}
        held: set[str] = set()
        held_params: set[tuple] = set()
        failed: list[tuple[str, str | None]] = []
        failed_params: dict[str, list[tuple]] = {}
        trials = study.get_trials(deepcopy=False)
        by_number = {t.number: t for t in trials}
        for t in trials:
            if t.number == trial.number:
                continue
            params = t.params or t.system_attrs.get("fixed_params") or {}
            if set(params) != set(self._space):
                continue  # not this space's trial (or asked nothing yet)
            params = {k: params[k] for k in self._space}
            if t.state == TrialState.COMPLETE and t.values is not None:
                fp, tenants = self.locate(params)
                losses = [sign * t.values[i] for i, sign in self.quality]
                if not all(math.isfinite(x) for x in losses):
                    held.add(fp)
                    continue
                old = measured.get(fp)
                if old is None or losses[0] < old[1][0]:
                    measured[fp] = (tenants, losses, self.features(params))
            elif t.state == TrialState.FAIL:
                try:
                    fp, _ = self.locate(params)
                except ValueError:  # its parameters made no plan: no plan to blame
                    continue
                failed.append((fp, failure_weight(t, by_number)))
                failed_params.setdefault(fp, []).append(_params_key(params))
            elif t.state in (TrialState.RUNNING, TrialState.WAITING):
                held_params.add(_params_key(params))
                fp, tenants = self.locate(params)
                held.add(fp)
                predicted = t.system_attrs.get(PREDICTED_ATTR)
                if t.state == TrialState.RUNNING and predicted:
                    losses = [sign * predicted[str(i)] for i, sign in self.quality]
                    self._believed[fp] = (tenants, losses)
        # a failed plan is proposed again while its retryable failures are under its budget
        for fp in failed_for_good(failed, self.failure_budget):
            held.add(fp)
            held_params.update(failed_params[fp])
        return measured, held, held_params

    def sample_relative(self, study, trial, search_space) -> dict[str, Any]:
        if not search_space or trial.system_attrs.get("fixed_params"):
            return {}  # an enqueued trial (baseline, retry): its parameters are fixed
        measured, held, held_params = self._state(study, trial)
        ref_fp, _ = self.locate(self.reference)
        if ref_fp not in measured and ref_fp not in held:
            self.last_pick = {"reason": "reference", "params": dict(self.reference)}
            return self._answer(study, trial, dict(self.reference), None)
        pick = self._choose(measured, held, held_params, study, trial)
        if pick is None:  # every plan the model prefers is held: a random one (random sampler)
            self.last_pick = {"reason": "random"}
            return {}
        params, fits = pick
        return self._answer(study, trial, params, fits)

    def _answer(self, study, trial, params, fits):
        if fits is not None:
            feats = self.features(params)
            predicted = {
                str(i): sign * f.predict(feats)
                for (i, sign), f in zip(self.quality, fits, strict=True)
            }
            study._storage.set_trial_system_attr(trial._trial_id, PREDICTED_ATTR, predicted)
        return {k: v for k, v in params.items() if k in self._space}

    def _choose(self, measured, held, held_params, study, trial):
        from tenantq.search import quality_model as qm

        base = {}
        ref_fp, _ = self.locate(self.reference)
        rows = [m[2] for fp, m in measured.items() if fp != ref_fp]
        fits = []
        for j in range(len(self.quality)):
            b = (
                measured[ref_fp][1][j]
                if ref_fp in measured
                else min((m[1][j] for m in measured.values()), default=0.0)
            )
            base[j] = b
            ys = [m[1][j] for fp, m in measured.items() if fp != ref_fp]
            fits.append(qm.fit(rows, ys, b, self.prior, is_kv=self._is_kv))
        lam = self._weights(len(measured))
        multi = len(self.quality) > 1
        if multi:
            spans = []
            for j in range(len(self.quality)):
                vals = [m[1][j] for m in measured.values()]
                spans.append(max(max(vals) - min(vals), 1e-12) if vals else 1.0)
            lam = [lam[j] / spans[j] for j in range(len(lam))]

        def cost(feats) -> float:  # each value's cost rounded (TIE_DIGITS, in units of span):
            # values fitted alike must tie exactly in the knapsack whatever the metric's offset
            return sum(
                round(lam[j] * fits[j].lcb(f) / span, TIE_DIGITS) * span
                for j in range(len(fits))
                for f in feats
            )

        # pairwise (weight value x KV value) terms: constant once the KV plan is fixed, so the
        # knapsack stays exact with the KV choice as its outer loop. KV plans alike in the KV
        # values that have a pair term (their signature) share one DP per section.
        pair_kv = {g for fit in fits for (_, g) in fit.pairs}
        kv_feats = [self.features(k.params) for k in self.problem.kv]
        sigs = [tuple(g for g in fs if g in pair_kv) for fs in kv_feats]

        def pair_cost(feats, sig) -> float:
            if not sig:
                return 0.0
            return sum(
                round(lam[j] * fits[j].pair(f, g) / span, TIE_DIGITS) * span
                for j in range(len(fits))
                for f in feats
                for g in sig
            )

        def option_costs(sec, sig) -> list[np.ndarray]:
            return [
                np.array([cost(self.features(o.params)) + pair_cost(self.features(o.params), sig)
                          for o in g])
                for g in sec.groups
            ]  # fmt: skip

        def sec_cost(sec, ki) -> float:
            fs = self.features(sec.params)
            return cost(fs) + pair_cost(fs, sigs[ki])

        const = sum(lam[j] * base[j] for j in range(len(fits)))
        # incumbents: the best measured (scalarised) loss at >= t tenants; a plan in flight
        # counts at its predicted loss, so parallel workers do not all go to one tenant level
        known = [m[:2] for m in measured.values()]
        known += [b for fp, b in self._believed.items() if fp not in measured]
        inc_t = np.array(sorted((m[0] for m in known), reverse=True), dtype=np.int64)
        order = sorted(known, key=lambda m: -m[0])
        scal = np.array([sum(lam[j] * m[1][j] for j in range(len(fits))) for m in order])
        inc_v = np.minimum.accumulate(scal)
        # gain = (incumbent - predicted) / range of the losses known: free of the metric's
        # offset (maximize -L and maximize 1 - L rank the plans alike) and of its scale
        span = float(scal.max() - scal.min()) if len(scal) > 1 else 0.0
        if span <= 0:  # one loss known (or all equal): the scale of the predicted excesses,
            # offset-free too (an absolute 1.0 rounded every value of a metric ~1e-9 to 0)
            span = max(
                (lam[j] * fits[j].weight(f) for j in range(len(fits))
                 for f in (*fits[j].prior, *fits[j].weights)),
                default=0.0,
            )  # fmt: skip
            span = span if span > 0 else 1.0
        self._solved: dict[int, knapsack.Solved] = {}
        cands = []  # (gain, tenants, -pred, section, kv, width or the options themselves)
        kv_cost = [cost(self.features(k.params)) for k in self.problem.kv]

        def gains(ts: np.ndarray, pred: np.ndarray) -> np.ndarray:
            n_ge = np.searchsorted(-inc_t, -ts, side="right")
            inc = np.full(len(ts), np.inf)
            if len(inc_v):
                inc = np.where(n_ge > 0, inc_v[np.maximum(n_ge - 1, 0)], np.inf)
            with np.errstate(invalid="ignore"):
                gain = (inc - pred) / span
            # rounded: a metric's offset (maximize 1 - L vs -L) moves every figure by float
            # rounding only, which must not break ties between equal gains differently
            return np.where(np.isinf(inc), np.inf, np.round(gain, TIE_DIGITS))

        def rank(pred):  # the tie-break on the prediction, free of the offset's rounding too
            return -np.round((np.asarray(pred) - const) / span, TIE_DIGITS)

        if self.problem.size() <= ENUMERATE_LIMIT:  # small: every plan scored (exact k-best)
            for si, sec in enumerate(self.problem.sections):
                c_sec = np.array([sec_cost(sec, ki) for ki in range(len(self.problem.kv))])
                by_sig = {s: [c.tolist() for c in option_costs(sec, s)] for s in set(sigs)}
                for combo in itertools.product(*(range(len(g)) for g in sec.groups)):
                    w_bytes = sec.const_bytes + sum(
                        g[o].bytes for g, o in zip(sec.groups, combo, strict=True)
                    )
                    c_by_sig = {
                        s: sum(costs[g][o] for g, o in enumerate(combo))
                        for s, costs in by_sig.items()
                    }
                    c_w = np.array([c_by_sig[s] for s in sigs])
                    ts = np.array([self.problem.tenants(w_bytes, k) for k in self.problem.kv])
                    pred = const + c_sec + c_w + np.array(kv_cost)
                    for ki, (g, t, p) in enumerate(
                        zip(gains(ts, pred).tolist(), ts.tolist(), pred.tolist(), strict=True)
                    ):
                        cands.append((g, t, float(rank(p)), si, ki, combo))
        group_costs: dict[tuple, list[np.ndarray]] = {}  # (section, signature) -> costs
        for si, sec in enumerate(self.problem.sections if not cands else ()):
            for sig in dict.fromkeys(sigs):
                costs = option_costs(sec, sig)
                group_costs[(si, sig)] = costs
                self._solved[(si, sig)] = knapsack.solve(self.problem, si, costs)
            for ki, kv in enumerate(self.problem.kv):
                solved = self._solved[(si, sigs[ki])]
                ts, ws = knapsack.levels(self.problem, solved, kv)
                if len(ts) == 0:
                    continue
                pred = const + sec_cost(sec, ki) + kv_cost[ki] + solved.best[ws]
                gain = gains(ts, pred)
                for g, t, p, w in zip(
                    gain.tolist(), ts.tolist(), pred.tolist(), ws.tolist(), strict=True
                ):
                    cands.append((g, t, float(rank(p)), si, ki, w))
        # A max-heap of candidates. The DP gives one plan per (KV plan, level); when that plan
        # is measured or held, its one-option swaps that keep the level (the width cap) enter
        # the heap with their own prediction and gain, so a level's next-best plans are
        # proposed too (a best-first walk from the DP's plan, Lawler-Murty in spirit).
        cands.sort(reverse=True)  # the tie order of the candidates as before: by serial
        heap = [(-g, -t, -negp, n, si, ki, w, w) for n, (g, t, negp, si, ki, w) in enumerate(cands)]
        heapq.heapify(heap)
        serial = len(heap)
        tried: set[tuple] = set()
        corrected: set[tuple] = set()  # re-ranked at their exact capacity (below the level)
        # the best re-ranked plan (heap entry, params, tenants): where the SLO binds every
        # memory level can sit above every incumbent, so all DP plans tie at an infinite gain
        # and the walk would re-rank them all; after MAX_RERANKS plans located anew (a plan
        # located on an earlier ask is free, so a small space is still walked in full) it
        # takes the best of those re-ranked
        best_reranked: tuple | None = None
        reranks = 0
        while heap:
            ng, nt, p, _, si, ki, w, cap = heapq.heappop(heap)
            g, t, negp = -ng, -nt, -p
            sec = self.problem.sections[si]
            solved = self._solved.get((si, sigs[ki]))
            solved_opts = w if isinstance(w, tuple) else tuple(solved.options_at(w))
            key = (si, ki, solved_opts)
            if key in tried and key not in corrected:
                continue
            again = key in corrected  # re-ranked: its entry at its exact capacity is queued
            tried.add(key)
            if len(tried) > MAX_TRIES:
                break
            params = dict(sec.params)
            for grp, o in zip(sec.groups, solved_opts, strict=True):
                params.update(grp[o].params)
            params.update(self.problem.kv[ki].params)
            fp = None
            cached = _params_key(params) in self._located  # a re-rank of it costs nothing
            if _params_key(params) not in held_params:
                fp, tenants = self.locate(params)
            free = fp is not None and fp not in measured and fp not in held
            if free and tenants < t and again:
                # the same plan offered at another memory level above its exact capacity (the
                # DP offers one plan at many levels): a stale entry, its re-ranked one is queued
                continue
            if free and tenants < t:
                # the level is memory tenants; the study's capacity (tenants at an SLO) is at
                # most that, so the gain at the plan's exact capacity is at most the one it was
                # ranked by: re-ranked at its exact capacity (a best-first walk stays exact)
                pred = const - negp * span
                g2 = float(gains(np.array([tenants]), np.array([pred]))[0])
                corrected.add(key)
                entry = (-g2, -tenants, p, serial, si, ki, solved_opts, cap)
                if best_reranked is None or entry < best_reranked[0]:
                    best_reranked = (entry, params, tenants, pred)
                heapq.heappush(heap, entry)
                serial += 1
                reranks += not cached
                if reranks >= MAX_RERANKS:
                    break
                continue
            if not free:
                sig_key = (si, sigs[ki])
                if sig_key in group_costs and not isinstance(cap, tuple):  # a DP plan: swaps
                    swaps = [
                        (alt, c)
                        for alt, c in self._swaps(si, solved_opts, cap, group_costs[sig_key])
                        if (si, ki, alt) not in tried
                    ]
                    if swaps:
                        fixed = const + sec_cost(sec, ki) + kv_cost[ki]
                        preds = fixed + np.array([c for _, c in swaps])
                        gs = gains(np.full(len(swaps), t), preds)
                        for (alt, _), ga, pa in zip(
                            swaps, gs.tolist(), preds.tolist(), strict=True
                        ):
                            heapq.heappush(
                                heap, (-ga, -t, -float(rank(pa)), serial, si, ki, alt, cap)
                            )
                            serial += 1
                continue
            self.last_pick = {"reason": "knapsack", "gain": g, "level": t, "tenants": tenants,
                              "predicted": const - negp * span, "params": params}  # fmt: skip
            return params, fits
        if best_reranked is not None:  # the walk was cut: the best plan located on the way
            (ng, nt, *_), params, tenants, pred = best_reranked
            self.last_pick = {"reason": "knapsack", "gain": -ng, "level": -nt, "tenants": tenants,
                              "predicted": pred, "params": params}  # fmt: skip
            return params, fits
        return None

    def _swaps(self, si: int, opts: tuple, cap: int, costs: list[np.ndarray]):
        """(options, predicted weight cost) of every plan one option away from `opts` whose
        ticks stay within the width `cap` (so within the same tenant level)."""
        ticks = self.problem.sizing[si].ticks
        used = sum(int(ticks[g][o]) for g, o in enumerate(opts))
        base = sum(float(costs[g][o]) for g, o in enumerate(opts))
        for g, o in enumerate(opts):
            for alt in range(len(ticks[g])):
                if alt != o and used - int(ticks[g][o]) + int(ticks[g][alt]) <= cap:
                    new = opts[:g] + (alt,) + opts[g + 1 :]
                    yield new, base - float(costs[g][o]) + float(costs[g][alt])

    def _weights(self, n: int) -> list[float]:
        if len(self.quality) == 1:
            return [1.0]
        rng = np.random.default_rng([self.seed, n])
        return rng.dirichlet(np.ones(len(self.quality))).tolist()


def _reference(problem: knapsack.Problem) -> dict[str, Any]:
    """The most precise plan: the section and options with the most weight bytes, the KV plan
    with the most bytes per tenant (the fewest tenants)."""

    def heaviest(sec):
        return sec.const_bytes + sum(max(o.bytes for o in g) for g in sec.groups)

    sec = max(problem.sections, key=heaviest)
    params = dict(sec.params)
    for g in sec.groups:
        params.update(max(g, key=lambda o: o.bytes).params)
    kv = max(problem.kv, key=lambda k: (k.tenant_bytes, k.static_bytes))
    params.update(kv.params)
    return params


def sampler_for_spec(spec, seed: int | None = None) -> KnapsackSampler:
    """The sampler for a study spec (its context built here; the driver passes its own to
    `sampler_for_context` instead)."""
    _check_quality(spec)
    from tenantq.search.context import study_context

    return sampler_for_context(study_context(spec, ""), seed=seed)


def _check_quality(spec) -> list[int]:
    from tenantq.search.spec import CAPACITY_METRICS

    quality = [i for i, o in enumerate(spec.objectives) if o.metric not in CAPACITY_METRICS]
    if not quality:
        raise ValueError(
            "sampler.kind = 'capacity_aware' needs a quality objective besides the capacity "
            f"({' or '.join(CAPACITY_METRICS)})"
        )
    return quality


def sampler_for_context(context, seed: int | None = None) -> KnapsackSampler:
    """The knapsack sampler over the study's space (any size) on the spec's deployment; the
    capacity side from the context's own `plan_and_budget`."""
    from tenantq.search.space import distributions, parameter_choices

    spec = context.spec
    quality = _check_quality(spec)
    choices = parameter_choices(spec.space, context.config, context.profile)
    problem = build_problem(context)

    capacity = context.capacity  # built once: it caches each plan's service level

    def locate(params):  # the study's capacity value: tenants by memory, or at its SLO
        plan, b = context.plan_and_budget(params)
        return plan.fingerprint(), capacity.tenants(plan, b)

    return KnapsackSampler(
        problem,
        quality=[(i, 1.0 if spec.objectives[i].direction == "minimize" else -1.0) for i in quality],
        locate=locate,
        distributions=distributions(choices),
        prior=profile_prior(spec.space, choices),
        failure_budget=1 + spec.study.max_trial_retries,
        seed=spec.sampler.seed if seed is None else seed,
        weight_seed=spec.sampler.seed,
    )


def profile_prior(space, choices) -> dict:
    """(w.TENSOR, format) -> the sensitivity profile's KL for that tensor in that format, for a
    per-tensor space with `space.profile` set (the quality model's prior); else empty."""
    if space.kind != "per_tensor" or not space.profile:
        return {}
    from tenantq.evals.profile import read_profile_table

    table = read_profile_table(space.profile)
    prior: dict = {}
    for tensor, fmt, kl in zip(
        table.column("tensor").to_pylist(),
        table.column("format").to_pylist(),
        table.column("kl_mean").to_pylist(),
        strict=True,
    ):
        key = (f"w.{tensor}", fmt)
        if key[0] in choices and kl is not None and math.isfinite(kl):
            prior[key] = max(prior.get(key, 0.0), float(kl))
    return prior


# ---------------------------------------------------------------- the space as a knapsack
def build_problem(context) -> knapsack.Problem:
    """The study's space as sections of weight groups and KV options, every byte figure read
    from `capacity.budget` of a few plans (one per format and section), never counted anew."""
    from tenantq.search.space import parameter_choices

    spec = context.spec
    choices = parameter_choices(spec.space, context.config, context.profile)
    kv_names = [n for n in choices if n.startswith("kv.") or n == "sens.kv_keep_bf16"]
    weight_names = [n for n in choices if n not in kv_names]
    ref_kv = {n: list(choices[n])[0] for n in kv_names}
    kind = spec.space.kind
    if kind == "per_tensor":
        sections = [_per_tensor_section(context, choices, weight_names, ref_kv)]
    elif kind == "structured":
        sections = _structured_sections(context, choices, weight_names, ref_kv)
    else:
        sections = [_sensitivity_section(context, choices, ref_kv)]
    base = next(iter(sections))
    any_params = dict(base.params)
    for g in base.groups:
        any_params.update(g[0].params)
    kv = _kv_options(context, choices, kv_names, any_params)
    dep = context.deployment
    return knapsack.Problem(
        tuple(sections), tuple(kv), dep.hardware.hbm_bytes, dep.reserve_bytes_per_chip
    )


def _tensor_bytes(context, params) -> dict[str, int]:
    _, b = context.plan_and_budget(params)
    return {t.path: t.bytes_per_chip for t in b.tensors}


def _per_tensor_section(context, choices, weight_names, ref_kv) -> knapsack.Section:
    formats = list(dict.fromkeys(f for n in weight_names for f in choices[n]))
    by_format = {}
    for f in formats:
        by_format[f] = _tensor_bytes(context, {**{n: f for n in weight_names}, **ref_kv})
    paths = next(iter(by_format.values()))
    controlled = {n[2:] for n in weight_names}
    const = sum(b for p, b in paths.items() if p not in controlled)
    groups = []
    for n in weight_names:
        path = n[2:]
        groups.append(tuple(
            knapsack.Option({n: f}, by_format[f].get(path, 0)) for f in choices[n]
        ))  # fmt: skip
    return knapsack.Section({}, const, tuple(groups))


def _structured_sections(context, choices, weight_names, ref_kv) -> list[knapsack.Section]:
    import itertools
    import re

    from tenantq.search.space import EMBED_CLASSES, TENSOR_CLASSES, _edge_layers

    config = context.config
    edge_names = [n for n in ("bf16_first_layers", "bf16_last_layers") if n in weight_names]
    group_names = [n for n in weight_names if n not in edge_names]
    formats = list(dict.fromkeys(f for n in group_names for f in choices[n]))
    sections = []
    for edges in itertools.product(*(list(choices[n]) for n in edge_names)):
        fixed = dict(zip(edge_names, edges, strict=True))
        layers = _edge_layers(
            fixed.get("bf16_first_layers", 0), fixed.get("bf16_last_layers", 0), config
        )
        edge_re = re.compile(rf"layers/({'|'.join(map(str, layers))})/.*") if layers else None
        by_format = {
            f: _tensor_bytes(context, {**fixed, **{n: f for n in group_names}, **ref_kv})
            for f in formats
        }
        paths = next(iter(by_format.values()))
        owner: dict[str, str] = {}
        for path in paths:
            if edge_re is not None and edge_re.fullmatch(path):
                continue
            for cls, pat in TENSOR_CLASSES.items():
                if re.fullmatch(pat, path):
                    name = (
                        cls
                        if cls in group_names
                        else (
                            "w.linear"
                            if "w.linear" in group_names and cls not in EMBED_CLASSES
                            else None
                        )
                    )
                    if name is not None:
                        owner[path] = name
                    break
        const = sum(b for p, b in paths.items() if p not in owner)
        groups = []
        for n in group_names:
            mine = [p for p, o in owner.items() if o == n]
            groups.append(tuple(
                knapsack.Option({n: f}, sum(by_format[f][p] for p in mine)) for f in choices[n]
            ))  # fmt: skip
        sections.append(knapsack.Section(fixed, const, tuple(groups)))
    return sections


def _sensitivity_section(context, choices, ref_kv) -> knapsack.Section:
    import re

    order = context.profile.tensor_order
    top = len(order)
    keep = list(choices["sens.keep_bf16"])
    bf16 = _tensor_bytes(context, {"sens.format": choices["sens.format"][0],
                                   "sens.keep_bf16": top, **ref_kv})  # fmt: skip
    options = []
    for f in choices["sens.format"]:
        full = _tensor_bytes(context, {"sens.format": f, "sens.keep_bf16": 0, **ref_kv})
        total = sum(full.values())
        saved = [0]
        for path in order:
            pat = re.compile(re.escape(path))
            delta = sum(bf16[p] - full[p] for p in full if pat.fullmatch(p))
            saved.append(saved[-1] + delta)
        for k in keep:
            options.append(knapsack.Option({"sens.format": f, "sens.keep_bf16": k},
                                           total + saved[min(k, top)]))  # fmt: skip
    return knapsack.Section({}, 0, (tuple(options),))


def _kv_options(context, choices, kv_names, weight_params) -> list[knapsack.KVOption]:
    """One option per distinct KV plan of the space (parameter sets meaning the same plan
    share one), with the static-scale and per-tenant bytes `capacity.budget` counts."""
    import itertools

    from tenantq.quant.plan import QuantPlan
    from tenantq.search.space import KV_BF16_LAYERS, _canonical_kv

    config, profile = context.config, context.profile
    seen: dict[Any, knapsack.KVOption] = {}
    for values in itertools.product(*(list(choices[n]) for n in kv_names)):
        params = dict(zip(kv_names, values, strict=True))
        if "sens.kv_keep_bf16" in params:
            layers = tuple(sorted(profile.kv_layer_order[: params["sens.kv_keep_bf16"]]))
        else:
            layers = KV_BF16_LAYERS[params.get("kv.bf16_layers", "none")]
        kv = _canonical_kv(params, layers, config)
        if kv in seen:
            continue
        seen[kv] = knapsack.KVOption(params, *_kv_bytes(context, QuantPlan(kv=kv)))
    return list(seen.values())


def _kv_bytes(context, plan) -> tuple[int, int]:
    """(static-scale bytes, bytes per tenant) per chip of `plan`'s KV, by the functions
    `capacity.budget` counts them with (`kv_storage`, `tenant_pages`, `pool_bytes_from_layers`),
    without its longest-context search."""
    from tenantq.capacity.kv import pool_bytes_from_layers, tenant_pages
    from tenantq.storage.kv import kv_storage
    from tenantq.storage.pool import kv_sums

    dep = context.deployment
    layers = kv_storage(context.capacity_config, plan, dep.page_tokens, dep.chips)
    pages = tenant_pages(
        context.capacity_config, context.spec.deployment.context_tokens, dep.page_tokens
    )
    tenant = pool_bytes_from_layers(layers, pages, 1)
    return kv_sums(layers).static_bytes, tenant["total_bytes"] - tenant["static_bytes"]
