"""The knapsack sampler's next plan (tenantq.search.capacity_aware.KnapsackSampler) against
brute force over every plan of a small synthetic space.

The space is a `knapsack.Problem` written here (two sections, 3 weight groups, 2-3 KV plans;
no model, no spec), its plans located by a function written here (each parameter set its own
plan; tenants by the pool formula, or min of that and a synthetic service level). The study
holds measured plans (synthetic losses), plans in flight and failed ones. The reference is
the documented rule, applied to every plan the study does not hold: predicted loss = the
reference plan's loss + the quality model's planning loss (`Fit.lcb`) of each value where the
plan differs from the reference + its pairwise terms; gain = (best measured loss at >= the
plan's tenants - predicted) / the range of the known losses, infinite where none is measured;
the largest gain wins, ties (gains to 1e-9) to more tenants, then to the lower prediction.
The quality model is the one the sampler fits (`quality_model.fit`, judged by its own target);
what is judged here is the choice, which must be the brute-force best: by enumeration (spaces
up to ENUMERATE_LIMIT plans) and by the DP (the limit set to 0) alike.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial

# imported at collection (~8 s with what it imports), not in a test: mutmut's runs fork after it
from tenantq.evals import profile
from tenantq.search import capacity_aware, knapsack, quality_model
from tenantq.search.capacity_aware import KnapsackSampler
from tenantq.search.context import study_context
from tenantq.search.spec import parse_spec

optuna.logging.set_verbosity(optuna.logging.WARNING)

FORMATS = ("bf16", "int8", "int4")
KV_FORMATS = ("bf16", "int8", "int4")


def _problem(seed: int, n_kv: int = 3) -> knapsack.Problem:
    """Two sections (edge 0/1: different constant bytes), groups w.a, w.b, w.c over FORMATS
    (bytes falling with the format), KV plans over kv.k."""
    rng = np.random.default_rng(seed)
    sections = []
    for edge in (0, 1):
        groups = []
        for name in ("w.a", "w.b", "w.c"):
            full = int(rng.integers(20, 60)) * 1000
            groups.append(
                tuple(knapsack.Option({name: f}, full // (1 + i)) for i, f in enumerate(FORMATS))
            )
        sections.append(knapsack.Section({"edge": edge}, 10_000 + 15_000 * edge, tuple(groups)))
    kv = tuple(
        knapsack.KVOption({"kv.k": f}, 500 * i, 4000 // (1 + i))
        for i, f in enumerate(KV_FORMATS[:n_kv])
    )
    return knapsack.Problem(tuple(sections), kv, 260_000, 6_000)


def _plans(problem):
    """Every parameter set of the space with its weight bytes and KV plan."""
    for sec in problem.sections:
        for opts in itertools.product(*sec.groups):
            for kv in problem.kv:
                params = {**sec.params, **kv.params}
                for o in opts:
                    params.update(o.params)
                yield params, sec.const_bytes + sum(o.bytes for o in opts), kv


def _key(params) -> str:
    return repr(sorted(params.items()))


def _slo(params) -> int:
    """A synthetic service level: fewer tenants the more bf16 (slower) the plan is."""
    return 30 - 4 * sum(v == "bf16" for v in params.values()) - 3 * params["edge"]


class Space:
    def __init__(self, seed, slo=False, n_kv=3):
        self.problem = _problem(seed, n_kv)
        self.plans = {_key(p): (p, b, kv) for p, b, kv in _plans(self.problem)}
        self.slo = slo
        self.dists = {
            "edge": CategoricalDistribution([0, 1]),
            **{n: CategoricalDistribution(list(FORMATS)) for n in ("w.a", "w.b", "w.c")},
            "kv.k": CategoricalDistribution(list(KV_FORMATS[:n_kv])),
        }

    def tenants(self, params) -> int:
        if _key(params) not in self.plans:
            raise ValueError(f"no plan: {params}")  # as the planner refuses parameters
        _, b, kv = self.plans[_key(params)]
        left = self.problem.hbm_bytes - b - self.problem.reserve_bytes - kv.static_bytes
        memory = left // kv.tenant_bytes if left > 0 else 0
        return min(memory, _slo(params)) if self.slo else memory

    def locate(self, params):
        return _key(params), self.tenants(params)


def _loss(params, seed) -> float:
    """Synthetic additive loss with one weight x KV interaction."""
    rng = np.random.default_rng(1000 + seed)
    cost = {f: {v: float(rng.uniform(0, 0.01)) * (v != "bf16") for v in FORMATS}
            for f in ("w.a", "w.b", "w.c", "kv.k")}  # fmt: skip
    out = sum(cost[k][v] for k, v in params.items() if k in cost) + 0.002 * params["edge"]
    return out + 0.004 * (params["w.a"] == "int4" and params["kv.k"] == "int4")


def _study(space, sampler, seed, n_measured, *, running=0, failed=0, two=False, ref_failed=False):
    """A study holding the reference and n_measured - 1 other plans measured, `running` in
    flight (with a prediction stored) and `failed` failed: every other one by its own error
    (settled), the others by one worker death (open again under a failure budget of 2)."""
    rng = np.random.default_rng(seed)
    study = optuna.create_study(directions=["maximize", "minimize"] + ["minimize"] * two,
                                sampler=sampler)  # fmt: skip
    keys = sorted(space.plans)
    order = [_key(sampler.reference)] + [
        k for k in rng.permutation(keys).tolist() if k != _key(sampler.reference)
    ]
    if ref_failed:  # the reference failed by its own error; n_measured others measured
        study.add_trial(create_trial(
            params=sampler.reference, distributions=space.dists, state=TrialState.FAIL,
            user_attrs={"failure_reason": "error", "dispatched_trial": 0},
        ))  # fmt: skip
        order = order[1:]
    for k in order[:n_measured]:
        params = space.plans[k][0]
        values = [space.tenants(params), _loss(params, seed)]
        if two:
            values.append(_loss(params, seed + 7) + 0.01 * (params["kv.k"] != "bf16"))
        study.add_trial(create_trial(params=params, distributions=space.dists, values=values))
    for k in order[n_measured : n_measured + running]:
        study.add_trial(create_trial(
            params=space.plans[k][0], distributions=space.dists, state=TrialState.RUNNING,
            system_attrs={quality_model.PREDICTED_ATTR: {"1": _loss(space.plans[k][0], seed)}},
        ))  # fmt: skip
    start = n_measured + running
    for i, k in enumerate(order[start : start + failed]):
        # alternately the plan's own error (settled) and one worker death (budget 2: retried)
        reason = "error" if i % 2 == 0 else "worker_died"
        study.add_trial(
            create_trial(
                params=space.plans[k][0],
                distributions=space.dists,
                state=TrialState.FAIL,
                user_attrs={"failure_reason": reason, "dispatched_trial": len(study.trials)},
            )
        )
    return study


def _features(params, reference):
    return tuple((k, params[k]) for k in sorted(params) if reference[k] != params[k])


def _brute_force(space, study, sampler, quality, prior=None, seed=0):
    """The documented rule over every plan the study does not hold: the best key
    (gain, tenants, -prediction) and the keys of every plan."""
    reference = sampler.reference
    kv_names = {"kv.k"}
    measured, held, believed = {}, set(), {}
    for t in study.get_trials(deepcopy=False):
        if t.state == TrialState.RUNNING and not t.params:
            continue  # the trial being asked
        k = _key(t.params or t.system_attrs["fixed_params"])  # enqueued: no params yet
        if k not in space.plans:
            continue  # another space's trial, or parameters that make no plan
        if t.state == TrialState.COMPLETE:
            losses = [sign * t.values[i] for i, sign in quality]
            if not all(math.isfinite(x) for x in losses):
                held.add(k)  # a non-finite measurement: held, neither measured nor incumbent
            elif k not in measured or losses[0] < measured[k][0]:
                measured[k] = losses  # measured twice: the better (first objective) counts
        elif t.state == TrialState.FAIL:
            if t.user_attrs["failure_reason"] == "error":
                held.add(k)  # settled by its own failure; one worker death leaves it open
        else:
            held.add(k)
            if t.state == TrialState.RUNNING:
                pred = t.system_attrs[quality_model.PREDICTED_ATTR]
                believed[k] = [sign * pred[str(i)] for i, sign in quality]
    ref = _key(reference)
    rows = [_features(space.plans[k][0], reference) for k in measured if k != ref]
    # the base: the reference's loss; the least measured one when the reference failed
    base = [
        measured[ref][j] if ref in measured else min((v[j] for v in measured.values()), default=0.0)
        for j in range(len(quality))
    ]
    fits = [
        quality_model.fit(rows, [measured[k][j] for k in measured if k != ref],
                          base[j], prior or {}, is_kv=lambda f: f[0] in kv_names)
        for j in range(len(quality))
    ]  # fmt: skip
    if len(quality) == 1:
        lam = [1.0]
    else:  # drawn from (the seed, measured plans), each objective scaled by its range
        lam = np.random.default_rng([seed, len(measured)]).dirichlet(np.ones(len(quality)))
        spans = [max(v[j] for v in measured.values()) - min(v[j] for v in measured.values())
                 for j in range(len(quality))]  # fmt: skip
        lam = [lam[j] / max(spans[j], 1e-12) for j in range(len(quality))]
    known = [(space.tenants(space.plans[k][0]), sum(l * x for l, x in zip(lam, v, strict=True)))
             for k, v in measured.items()]  # fmt: skip
    known += [(space.tenants(space.plans[k][0]), sum(l * x for l, x in zip(lam, v, strict=True)))
              for k, v in believed.items()]  # fmt: skip
    span = max(v for _, v in known) - min(v for _, v in known) if known else 0.0
    if span <= 0:  # one loss known, or all equal: the largest predicted excess of a value
        span = max((lam[j] * fit.weight(f) for j, fit in enumerate(fits)
                    for f in (*fit.prior, *fit.weights)), default=0.0)  # fmt: skip
        span = span if span > 0 else 1.0
    keys, _preds = {}, {}
    for k, (params, _, _) in space.plans.items():
        if k in measured or k in held:
            continue
        feats = _features(params, reference)
        kv = [f for f in feats if f[0] in kv_names]
        pred, per = 0.0, []
        for j, fit in enumerate(fits):
            pj = base[j] + sum(fit.lcb(f) for f in feats)
            pj += sum(fit.pair(f, g) for f in feats for g in kv)
            pred += lam[j] * pj
            per.append(pj)
        t = space.tenants(params)
        inc = min((v for tt, v in known if tt >= t), default=math.inf)
        gain = math.inf if math.isinf(inc) else round((inc - pred) / span, 9)
        keys[k] = (gain, t, -round(pred / span, 9))
        _preds[k] = (per, pred, span)
    _brute_force.predictions = _preds  # per plan: (prediction per objective, scalarised, span)
    return max(keys.values()), keys


def _sampler(space, prior=None, quality=((1, 1.0),), seed=0):
    return KnapsackSampler(
        space.problem,
        failure_budget=2, quality=list(quality), locate=space.locate, distributions=space.dists,
        prior=prior, seed=seed,
    )  # fmt: skip


def _check(space, sampler, study, quality=((1, 1.0),), prior=None, seed=0):
    best, keys = _brute_force(space, study, sampler, list(quality), prior, seed)
    trial = study.ask()
    params = {n: trial.suggest_categorical(n, d.choices) for n, d in space.dists.items()}
    pick = sampler.last_pick
    assert pick["reason"] == "knapsack", pick
    k = _key(params)
    assert k in keys, "the pick is a plan the study holds"
    assert pick["tenants"] == space.tenants(params)
    # the pick is the best plan: same gain (to 1e-9 of the range), tenants, prediction
    got = keys[k]
    assert got[:2] == best[:2] and got[2] == pytest.approx(best[2], abs=1e-8), (got, best)
    # what the sampler reports: its gain, level and prediction, and the prediction per
    # objective stored on the trial (in the objective's own sign)
    per, pred, span = _brute_force.predictions[k]
    assert pick["gain"] == pytest.approx(got[0], abs=1e-8)
    assert pick["predicted"] == pytest.approx(pred, abs=1e-8 * span)
    assert pick["level"] <= pick["tenants"]
    stored = study.trials[-1].system_attrs[quality_model.PREDICTED_ATTR]
    assert stored.keys() == {str(i) for i, _ in quality}
    for (i, sign), pj in zip(quality, per, strict=True):
        assert stored[str(i)] == pytest.approx(sign * pj, rel=1e-9, abs=1e-12)
    return params


# ------------------------------------------------------------------------ one quality objective
CASES = [(seed, n) for seed in range(5) for n in (2, 6, 15)]


@pytest.mark.parametrize("limit", [capacity_aware.ENUMERATE_LIMIT, 0], ids=["enumerate", "dp"])
@pytest.mark.parametrize(("seed", "n"), CASES)
def test_the_pick_is_the_brute_force_best_plan(monkeypatch, limit, seed, n):
    monkeypatch.setattr(capacity_aware, "ENUMERATE_LIMIT", limit)
    space = Space(seed)
    sampler = _sampler(space)
    _check(space, sampler, _study(space, sampler, seed, n))


@pytest.mark.parametrize("limit", [capacity_aware.ENUMERATE_LIMIT, 0], ids=["enumerate", "dp"])
@pytest.mark.parametrize("seed", range(3))
def test_plans_in_flight_and_failed_are_skipped_and_in_flight_ones_count_as_predicted(
    monkeypatch, limit, seed
):
    monkeypatch.setattr(capacity_aware, "ENUMERATE_LIMIT", limit)
    space = Space(seed)
    sampler = _sampler(space)
    _check(space, sampler, _study(space, sampler, seed, 8, running=3, failed=3))


@pytest.mark.parametrize("limit", [capacity_aware.ENUMERATE_LIMIT, 0], ids=["enumerate", "dp"])
@pytest.mark.parametrize("seed", range(3))
def test_a_prior_moves_the_pick_as_the_model_predicts(monkeypatch, limit, seed):
    monkeypatch.setattr(capacity_aware, "ENUMERATE_LIMIT", limit)
    space = Space(seed)
    prior = {("w.a", "int4"): 0.02, ("w.b", "int8"): 0.001, ("w.c", "int4"): 0.0005,
             ("kv.k", "int4"): 0.01}  # fmt: skip
    sampler = _sampler(space, prior=prior)
    _check(space, sampler, _study(space, sampler, seed, 5), prior=prior)


@pytest.mark.parametrize("limit", [capacity_aware.ENUMERATE_LIMIT, 0], ids=["enumerate", "dp"])
@pytest.mark.parametrize("seed", range(3))
def test_two_quality_objectives_are_scalarised_by_the_seeds_weights(monkeypatch, limit, seed):
    monkeypatch.setattr(capacity_aware, "ENUMERATE_LIMIT", limit)
    space = Space(seed)
    quality = ((1, 1.0), (2, -1.0))
    sampler = _sampler(space, quality=quality, seed=seed + 3)
    study = _study(space, sampler, seed, 9, two=True)
    _check(space, sampler, study, quality=quality, seed=seed + 3)


def _locate_all(space, sampler):
    """Every plan located, as earlier asks would have (a re-rank of those costs nothing)."""
    for params, _, _ in space.plans.values():
        sampler.locate(params)


@pytest.mark.parametrize("limit", [capacity_aware.ENUMERATE_LIMIT, 0], ids=["enumerate", "dp"])
@pytest.mark.parametrize("seed", range(6))
def test_under_a_service_level_a_located_space_is_walked_to_the_brute_force_best(
    monkeypatch, limit, seed
):
    # Tenants = min(memory, a service level): the walk's levels are tenants by memory (upper
    # bounds) and each plan is re-ranked at its exact capacity before it is taken, so once
    # every plan is located (no MAX_RERANKS cut) the best-first walk ends at the brute-force
    # best. The DP offers one plan at many memory levels: before the fix its stale entry at a
    # lower level than the one re-ranked was taken as the re-ranked one (credited with an
    # infinite gain at a level far above its capacity): 0 of these 6 picks were the best.
    monkeypatch.setattr(capacity_aware, "ENUMERATE_LIMIT", limit)
    space = Space(seed, slo=True)
    sampler = _sampler(space)
    study = _study(space, sampler, seed, 6)
    _locate_all(space, sampler)
    _check(space, sampler, study)
    assert sampler.last_pick["level"] <= sampler.last_pick["tenants"]


@pytest.mark.parametrize("limit", [capacity_aware.ENUMERATE_LIMIT, 0], ids=["enumerate", "dp"])
@pytest.mark.parametrize("seed", range(3))
def test_under_a_service_level_an_ask_locates_at_most_max_reranks_new_plans(
    monkeypatch, limit, seed
):
    # Where the service level binds every memory level sits above its plans' capacity; the
    # walk locates at most MAX_RERANKS plans anew (then the pick's own location) and takes the
    # best of those re-ranked: the best among the plans it located, not always the
    # brute-force best (docs/guide/capacity-aware.md, "Tenants at a service level").
    monkeypatch.setattr(capacity_aware, "ENUMERATE_LIMIT", limit)
    space = Space(seed, slo=True)
    sampler = _sampler(space)
    study = _study(space, sampler, seed, 6)
    _, keys = _brute_force(space, study, sampler, [(1, 1.0)])
    located = []
    sampler._locate_fn = lambda params: located.append(_key(params)) or space.locate(params)
    trial = study.ask()
    params = {n: trial.suggest_categorical(n, d.choices) for n, d in space.dists.items()}
    fresh = [k for k in located if k in keys]  # the walk's plans (not the study's own)
    assert len(fresh) == capacity_aware.MAX_RERANKS
    pick = sampler.last_pick
    assert pick["tenants"] == space.tenants(params) and pick["level"] == pick["tenants"]
    assert keys[_key(params)] == max(keys[k] for k in fresh)


def test_a_plan_failed_once_by_its_worker_is_open_and_one_failed_by_its_error_is_not():
    # the failure budget (2 here): the reference failed by a worker death is asked again; by
    # its own error it is settled, and the next ask is the brute-force best of the rest
    for reason, again in (("worker_died", True), ("error", False)):
        space = Space(0)
        sampler = _sampler(space)
        study = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)
        study.add_trial(
            create_trial(
                params=sampler.reference,
                distributions=space.dists,
                state=TrialState.FAIL,
                user_attrs={"failure_reason": reason, "dispatched_trial": 0},
            )
        )
        trial = study.ask()
        params = {n: trial.suggest_categorical(n, d.choices) for n, d in space.dists.items()}
        assert (params == sampler.reference) is again, reason
        assert sampler.last_pick["reason"] == ("reference" if again else "knapsack")


# ------------------------------------------------------------- the space's reference and prior
def test_the_reference_is_the_heaviest_section_options_and_kv_plan():
    # the most precise plan: the section and options with the most weight bytes, the KV plan
    # with the most bytes per tenant (then static bytes); by brute force over every plan's
    # bytes, with the options and KV plans in their order and reversed
    for seed in range(5):
        for flip in (False, True):
            space = Space(seed)
            if flip:
                space.problem = knapsack.Problem(
                    tuple(knapsack.Section(s.params, s.const_bytes,
                                           tuple(g[::-1] for g in s.groups))
                          for s in space.problem.sections[::-1]),
                    space.problem.kv[::-1], space.problem.hbm_bytes, space.problem.reserve_bytes,
                )  # fmt: skip
            heaviest = max(space.plans.values(), key=lambda p: (p[1], p[2].tenant_bytes))
            assert _sampler(space).reference == heaviest[0]
    # equal bytes per tenant: the KV plan with more static bytes
    kv = (knapsack.KVOption({"kv.k": "bf16"}, 0, 100), knapsack.KVOption({"kv.k": "int8"}, 5, 100))
    sec = knapsack.Section({}, 0, ((knapsack.Option({"w.a": "bf16"}, 10),),))
    assert capacity_aware._reference(knapsack.Problem((sec,), kv, 10**6, 0))["kv.k"] == "int8"


def test_the_profile_prior_is_the_largest_finite_kl_per_tensor_and_format(monkeypatch):
    import types

    import pyarrow as pa

    rows = {
        "tensor": ["a", "a", "a", "b", "c", "d", "b", "c"],
        "format": ["int4", "int4", "int8", "int4", "int4", "int4", "int8", "int8"],
        "kl_mean": [0.1, 0.3, 0.02, None, 0.5, 0.7, float("nan"), float("inf")],
    }
    read = []
    monkeypatch.setattr(profile, "read_profile_table", lambda p: read.append(p) or pa.table(rows))
    path = "profile.parquet"
    choices = {"w.a": ("int4", "int8"), "w.b": ("int4",), "w.c": ("int4",), "kv.k": ("bf16",)}
    space = types.SimpleNamespace(kind="per_tensor", profile=str(path))
    # a: the larger of its two int4 rows; no KL (None, nan, inf) dropped; d: no parameter
    assert capacity_aware.profile_prior(space, choices) == {
        ("w.a", "int4"): 0.3,
        ("w.a", "int8"): 0.02,
        ("w.c", "int4"): 0.5,
    }
    assert read == [path]
    assert capacity_aware.profile_prior(types.SimpleNamespace(kind="per_tensor", profile=None),
                                        choices) == {}  # fmt: skip
    structured = types.SimpleNamespace(kind="structured", profile=str(path))
    assert capacity_aware.profile_prior(structured, choices) == {}


def test_a_spec_without_a_quality_objective_is_refused():
    import types

    objective = types.SimpleNamespace
    spec = types.SimpleNamespace(objectives=[objective(metric="tenants")])
    with pytest.raises(ValueError) as err:
        capacity_aware.sampler_for_spec(spec)
    assert str(err.value) == (
        "sampler.kind = 'capacity_aware' needs a quality objective besides the capacity "
        "(tenants or tenants_at_slo)"
    )
    both = types.SimpleNamespace(
        objectives=[objective(metric="tenants"), objective(metric="fidelity.kl_mean"),
                    objective(metric="tenants_at_slo"), objective(metric="needle.acc")]
    )  # fmt: skip
    assert capacity_aware._check_quality(both) == [1, 3]


def test_a_knapsack_sampler_needs_a_quality_objective():
    space = Space(0)
    with pytest.raises(ValueError, match="no quality objective"):
        KnapsackSampler(space.problem, quality=[], locate=space.locate, distributions=space.dists)


# ------------------------------------------------------------------ the enumerating form
def _candidates(seed):
    rng = np.random.default_rng(500 + seed)
    out = []
    for i, combo in enumerate(itertools.product(FORMATS, FORMATS, ("bf16", "int4"))):
        params = dict(zip(("w.a", "w.b", "kv.k"), combo, strict=True))
        tenants = 10 + 3 * sum(v != "bf16" for v in combo) + int(rng.integers(0, 3))
        out.append(capacity_aware.Candidate(params, tenants, f"p{i}"))
    return out


def _choose_by_brute_force(candidates, measured, exclude):
    """`choose`'s documented rule written out over the candidates."""
    reference = min(candidates, key=lambda c: c.tenants)
    if reference.key not in measured and reference.key not in exclude:
        return reference
    base = measured.get(reference.key, 0.0)

    def dev(c):
        return tuple(sorted((k, v) for k, v in c.params.items() if reference.params[k] != v))

    seen = [c for c in candidates if c.key in measured and c.key != reference.key]
    fit = capacity_aware.additive_fit(
        [dev(c) for c in seen], [measured[c.key] - base for c in seen]
    )
    best = None
    for i, c in enumerate(candidates):
        if c.key in measured or c.key in exclude:
            continue
        pred = base + sum(fit.get(f, 0.0) for f in dev(c))
        inc = min((measured[s.key] for s in candidates
                   if s.key in measured and s.tenants >= c.tenants), default=math.inf)  # fmt: skip
        gain = math.inf if inc == math.inf else (
            (inc - pred) / inc if inc > 0 else inc - pred
        )  # fmt: skip
        key = (gain, c.tenants, -i)
        if best is None or key > best[0]:
            best = (key, c)
    return None if best is None else best[1]


