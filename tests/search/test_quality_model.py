"""The capacity-aware sampler's quality model (tenantq.search.quality_model): pairwise weight x
KV terms where the measurements show an interaction, and the knapsack that plans with them.
Losses are synthetic (known additive costs plus a known interaction), so every bound is
arithmetic or the ridge's stated pull (RIDGE = 1% of one measured plan).
"""

from __future__ import annotations

import itertools
import random

import optuna
import pytest

from tenantq.search import capacity_aware, quality_model
from tenantq.search.capacity_aware import sampler_for_context
from tenantq.search.context import prepare
from tenantq.search.space import parameter_choices, suggest
from tenantq.search.spec import parse_spec

optuna.logging.set_verbosity(optuna.logging.WARNING)

A, B, K = ("w.a", "int4"), ("w.b", "int4"), ("kv.key_format", "int4")
COST = {A: 0.2, B: 0.1, K: 0.3}


def _is_kv(f) -> bool:
    return f[0].startswith("kv.")


def _rows(interaction: float):
    # every non-empty subset of {a, b, k}, twice: (a, k) is held by 4 plans, each alone by more
    plans = [c for n in (1, 2, 3) for c in itertools.combinations((A, B, K), n)] * 2
    ys = [sum(COST[f] for f in p) + interaction * (A in p and K in p) for p in plans]
    return plans, ys


def test_a_known_interaction_is_fitted_as_a_pairwise_term():
    # loss = 0.2 a + 0.1 b + 0.3 k + 0.5 [a and k]: the additive model cannot fit it, the
    # pairwise rule keeps the (a, k) term, and it lands within 2% of 0.5 (the ridge's pull)
    rows, ys = _rows(0.5)
    assert (A, K) in quality_model.candidate_pairs(rows, _is_kv)
    fit = quality_model.fit(rows, ys, 0.0, is_kv=_is_kv)
    assert fit.pair(A, K) == pytest.approx(0.5, rel=0.02)
    assert abs(fit.pair(B, K)) < 0.01
    assert fit.predict((A, K)) == pytest.approx(1.0, rel=0.02)
    additive = quality_model.fit(rows, ys, 0.0)  # without is_kv: no pairwise terms
    assert additive.pairs == {} and abs(additive.predict((A, K)) - 1.0) > 0.1


def test_additive_measurements_keep_the_model_additive():
    # no interaction in the data: the pairs do not cut the leave-one-out error by PAIR_GAIN,
    # so none is kept (the rule: pairwise terms only where the measurements show one)
    rows, ys = _rows(0.0)
    assert quality_model.candidate_pairs(rows, _is_kv)
    assert quality_model.fit(rows, ys, 0.0, is_kv=_is_kv).pairs == {}


def test_a_pair_held_by_one_plan_is_not_a_candidate():
    # PAIR_MIN = 2 plans must hold both values, and each must be measured without the other
    rows = [(A,), (K,), (A, K)]
    assert quality_model.candidate_pairs(rows, _is_kv) == []
    rows = [(A, K), (A, K), (K,)]  # a never without k: its own term and the pair are one column
    assert quality_model.candidate_pairs(rows, _is_kv) == []


SPEC = {
    "model": "reference",
    "deployment": {"hardware": "cpu", "memory": "9830KiB", "context_tokens": 256},
    "space": {
        "kind": "structured", "group_size": 64, "weight_formats": ["bf16", "int8", "int4"],
        "uniform_weights": True, "bf16_first_layers": [0], "bf16_last_layers": [0],
        "key_axes": ["channel"], "sink_tokens": [0], "kv_bf16_layers": ["none"],
        "key_formats": ["bf16", "int8", "int4"], "value_formats": ["bf16", "int8", "int4"],
    },
    "study": {"name": "pairs", "trials": 10},
}  # fmt: skip
FORMAT_COST = {"bf16": 0.0, "int8": 0.002, "int4": 0.01}
INTERACTION = 0.05  # int4 linear weights x each int4 KV side


def _loss(params) -> float:
    out = sum(FORMAT_COST.get(v, 0.0) for v in params.values() if isinstance(v, str))
    k4 = sum(params[k] == "int4" for k in ("kv.key_format", "kv.value_format"))
    return out + INTERACTION * (params["w.linear"] == "int4") * k4


@pytest.mark.parametrize("limit", [0, capacity_aware.ENUMERATE_LIMIT])
def test_the_knapsack_plans_with_the_pairwise_terms(monkeypatch, limit):
    # The 243-plan space, 40 plans measured at random (the reference first) with a known
    # interaction. The sampler's model holds the (int4 linear, int4 keys) term within 10% of
    # 0.05, and its pick, by the DP (limit 0: the KV plan the outer loop, pair terms constant
    # within it) or by enumeration, is credited with exactly base + its values' planning
    # losses + its pairs' terms (the DP counts the pairs) and with no more tenants than it has.
    monkeypatch.setattr(capacity_aware, "ENUMERATE_LIMIT", limit)
    ctx = prepare(parse_spec(SPEC), "")
    sampler = sampler_for_context(ctx)
    choices = parameter_choices(ctx.spec.space, ctx.config, ctx.profile)
    every = [dict(zip(choices, vs, strict=True)) for vs in itertools.product(*choices.values())]
    design = [sampler.reference, *random.Random(0).sample(every, 39)]
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)
    for params in design:
        study.add_trial(optuna.trial.create_trial(
            params=params, distributions=sampler._space,
            values=[ctx.plan_and_budget(params)[1].tenants, _loss(params)],
        ))  # fmt: skip
    suggest(study.ask(), ctx.spec.space, ctx.config)
    pick = sampler.last_pick
    assert pick["reason"] == "knapsack"
    rows = [sampler.features(p) for p in design[1:]]
    base = _loss(sampler.reference)
    fit = quality_model.fit(rows, [_loss(p) for p in design[1:]], base, is_kv=sampler._is_kv)
    assert fit.pair(("w.linear", "int4"), ("kv.key_format", "int4")) == pytest.approx(
        INTERACTION, rel=0.1
    )
    feats = sampler.features(pick["params"])
    kv = [f for f in feats if sampler._is_kv(f)]
    by_hand = base + sum(fit.lcb(f) for f in feats)
    by_hand += sum(fit.pair(f, g) for f in feats for g in kv)
    assert pick["predicted"] == pytest.approx(by_hand, rel=1e-6, abs=1e-9)
    assert pick["tenants"] >= pick["level"]
