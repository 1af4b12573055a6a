"""The capacity-aware sampler: spend quality evaluations only where they can move the front.

Capacity is exact and costs about a millisecond, quality costs seconds, and generic samplers
ignore that asymmetry. This Optuna sampler knows every candidate plan of a finite space and its
tenant count up front. It measures the most precise plan first, then predicts quality
additively from what has been measured (the reference's loss plus a non-negative fitted loss
per parameter value that departs from it; a value never measured is predicted free, i.e.
optimistically), and each trial goes to the unmeasured plan whose predicted loss improves most
on the best measured loss at its tenant count or above. A plan whose
tenants and prediction cannot improve the front is never chosen while one that can remains.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from optuna.distributions import CategoricalDistribution
from optuna.samplers import BaseSampler, RandomSampler
from optuna.trial import TrialState

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
    ):
        if not candidates:
            raise ValueError("capacity_aware sampler: the space has no candidate plans")
        self.candidates = list(candidates)
        self.quality_index = quality_index
        self.quality_sign = quality_sign
        self._by_params = {_params_key(c.params): c for c in self.candidates}
        self._space = {
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
        pending: set[str] = set()
        for t in study.get_trials(deepcopy=False):
            c = self._by_params.get(_params_key(t.params))
            if c is None:
                continue
            if t.state == TrialState.COMPLETE and t.values is not None:
                loss = self.quality_sign * t.values[self.quality_index]
                measured[c.key] = min(loss, measured.get(c.key, math.inf))
            elif t.state in (TrialState.RUNNING, TrialState.WAITING) and t.number != trial.number:
                pending.add(c.key)
        pick = choose(self.candidates, measured, pending)
        if pick is None:  # everything measured or in flight: any plan (answered from the study)
            return {}
        return {k: v for k, v in pick.params.items() if k in search_space}

    def sample_independent(self, study, trial, param_name, param_distribution) -> Any:
        return self._fallback.sample_independent(study, trial, param_name, param_distribution)


def _params_key(params: dict[str, Any]) -> tuple:
    return tuple(sorted(params.items(), key=lambda kv: kv[0]))


MAX_CANDIDATES = 5000  # plans enumerated at ~1 ms each (plan + budget): a few seconds at most


def sampler_for_spec(spec) -> CapacityAwareSampler:
    """The sampler for a study spec: every plan of its space with its exact tenants on the
    spec's deployment, built by the driver's own `prepare`, `plan_from_params` and `budget`."""
    import itertools

    from tenantq.capacity import budget
    from tenantq.search.driver import prepare
    from tenantq.search.space import parameter_choices, plan_from_params
    from tenantq.search.spec import CAPACITY_METRIC

    quality = [i for i, o in enumerate(spec.objectives) if o.metric != CAPACITY_METRIC]
    if not quality:
        raise ValueError(
            "sampler.kind = 'capacity_aware' needs a quality objective besides 'tenants'"
        )
    prep = prepare(spec, "")
    choices = parameter_choices(spec.space, prep.config, prep.profile)
    size = math.prod(len(v) for v in choices.values())
    if size > MAX_CANDIDATES:
        raise ValueError(
            f"sampler.kind = 'capacity_aware' enumerates the space, which has {size} plans "
            f"(at most {MAX_CANDIDATES}); narrow the space's choices or use 'nsga2'"
        )
    candidates = []
    for values in itertools.product(*(list(v) for v in choices.values())):
        params = dict(zip(choices, values, strict=True))
        plan = plan_from_params(
            spec.space, params, prep.config,
            algorithm=spec.calibration.algorithm, profile=prep.profile,
        )  # fmt: skip
        b = budget(prep.capacity_config, plan, prep.deployment, spec.deployment.context_tokens)
        candidates.append(Candidate(params, b.tenants, plan.fingerprint()))
    first = quality[0]
    sign = 1.0 if spec.objectives[first].direction == "minimize" else -1.0
    return CapacityAwareSampler(
        candidates, quality_index=first, quality_sign=sign, seed=spec.sampler.seed
    )