@pytest.mark.parametrize("offset", [0.0, -1.0])
@pytest.mark.parametrize("seed", range(4))
def test_choose_is_the_brute_force_best_candidate(seed, offset):
    # offset -1: every loss negative, the absolute gain (incumbent - predicted) decides
    candidates = _candidates(seed)
    rng = np.random.default_rng(seed)
    reference = min(candidates, key=lambda c: c.tenants)
    assert capacity_aware.choose(candidates, {}) is reference  # measured first
    assert capacity_aware.choose(candidates, {}, {reference.key}) is not reference
    keys = rng.permutation([c.key for c in candidates if c is not reference]).tolist()
    by_key = {c.key: c for c in candidates}

    def loss(c):
        return (
            offset
            + 0.01 * sum(v == "int4" for v in c.params.values())
            + 0.003 * sum(v == "int8" for v in c.params.values())
        )

    for n in (1, 4, 9):
        measured = {reference.key: loss(reference)}
        measured.update({k: loss(by_key[k]) for k in keys[:n]})
        exclude = set(keys[n : n + 2])
        got = capacity_aware.choose(candidates, measured, exclude)
        assert got is _choose_by_brute_force(candidates, measured, exclude), n
        # the reference excluded (failed) and not measured: predictions start from 0
        del measured[reference.key]
        exclude.add(reference.key)
        got = capacity_aware.choose(candidates, measured, exclude)
        assert got is _choose_by_brute_force(candidates, measured, exclude), n
    every = {c.key: loss(c) for c in candidates}
    assert capacity_aware.choose(candidates, every) is None


def test_additive_fit_recovers_additive_non_negative_costs():
    # loss = sum of the plan's values' costs (one of them 0): NNLS with a ridge of 1e-3 of
    # the largest loss recovers each within 1% of the largest loss; unseen values are absent
    costs = {("a", 1): 0.2, ("a", 2): 0.5, ("b", 1): 0.0, ("c", 1): 0.1}
    feats = list(costs)
    rows = [r for n in (1, 2, 3) for r in itertools.combinations(feats, n)]
    losses = [sum(costs[f] for f in r) for r in rows]
    fit = capacity_aware.additive_fit(rows, losses)
    assert set(fit) == set(costs)
    for f, c in costs.items():
        assert fit[f] == pytest.approx(c, abs=0.01 * max(losses))
    assert all(v >= 0 for v in fit.values())
    assert capacity_aware.additive_fit([], []) == {}
    assert capacity_aware.additive_fit([()], [0.3]) == {}
    # a value that only lowers the loss is fitted 0, not negative
    neg = capacity_aware.additive_fit([(("a", 1),), (("a", 1), ("d", 1))], [0.4, 0.1])
    assert neg[("d", 1)] == 0.0


def test_additive_fit_is_the_ridge_nnls_optimum():
    # The fit minimises |X w - y|^2 + RIDGE |w|^2 over w >= 0 (NNLS on the losses scaled to
    # their largest, a scale the minimiser does not depend on): checked by its optimality
    # conditions, gradient 0 where w > 0 and >= 0 where w = 0, on random plans and losses
    rng = np.random.default_rng(3)
    feats = [(f"t{i}", "int4") for i in range(6)]
    for trial in range(4):
        rows = [tuple(f for f in feats if rng.random() < 0.5) for _ in range(9)]
        y = rng.uniform(-0.2, 1.0, len(rows)) * 10.0**trial
        fit = capacity_aware.additive_fit(rows, y.tolist())
        names = sorted(fit, key=repr)
        assert set(names) == {f for r in rows for f in r}
        x = np.array([[float(f in r) for f in names] for r in rows])
        w = np.array([fit[f] for f in names])
        grad = 2 * x.T @ (x @ w - y) + 2 * capacity_aware.RIDGE * w
        scale = np.abs(y).max()
        assert np.all(w >= 0)
        tol = 1e-6 * scale
        assert np.all(np.abs(grad[w > tol]) < tol * 10) and np.all(grad[w <= tol] > -tol * 10)
    # losses all 0: every value 0 (no division by a zero scale)
    assert capacity_aware.additive_fit([(feats[0],), (feats[1],)], [0.0, 0.0]) == {
        feats[0]: 0.0,
        feats[1]: 0.0,
    }


def test_the_enumerating_sampler_skips_other_plans_and_may_propose_a_pruned_one_again():
    # a trial of parameters no candidate has is read past; a PRUNED trial holds nothing
    candidates = _candidates(1)
    names = ("w.a", "w.b", "kv.k")
    dists = {
        n: CategoricalDistribution(list(dict.fromkeys(c.params[n] for c in candidates)))
        for n in names
    }
    sampler = capacity_aware.CapacityAwareSampler(candidates, quality_index=1, seed=0)
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)
    other = {"w.a": "bf16", "w.b": "bf16", "kv.k": "int8"}
    study.add_trial(
        create_trial(
            params=other,
            values=[1, 0.0],
            distributions={**dists, "kv.k": CategoricalDistribution(["int8"])},
        )
    )
    reference = min(candidates, key=lambda c: c.tenants)
    measured = {reference.key: 0.02, candidates[4].key: 0.01}
    for c, v in ((reference, 0.02), (candidates[4], 0.01)):
        study.add_trial(create_trial(params=c.params, distributions=dists, values=[c.tenants, v]))
    expected = capacity_aware.choose(candidates, measured, set())
    study.add_trial(create_trial(params=expected.params, distributions=dists,
                                 state=TrialState.PRUNED))  # fmt: skip
    trial = study.ask()
    assert {n: trial.suggest_categorical(n, dists[n].choices) for n in names} == expected.params


def test_the_enumerating_sampler_reads_the_study_as_choose_does():
    # quality maximized (sign -1); a plan measured twice keeps its best loss; a plan in
    # flight and one failed by its own error are not proposed; one worker death is retried
    candidates = _candidates(0)
    names = ("w.a", "w.b", "kv.k")
    dists = {
        n: CategoricalDistribution(list(dict.fromkeys(c.params[n] for c in candidates)))
        for n in names
    }
    sampler = capacity_aware.CapacityAwareSampler(
        candidates, quality_index=1, quality_sign=-1.0, seed=0, failure_budget=2
    )
    assert sampler.infer_relative_search_space(None, None) == dists
    study = optuna.create_study(directions=["maximize", "maximize"], sampler=sampler)
    reference = min(candidates, key=lambda c: c.tenants)
    c = candidates

    def add(cand, state=TrialState.COMPLETE, value=None, reason=None):
        attrs = {} if reason is None else {"failure_reason": reason, "dispatched_trial": 0}
        study.add_trial(create_trial(
            params=cand.params, distributions=dists, state=state,
            values=None if value is None else [cand.tenants, value], user_attrs=attrs,
        ))  # fmt: skip

    add(reference, value=-0.01)
    add(c[5], value=-0.2)
    add(c[5], value=-0.05)  # the better of the two counts: loss 0.05
    add(c[7], value=-0.03)
    add(c[9], state=TrialState.RUNNING)
    add(c[11], state=TrialState.FAIL, reason="error")
    add(c[12], state=TrialState.FAIL, reason="worker_died")
    measured = {reference.key: 0.01, c[5].key: 0.05, c[7].key: 0.03}
    expected = capacity_aware.choose(candidates, measured, {c[9].key, c[11].key})
    trial = study.ask()
    got = {n: trial.suggest_categorical(n, dists[n].choices) for n in names}
    assert got == expected.params
    assert sampler.sample_relative(study, trial, {}) == {}


def test_the_sampler_for_a_context_reads_its_spec():
    # the quality objectives and their directions, the failure budget (1 + retries), the
    # seeds (this start's for the fallback, the spec's for the scalarisation's draws)
    raw = {
        "model": "reference",
        "deployment": {"hardware": "cpu", "memory": "9830KiB", "context_tokens": 256},
        "space": {"group_size": 64},
        "objectives": [
            {"metric": "fidelity.kl_mean", "direction": "minimize"},
            {"metric": "tenants", "direction": "maximize"},
            {"metric": "needle.acc_delta.len1019", "direction": "maximize"},
        ],
        "sampler": {"seed": 17},
        "study": {"name": "ctx", "trials": 4, "max_trial_retries": 3},
    }
    ctx = study_context(parse_spec(raw), "")
    sampler = capacity_aware.sampler_for_context(ctx)
    assert sampler.quality == [(0, 1.0), (2, -1.0)]
    assert sampler.failure_budget == 4 and sampler.seed == 17
    assert sampler.prior == {}  # a structured space: no profile prior
    again = capacity_aware.sampler_for_context(ctx, seed=99)
    assert again.seed == 17  # the draws follow the spec's seed whatever this start's
    draws = [s._fallback._rng.rng.random() for s in (sampler, again)]
    assert draws[0] == np.random.RandomState(17).random() != draws[1]
    assert draws[1] == np.random.RandomState(99).random()
    assert sampler.problem == capacity_aware.build_problem(ctx)
    # built from the spec (the study's context made here): the seed given is this start's
    by_spec = capacity_aware.sampler_for_spec(ctx.spec, seed=5)
    assert by_spec._fallback._rng.rng.random() == np.random.RandomState(5).random()
    assert by_spec.seed == 17 and by_spec.problem == sampler.problem
    assert set(sampler._space) == set(sampler.reference)


@pytest.mark.parametrize("limit", [capacity_aware.ENUMERATE_LIMIT, 0], ids=["enumerate", "dp"])
def test_repeats_infinite_losses_and_enqueued_plans_are_read_as_the_rule_says(monkeypatch, limit):
    # a plan measured twice counts at its better loss; a plan measured at an infinite loss is
    # held (neither proposed nor an incumbent); an enqueued plan (WAITING, its parameters
    # only in fixed_params) is held. The trial asked is made by hand so the WAITING one stays.
    monkeypatch.setattr(capacity_aware, "ENUMERATE_LIMIT", limit)
    space = Space(1)
    sampler = _sampler(space)
    study = _study(space, sampler, 1, 6)
    measured = [t for t in study.trials if t.params != sampler.reference]
    again = measured[0]
    study.add_trial(create_trial(params=again.params, distributions=space.dists,
                                 values=[again.values[0], again.values[1] / 4]))  # fmt: skip
    study.add_trial(create_trial(params=measured[1].params, distributions=space.dists,
                                 values=[again.values[0], again.values[1] + 1.0]))  # fmt: skip
    _, keys = _brute_force(space, study, sampler, [(1, 1.0)])
    top = max(keys, key=keys.get)
    study.add_trial(create_trial(params=space.plans[top][0], distributions=space.dists,
                                 values=[1, math.inf]))  # fmt: skip
    _check(space, sampler, study)
    best, keys = _brute_force(space, study, sampler, [(1, 1.0)])
    assert top not in keys
    nxt = max(keys, key=keys.get)
    # the trial asked first, then a plan enqueued (another worker): read past the trial asked
    tid = study._storage.create_new_trial(study._study_id)
    study.enqueue_trial(space.plans[nxt][0])
    trial = study._storage.get_trial(tid)
    got = sampler.sample_relative(study, trial, sampler._space)
    best, keys = _brute_force(space, study, sampler, [(1, 1.0)])
    assert nxt not in keys and keys[_key(got)] == best


def test_an_enqueued_trial_keeps_its_own_parameters_and_gets_no_prediction():
    # a baseline or retry (fixed parameters): the sampler does not plan it, so it stores no
    # prediction and leaves its last pick alone
    space = Space(0)
    sampler = _sampler(space)
    assert sampler.last_pick is None
    study = _study(space, sampler, 0, 4)
    plan = next(p for p, _, _ in space.plans.values() if p != sampler.reference)
    study.enqueue_trial(plan)
    trial = study.ask()
    assert {n: trial.suggest_categorical(n, d.choices) for n, d in space.dists.items()} == plan
    assert quality_model.PREDICTED_ATTR not in study.trials[-1].system_attrs
    assert sampler.last_pick is None
    assert sampler.sample_relative(study, trial, {}) == {}


def test_trials_of_another_space_and_failures_that_make_no_plan_are_read_past():
    # first in the study: a trial of another space (other parameters) and a FAIL whose
    # parameters make no plan (the locate function refuses them); the trials after them count
    space = Space(3)
    sampler = _sampler(space)
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)
    study.add_trial(
        create_trial(
            params={"other": 1},
            values=[3, 0.5],
            distributions={"other": optuna.distributions.IntDistribution(0, 2)},
        )
    )
    odd = {**sampler.reference, "kv.k": "fp8"}
    dists = {**space.dists, "kv.k": CategoricalDistribution([*KV_FORMATS, "fp8"])}
    study.add_trial(create_trial(params=odd, distributions=dists, state=TrialState.FAIL,
                                 user_attrs={"failure_reason": "plan"}))  # fmt: skip
    for t in _study(space, sampler, 3, 6, running=2, failed=2).trials:
        study.add_trial(t)
    _check(space, sampler, study)


def test_a_retry_copy_that_inherited_its_worker_blames_nothing():
    # records before `dispatched_trial`: a driver death counts when the trial ran its plan (a
    # `worker` of its own); a retry copy that inherited the `worker` of the trial it copies
    # (Optuna's retry callback copies every attribute) did not run it. One count of 2: the
    # reference is asked again (read with the study's trials by number, as the ledger does)
    space = Space(0)
    sampler = _sampler(space)
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)
    attrs = {"failure_reason": "driver_died", "worker": "w1"}
    study.add_trial(create_trial(params=sampler.reference, distributions=space.dists,
                                 state=TrialState.FAIL, user_attrs=attrs))  # fmt: skip
    study.add_trial(create_trial(params=sampler.reference, distributions=space.dists,
                                 state=TrialState.FAIL, user_attrs=attrs,
                                 system_attrs={"failed_trial": 0}))  # fmt: skip
    trial = study.ask()
    params = {n: trial.suggest_categorical(n, d.choices) for n, d in space.dists.items()}
    assert params == sampler.reference
    assert sampler.last_pick == {"reason": "reference", "params": sampler.reference}
    # a second trial that ran (its own worker): two counts, the reference is settled
    study.add_trial(
        create_trial(
            params=sampler.reference,
            distributions=space.dists,
            state=TrialState.FAIL,
            user_attrs={"failure_reason": "driver_died", "worker": "w2"},
        )
    )
    trial = study.ask()
    params = {n: trial.suggest_categorical(n, d.choices) for n, d in space.dists.items()}
    assert params != sampler.reference and sampler.last_pick["reason"] == "knapsack"


@pytest.mark.parametrize("limit", [capacity_aware.ENUMERATE_LIMIT, 0], ids=["enumerate", "dp"])
def test_with_every_plan_held_the_ask_falls_back_to_random(monkeypatch, limit):
    monkeypatch.setattr(capacity_aware, "ENUMERATE_LIMIT", limit)
    space = Space(0, n_kv=1)
    sampler = _sampler(space)
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)
    for params, _, _ in space.plans.values():
        study.add_trial(create_trial(params=params, distributions=space.dists,
                                     values=[space.tenants(params), _loss(params, 0)]))  # fmt: skip
    trial = study.ask()
    params = {n: trial.suggest_categorical(n, d.choices) for n, d in space.dists.items()}
    assert sampler.last_pick == {"reason": "random"}
    assert _key(params) in space.plans
    assert quality_model.PREDICTED_ATTR not in study.trials[-1].system_attrs


def test_a_sampler_built_with_defaults():
    # failure budget 1 (a retryable failure settles the plan), the scalarisation's seed 0
    # without a seed, the fallback seeded by `seed`, the weight draws by `weight_seed`
    space = Space(0)
    plain = KnapsackSampler(space.problem, quality=[(1, 1.0)], locate=space.locate,
                            distributions=space.dists)  # fmt: skip
    assert plain.failure_budget == 1 and plain.seed == 0 and plain.prior == {}
    assert plain.last_pick is None
    two = KnapsackSampler(space.problem, quality=[(1, 1.0), (2, 1.0)], locate=space.locate,
                          distributions=space.dists, seed=5, weight_seed=9)  # fmt: skip
    assert two.seed == 9
    assert two._weights(3) == np.random.default_rng([9, 3]).dirichlet(np.ones(2)).tolist()
    assert KnapsackSampler(space.problem, quality=[(1, 1.0), (2, 1.0)], locate=space.locate,
                           distributions=space.dists, seed=5).seed == 5  # fmt: skip
    assert plain._weights(4) == [1.0]
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=plain)
    study.add_trial(
        create_trial(
            params=plain.reference,
            distributions=space.dists,
            state=TrialState.FAIL,
            user_attrs={"failure_reason": "worker_died", "dispatched_trial": 0},
        )
    )
    trial = study.ask()
    params = {n: trial.suggest_categorical(n, d.choices) for n, d in space.dists.items()}
    assert params != plain.reference


@pytest.mark.parametrize("limit", [capacity_aware.ENUMERATE_LIMIT, 0], ids=["enumerate", "dp"])
def test_a_repeat_with_an_equal_first_loss_keeps_the_first_measurement(monkeypatch, limit):
    # two objectives: a plan measured again with the same first loss and another second one
    # keeps its first measurement (only a lower first loss replaces it)
    monkeypatch.setattr(capacity_aware, "ENUMERATE_LIMIT", limit)
    space = Space(2)
    quality = ((1, 1.0), (2, -1.0))
    sampler = _sampler(space, quality=quality, seed=1)
    study = _study(space, sampler, 2, 7, two=True)
    first = [t for t in study.trials if t.params != sampler.reference][0]
    study.add_trial(
        create_trial(
            params=first.params,
            distributions=space.dists,
            values=[first.values[0], first.values[1], first.values[2] - 0.5],
        )
    )
    _check(space, sampler, study, quality=quality, seed=1)


def test_a_parameter_outside_the_space_is_drawn_by_the_seeded_fallback():
    # a parameter the space does not have: the fallback RandomSampler, seeded by the sampler's
    # seed (same seed, same draws); reseed_rng reseeds it (a fresh, unseeded stream)
    draws = []
    for seed, reseed in ((3, False), (3, False), (4, False), (3, True)):
        sampler = _sampler(Space(0), seed=seed)
        study = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)
        trial = study.ask()
        draws.append([trial.suggest_float("extra", 0.0, 1.0)])
        if reseed:
            sampler.reseed_rng()
        draws[-1].append(study.ask().suggest_float("extra", 0.0, 1.0))
    assert draws[0] == draws[1] and draws[2][0] != draws[0][0]
    assert draws[3][0] == draws[0][0] and draws[3][1] != draws[0][1]
    assert all(0.0 <= x <= 1.0 for d in draws for x in d)


@pytest.mark.parametrize("limit", [capacity_aware.ENUMERATE_LIMIT, 0], ids=["enumerate", "dp"])
@pytest.mark.parametrize(("seed", "n"), [(0, 0), (1, 1), (2, 4), (3, 7)])
def test_a_failed_reference_leaves_the_least_measured_loss_as_the_base(monkeypatch, limit, seed, n):
    # the reference failed for good: predictions start from the least measured loss (0 when
    # nothing is measured: every level then has an infinite gain, ties to more tenants)
    monkeypatch.setattr(capacity_aware, "ENUMERATE_LIMIT", limit)
    space = Space(seed)
    sampler = _sampler(space)
    _check(space, sampler, _study(space, sampler, seed, n, ref_failed=True))


@pytest.mark.parametrize("limit", [capacity_aware.ENUMERATE_LIMIT, 0], ids=["enumerate", "dp"])
@pytest.mark.parametrize("prior", [False, True])
def test_with_one_loss_known_gains_are_in_units_of_the_largest_predicted_excess(
    monkeypatch, limit, prior
):
    # the reference and the lightest plan measured at the same loss (no range): the gain's
    # unit is the largest predicted value excess (the prior's, or the fitted ones), 1 if none
    monkeypatch.setattr(capacity_aware, "ENUMERATE_LIMIT", limit)
    space = Space(2)
    prior = (
        {("w.a", "int4"): 0.02, ("w.b", "int8"): 0.004, ("kv.k", "int8"): 0.01} if prior else None
    )
    sampler = _sampler(space, prior=prior)
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)
    lightest = max(space.plans.values(), key=lambda p: space.tenants(p[0]))[0]
    for params in (sampler.reference, lightest):
        study.add_trial(create_trial(params=params, distributions=space.dists,
                                     values=[space.tenants(params), 0.05]))  # fmt: skip
    _check(space, sampler, study, prior=prior)
    assert sampler.last_pick["gain"] != math.inf


# ------------------------------------------------------------- the study's space as a knapsack
SPACE_SPEC = {
    "model": "reference",
    "deployment": {"hardware": "cpu", "memory": "9830KiB", "context_tokens": 256},
    "study": {"name": "space", "trials": 4},
}


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory):
    """A sensitivity profile of the reference model (KL per tensor and format, per KV layer)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ctx = study_context(parse_spec({**SPACE_SPEC, "space": {"group_size": 64}}), "")
    paths = [p for p, i in ctx.config.tensors().items() if i.quantizable]
    rows = {"tensor": [], "format": [], "kl_mean": []}
    for i, p in enumerate(paths):
        for j, f in enumerate(("int4", "int8", "fp8_e4m3")):
            rows["tensor"].append(p)
            rows["format"].append(f)
            rows["kl_mean"].append(0.001 * (1 + (7 * i + j) % 11) / (1 + j))
    for layer in range(ctx.config.num_layers):
        rows["tensor"].append(f"kv/{layer}")
        rows["format"].append("int4")
        rows["kl_mean"].append(0.001 * (layer + 1))
    path = tmp_path_factory.mktemp("profile") / "profile.parquet"
    pq.write_table(pa.table(rows), path)
    return str(path)


@pytest.mark.parametrize("kind", ["structured", "per_tensor", "sensitivity"])
def test_every_option_and_kv_plan_is_priced_as_budget_prices_it(kind, profile_file):
    # The knapsack of the study's space against `capacity.budget` plan by plan: every option
    # of every group of every section (the others at their first option) has the weight bytes
    # budget() counts, and every KV parameter combination is one of the KV options (one per
    # distinct KV plan: same plan fingerprint, same tenants as budget() gives)
    space = {"group_size": 64, "kind": kind}
    if kind == "sensitivity":
        space["profile"] = profile_file
    ctx = study_context(parse_spec({**SPACE_SPEC, "space": space}), "")
    problem = capacity_aware.build_problem(ctx)
    kv0 = problem.kv[0]
    for sec in problem.sections:
        first = [g[0] for g in sec.groups]
        for gi, group in enumerate(sec.groups):
            for option in group:
                opts = first[:gi] + [option] + first[gi + 1 :]
                params = {**sec.params, **kv0.params}
                for o in opts:
                    params.update(o.params)
                _, b = ctx.plan_and_budget(params)
                weights = sec.const_bytes + sum(o.bytes for o in opts)
                assert b.weights_bytes_per_chip == weights, params
                assert problem.tenants(weights, kv0) == b.tenants, params
    from tenantq.search.space import parameter_choices

    choices = parameter_choices(ctx.spec.space, ctx.config, ctx.profile)
    kv_names = [n for n in choices if n.startswith("kv.") or n == "sens.kv_keep_bf16"]
    sec = problem.sections[0]
    weights = {**sec.params}
    for g in sec.groups:
        weights.update(g[0].params)
    weight_bytes = sec.const_bytes + sum(g[0].bytes for g in sec.groups)
    option_of = {}
    for kv in problem.kv:
        plan, _ = ctx.plan_and_budget({**weights, **kv.params})
        option_of[plan.fingerprint()] = kv
    assert len(option_of) == len(problem.kv)  # one option per distinct KV plan
    seen = set()
    for values in itertools.product(*(list(choices[n]) for n in kv_names)):
        plan, b = ctx.plan_and_budget({**weights, **dict(zip(kv_names, values, strict=True))})
        kv = option_of[plan.fingerprint()]
        seen.add(plan.fingerprint())
        assert problem.tenants(weight_bytes, kv) == b.tenants, values
    assert seen == set(option_of)
    assert problem.hbm_bytes == ctx.deployment.hardware.hbm_bytes
    assert problem.reserve_bytes == ctx.deployment.reserve_bytes_per_chip


@pytest.mark.parametrize("limit", [capacity_aware.ENUMERATE_LIMIT, 0], ids=["enumerate", "dp"])
def test_a_walk_cut_at_max_tries_takes_the_best_plan_it_reranked(monkeypatch, limit):
    # Under a binding service level every plan the walk meets is re-ranked; with MAX_TRIES
    # plans tried (MAX_RERANKS out of the way) the walk stops having located exactly
    # MAX_TRIES plans and takes the best of them, not the random fallback
    monkeypatch.setattr(capacity_aware, "ENUMERATE_LIMIT", limit)
    monkeypatch.setattr(capacity_aware, "MAX_TRIES", 5)
    monkeypatch.setattr(capacity_aware, "MAX_RERANKS", 1000)
    space = Space(4, slo=True)
    sampler = _sampler(space)
    study = _study(space, sampler, 4, 6)
    _, keys = _brute_force(space, study, sampler, [(1, 1.0)])
    located = []
    sampler._locate_fn = lambda params: located.append(_key(params)) or space.locate(params)
    trial = study.ask()
    params = {n: trial.suggest_categorical(n, d.choices) for n, d in space.dists.items()}
    fresh = [k for k in located if k in keys]
    assert len(fresh) == 5
    pick = sampler.last_pick
    assert pick["reason"] == "knapsack" and pick["tenants"] == space.tenants(params)
    assert keys[_key(params)] == max(keys[k] for k in fresh)
    # what the cut walk reports: the plan, its gain and prediction at its exact capacity
    _, pred, span = _brute_force.predictions[_key(params)]
    assert pick["params"] == params and pick["level"] == pick["tenants"]
    assert pick["gain"] == pytest.approx(keys[_key(params)][0], abs=1e-8)
    assert pick["predicted"] == pytest.approx(pred, abs=1e-8 * span)


# ------------------------------------------------------- the enumerating form, by hand
def _eight():
    """Eight candidates over three two-valued parameters, tenants 10..20, p0 the reference."""
    tenants = [10, 14, 18, 15, 19, 16, 20, 17]
    combos = itertools.product(("a0", "a1"), ("b0", "b1"), ("k0", "k1"))
    return [
        capacity_aware.Candidate(dict(zip(("a", "b", "k"), c, strict=True)), t, f"p{i}")
        for i, (c, t) in enumerate(zip(combos, tenants, strict=True))
    ]


def test_choose_predicts_an_unmeasured_value_at_zero_and_an_incumbent_of_zero_absolutely():
    # R (reference) 0.1, M = a1 0.5 (30 tenants), N = k1 0.3 (25): X (only b1, never measured:
    # predicted 0.1) and Z (a1 and k1: ~0.7) both at 20 tenants, incumbent min(0.5, 0.3)
    cand = capacity_aware.Candidate
    r = cand({"a": 0, "b": 0, "k": 0}, 10, "R")
    m = cand({"a": 1, "b": 0, "k": 0}, 30, "M")
    n = cand({"a": 0, "b": 0, "k": 1}, 25, "N")
    z = cand({"a": 1, "b": 0, "k": 1}, 20, "Z")
    x = cand({"a": 0, "b": 1, "k": 0}, 20, "X")
    cands = [r, m, n, z, x]
    # X: gain (0.3 - 0.1) / 0.3 > Z's (0.3 - 0.7) / 0.3; an unmeasured value costing 1
    # would make X's (0.3 - 1.1) / 0.3 the lower
    assert capacity_aware.choose(cands, {"R": 0.1, "M": 0.5, "N": 0.3}) is x
    # every loss 0: the incumbent 0 is not divided by (gain = incumbent - predicted)
    zero = capacity_aware.choose(cands, {"R": 0.0, "M": 0.0, "N": 0.0})
    assert zero is _choose_by_brute_force(cands, {"R": 0.0, "M": 0.0, "N": 0.0}, set())


def _enumerating(candidates, **kw):
    names = ("a", "b", "k")
    dists = {
        n: CategoricalDistribution(list(dict.fromkeys(c.params[n] for c in candidates)))
        for n in names
    }
    sampler = capacity_aware.CapacityAwareSampler(candidates, quality_index=1, seed=0, **kw)
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)
    return sampler, study, dists


def _ask(study, dists):
    trial = study.ask()
    return {n: trial.suggest_categorical(n, d.choices) for n, d in dists.items()}


def test_the_enumerating_sampler_reads_a_minimised_value_as_the_loss_itself():
    # default quality_sign (+1, minimised): losses of both signs, where choose on twice the
    # values or on their reciprocals picks another plan (relative and absolute gains mix)
    cands = _eight()
    losses = {"p0": 0.148, "p6": 0.084, "p5": 0.113, "p7": -0.265}
    expected = capacity_aware.choose(cands, losses)
    assert expected is not capacity_aware.choose(cands, {k: 2 * v for k, v in losses.items()})
    assert expected is not capacity_aware.choose(cands, {k: 1 / v for k, v in losses.items()})
    sampler, study, dists = _enumerating(cands)
    by_key = {c.key: c for c in cands}
    for k, v in losses.items():
        c = by_key[k]
        study.add_trial(create_trial(params=c.params, distributions=dists, values=[c.tenants, v]))
    assert _ask(study, dists) == expected.params


def test_the_enumerating_sampler_keeps_a_plans_best_loss_and_holds_plans_in_flight():
    cands = _eight()
    by_key = {c.key: c for c in cands}
    losses = {"p0": 0.148, "p6": 0.084, "p5": 0.113, "p7": -0.265}
    sampler, study, dists = _enumerating(cands)
    for k, v in losses.items():
        c = by_key[k]
        study.add_trial(create_trial(params=c.params, distributions=dists, values=[c.tenants, v]))
    # p7 measured again, worse: its best (-0.265) stands
    c7 = by_key["p7"]
    study.add_trial(create_trial(params=c7.params, distributions=dists, values=[c7.tenants, 0.9]))
    first = capacity_aware.choose(cands, losses)
    # the plan choose would take is in flight: the next best is asked
    study.add_trial(create_trial(params=first.params, distributions=dists,
                                 state=TrialState.RUNNING))  # fmt: skip
    expected = capacity_aware.choose(cands, losses, {first.key})
    assert expected is not first and _ask(study, dists) == expected.params


def test_the_enumerating_sampler_reads_a_retry_copys_inherited_worker_as_the_ledger_does():
    # two driver deaths of the reference, the second a retry copy that inherited the first's
    # `worker`: one count of a budget of 2, the reference is asked again
    cands = _eight()
    sampler, study, dists = _enumerating(cands, failure_budget=2)
    attrs = {"failure_reason": "driver_died", "worker": "w1"}
    ref = cands[0]
    study.add_trial(create_trial(params=ref.params, distributions=dists, state=TrialState.FAIL,
                                 user_attrs=attrs))  # fmt: skip
    study.add_trial(create_trial(params=ref.params, distributions=dists, state=TrialState.FAIL,
                                 user_attrs=attrs, system_attrs={"failed_trial": 0}))  # fmt: skip
    assert _ask(study, dists) == ref.params


def test_the_enumerating_sampler_refuses_no_candidates_and_takes_one():
    with pytest.raises(ValueError) as err:
        capacity_aware.CapacityAwareSampler([], quality_index=1)
    assert str(err.value) == "capacity_aware sampler: the space has no candidate plans"
    one = [capacity_aware.Candidate({"a": "x", "b": "y"}, 3, "only")]
    sampler = capacity_aware.CapacityAwareSampler(one, quality_index=1)
    assert sampler.infer_relative_search_space(None, None) == {
        "a": CategoricalDistribution(["x"]),
        "b": CategoricalDistribution(["y"]),
    }


def test_the_enumerating_sampler_draws_other_parameters_from_its_seeded_fallback():
    draws = []
    for seed in (7, 7, 8):
        sampler = capacity_aware.CapacityAwareSampler(_eight(), quality_index=1, seed=seed)
        study = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)
        draws.append(study.ask().suggest_float("extra", 0.0, 1.0))
    assert draws[0] == draws[1] != draws[2]
    assert draws[0] == optuna.samplers.RandomSampler(seed=7).sample_independent(
        None, None, "extra", optuna.distributions.FloatDistribution(0.0, 1.0)
    )


# ------------------------------------------------------------ the knapsack sampler, more
def test_a_knapsack_sampler_without_a_quality_objective_says_so():
    space = Space(0)
    with pytest.raises(ValueError) as err:
        KnapsackSampler(space.problem, quality=[], locate=space.locate, distributions=space.dists)
    assert str(err.value) == "capacity_aware sampler: no quality objective"


def test_a_reference_in_flight_is_not_asked_again():
    space = Space(0)
    sampler = _sampler(space)
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)
    first = study.ask()
    assert {n: first.suggest_categorical(n, d.choices) for n, d in space.dists.items()} == (
        sampler.reference
    )
    second = study.ask()  # the reference still running
    params = {n: second.suggest_categorical(n, d.choices) for n, d in space.dists.items()}
    assert params != sampler.reference and sampler.last_pick["reason"] == "knapsack"


def test_a_partly_enqueued_trial_is_not_planned():
    # Optuna asks the sampler for the parameters an enqueued trial does not fix; the sampler
    # plans no such trial (its fixed parameters may contradict any plan): the others come
    # from the fallback, no prediction is stored, the last pick stands
    space = Space(0)
    sampler = _sampler(space)
    study = _study(space, sampler, 0, 4)
    study.enqueue_trial({"edge": 1})
    trial = study.ask()
    params = {n: trial.suggest_categorical(n, d.choices) for n, d in space.dists.items()}
    assert params["edge"] == 1
    assert quality_model.PREDICTED_ATTR not in study.trials[-1].system_attrs
    assert sampler.last_pick is None


def test_the_dp_walk_proposes_every_plan_of_a_small_space_in_turn():
    # DP only (ENUMERATE_LIMIT 0) on a 16-plan space: once a level's DP plan is measured its
    # one-option swaps within the level are offered, so all 16 plans come from the model (the
    # reference, then the knapsack; never the random fallback). Not each the brute-force best
    # of what is left: swaps are one option away from a measured plan, not a k-best list (the
    # 9th ask here takes a plan of gain -0.12 at 23 tenants for one of -0.056 at 40); the
    # first picks, while each level's DP plan is free, are
    import unittest.mock

    sec = knapsack.Section({"edge": 0}, 10_000, (
        (knapsack.Option({"w.a": "bf16"}, 40_000), knapsack.Option({"w.a": "int8"}, 20_000)),
        (knapsack.Option({"w.b": "bf16"}, 30_000), knapsack.Option({"w.b": "int8"}, 15_000)),
        (knapsack.Option({"w.c": "bf16"}, 16_000), knapsack.Option({"w.c": "int8"}, 8_000)),
    ))  # fmt: skip
    kv = (
        knapsack.KVOption({"kv.k": "bf16"}, 0, 4000),
        knapsack.KVOption({"kv.k": "int8"}, 500, 2000),
    )
    space = Space(0, n_kv=2)
    space.problem = knapsack.Problem((sec,), kv, 160_000, 6_000)
    space.plans = {_key(p): (p, b, k) for p, b, k in _plans(space.problem)}
    space.dists = {
        "edge": CategoricalDistribution([0]),
        **{n: CategoricalDistribution(["bf16", "int8"]) for n in ("w.a", "w.b", "w.c")},
        "kv.k": CategoricalDistribution(["bf16", "int8"]),
    }
    sampler = _sampler(space)
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)
    seen = set()
    with unittest.mock.patch.object(capacity_aware, "ENUMERATE_LIMIT", 0):
        for n in range(16):
            if 2 <= n < 8:
                best, keys = _brute_force(space, study, sampler, [(1, 1.0)])
            trial = study.ask()
            params = {k: trial.suggest_categorical(k, d.choices) for k, d in space.dists.items()}
            assert sampler.last_pick["reason"] == ("reference" if n == 0 else "knapsack"), n
            if 2 <= n < 8:
                assert keys[_key(params)][:2] == best[:2], n
            seen.add(_key(params))
            study.tell(trial, [space.tenants(params), _loss(params, 0)])
    assert len(seen) == 16


@pytest.mark.parametrize("seed", range(4))
def test_the_swaps_are_every_plan_one_option_away_within_the_width(seed):
    # `_swaps`: every plan differing from `opts` in exactly one group whose ticks sum to at
    # most the width cap, with its summed cost; by brute force over all plans of the section
    space = Space(seed)
    sampler = _sampler(space)
    sec = space.problem.sections[0]
    sz = space.problem.sizing[0] = knapsack.sizing(sec)
    rng = np.random.default_rng(seed)
    costs = [rng.uniform(0, 1, len(g)) for g in sec.groups]
    for opts in itertools.product(*(range(len(g)) for g in sec.groups)):
        used = sum(int(sz.ticks[g][o]) for g, o in enumerate(opts))
        for cap in (used, used + int(rng.integers(0, sz.cells + 1)), sz.cells):
            expected = {}
            for other in itertools.product(*(range(len(g)) for g in sec.groups)):
                differ = sum(a != b for a, b in zip(other, opts, strict=True))
                ticks = sum(int(sz.ticks[g][o]) for g, o in enumerate(other))
                if differ == 1 and ticks <= cap:
                    expected[other] = sum(costs[g][o] for g, o in enumerate(other))
            got = dict(sampler._swaps(0, opts, cap, costs))
            assert got.keys() == expected.keys(), (opts, cap)
            for k, c in expected.items():
                assert got[k] == pytest.approx(c, abs=1e-12)


def test_a_pruned_trial_carrying_values_measures_nothing():
    # Optuna stores values on a PRUNED trial if given; only COMPLETE trials are measurements:
    # the plan a pruned trial ran is the next pick of both samplers as if it were not there
    space = Space(1)
    sampler = _sampler(space)
    study = _study(space, sampler, 1, 5)
    best, keys = _brute_force(space, study, sampler, [(1, 1.0)])
    top = space.plans[max(keys, key=keys.get)][0]
    study.add_trial(create_trial(params=top, distributions=space.dists, state=TrialState.PRUNED,
                                 values=[space.tenants(top), 0.0]))  # fmt: skip
    trial = study.ask()
    assert {n: trial.suggest_categorical(n, d.choices) for n, d in space.dists.items()} == top
    cands = _eight()
    by_key = {c.key: c for c in cands}
    losses = {"p0": 0.148, "p6": 0.084, "p5": 0.113, "p7": -0.265}
    enum, study, dists = _enumerating(cands)
    for k, v in losses.items():
        c = by_key[k]
        study.add_trial(create_trial(params=c.params, distributions=dists, values=[c.tenants, v]))
    expected = capacity_aware.choose(cands, losses)
    study.add_trial(
        create_trial(
            params=expected.params,
            distributions=dists,
            state=TrialState.PRUNED,
            values=[expected.tenants, -5.0],
        )
    )
    assert _ask(study, dists) == expected.params


@pytest.mark.parametrize("limit", [capacity_aware.ENUMERATE_LIMIT, 0], ids=["enumerate", "dp"])
def test_two_objectives_with_nothing_measured_are_weighted_unscaled(monkeypatch, limit):
    # the reference failed and nothing is measured: no range to scale the objectives by
    # (each scale 1), every level an infinite gain, ties to more tenants
    monkeypatch.setattr(capacity_aware, "ENUMERATE_LIMIT", limit)
    space = Space(0)
    quality = ((1, 1.0), (2, -1.0))
    sampler = _sampler(space, quality=quality, seed=2)
    study = _study(space, sampler, 0, 0, two=True, ref_failed=True)
    trial = study.ask()
    params = {n: trial.suggest_categorical(n, d.choices) for n, d in space.dists.items()}
    assert sampler.last_pick["reason"] == "knapsack" and sampler.last_pick["gain"] == math.inf
    assert space.tenants(params) == max(space.tenants(p) for p, _, _ in space.plans.values())
