"""A trial's objective values, capacity lines and constraints (search/objectives.py), by hand.

Every expected figure below is written out from the inputs (stand-in budgets and service
levels whose fields are distinct numbers), so a line read from the wrong field, a key spelt
differently, a unit conversion turned around or a sign flipped shows as a different number.
Directions are Optuna's business: `objective_values` hands it the raw value of every
objective, maximised or minimised alike, and the front flips the maximised ones itself.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from tenantq.search.objectives import (
    CapacityObjective,
    capacity_key,
    capacity_metrics,
    constraint_values,
    objective_values,
)
from tenantq.search.spec import ConstraintSpec, ObjectiveSpec

# A budget whose every field the capacity lines read is a distinct number.
BUDGET = SimpleNamespace(
    tenants=12,
    pool_tokens=3072,
    pool_bytes_per_chip=5_000_000,
    weights_bytes_per_chip=7_000_000,
    kv_bytes_per_token_per_chip=1536,  # an int here: the line is a float
    tenant_bytes_per_chip=400_000,
    max_context_tokens=2048,
)
# A service level: 9 tenants at the SLO (11 by the step model alone), 12.5 ms a step.
LEVEL = SimpleNamespace(
    tenants=9, tenants_by_slo=11, step=SimpleNamespace(step_s=0.0125), tokens_per_s_per_tenant=80.0
)
MEMORY_LINES = {
    "capacity.tenants": 12,
    "capacity.pool_tokens": 3072,
    "capacity.pool_bytes_per_chip": 5_000_000,
    "capacity.weights_bytes_per_chip": 7_000_000,
    "capacity.kv_bytes_per_token_per_chip": 1536.0,
    "capacity.tenant_bytes_per_chip": 400_000,
    "capacity.max_context_tokens": 2048,
}
SLO_LINES = {
    "capacity.tenants_at_slo": 9,
    "capacity.tenants_by_slo": 11,
    "capacity.step_ms": 12.5,  # 0.0125 s in milliseconds
    "capacity.tokens_per_s_per_tenant": 80.0,
}


def test_the_capacity_lines_of_a_budget_by_hand() -> None:
    lines = capacity_metrics(BUDGET)
    assert lines == MEMORY_LINES
    assert type(lines["capacity.kv_bytes_per_token_per_chip"]) is float


def test_a_service_level_adds_its_four_lines_to_the_budgets() -> None:
    lines = capacity_metrics(BUDGET, LEVEL)
    assert lines == MEMORY_LINES | SLO_LINES
    assert lines["capacity.step_ms"] == pytest.approx(12.5, rel=1e-12)


def test_capacity_keys_name_the_capacity_lines() -> None:
    assert capacity_key("tenants") == "capacity.tenants"
    assert capacity_key("tenants_at_slo") == "capacity.tenants_at_slo"


def _objective(metric: str, slo: str | None = None) -> CapacityObjective:
    return CapacityObjective(metric, slo, config="cfg", deployment="dep", context_tokens=256)


class _Plan:
    def __init__(self, fp: str) -> None:
        self.fp = fp

    def fingerprint(self) -> str:
        return self.fp


@pytest.fixture
def step_model(monkeypatch):
    """`roofline.tenants_at_slo` recorded: the arguments of every call, LEVEL returned."""
    calls: list[tuple] = []

    def fake(config, plan, deployment, context_tokens, slo, **kw):
        calls.append((config, plan, deployment, context_tokens, slo, kw))
        return LEVEL

    import tenantq.capacity.roofline as roofline

    monkeypatch.setattr(roofline, "tenants_at_slo", fake)
    return calls


def test_the_slo_capacity_value_is_the_service_levels_tenants(step_model) -> None:
    cap = _objective("tenants_at_slo", "20tok/s")
    plan = _Plan("p1")
    assert cap.key == "capacity.tenants_at_slo"
    assert cap.service_level(plan, BUDGET) is LEVEL
    # the step model is asked with the study's model, deployment, context and SLO, and the
    # budget's tenants as the memory bound
    assert step_model == [("cfg", plan, "dep", 256, "20tok/s", {"tenants_by_memory": 12})]
    lines, level = cap.lines(plan, BUDGET)
    assert lines == MEMORY_LINES | SLO_LINES and level is LEVEL
    assert cap.tenants(plan, BUDGET) == 9
    assert type(cap.tenants(plan, BUDGET)) is int
    assert cap.value(lines) == 9.0
    assert len(step_model) == 1  # the same plan again: the cached level


def test_the_memory_capacity_value_is_the_budgets_tenants(step_model) -> None:
    cap = _objective("tenants")
    plan = _Plan("p1")
    assert cap.service_level(plan, BUDGET) is None
    lines, level = cap.lines(plan, BUDGET)
    assert lines == MEMORY_LINES and level is None
    assert cap.tenants(plan, BUDGET) == 12
    assert cap.value(lines) == 12.0
    assert step_model == []  # no SLO: the step model is never asked


def test_the_memory_metric_ignores_an_slo_the_deployment_carries(step_model) -> None:
    # `[deployment] slo` with the `tenants` objective: the lines carry the SLO's figures,
    # the capacity value stays tenants by memory.
    cap = _objective("tenants", "20tok/s")
    assert cap.tenants(_Plan("p1"), BUDGET) == 12
    assert cap.value(cap.lines(_Plan("p1"), BUDGET)[0]) == 12.0


def test_a_trial_without_capacity_lines_has_capacity_zero() -> None:
    for metric in ("tenants", "tenants_at_slo"):
        assert _objective(metric, "20tok/s").value({}) == 0.0
    assert _objective("tenants").value({"capacity.tenants_at_slo": 5.0}) == 0.0
    assert _objective("tenants_at_slo", "1").value({"capacity.tenants": 5.0}) == 0.0


def test_the_level_cache_holds_4096_plans_then_starts_again(step_model) -> None:
    """The cache of service levels is cleared when a 4097th plan arrives (its bound, 4096,
    is in `service_level`): until then every plan is computed once."""
    cap = _objective("tenants_at_slo", "20tok/s")
    plans = [_Plan(f"p{i}") for i in range(4097)]
    for p in plans[:4096]:
        cap.service_level(p, BUDGET)
    assert len(step_model) == 4096
    cap.service_level(plans[0], BUDGET)
    cap.service_level(plans[4095], BUDGET)
    assert len(step_model) == 4096  # all 4096 still cached
    cap.service_level(plans[4096], BUDGET)  # the 4097th: the cache starts again
    assert len(step_model) == 4097
    cap.service_level(plans[0], BUDGET)
    assert len(step_model) == 4098  # cleared: computed again
    cap.service_level(plans[4096], BUDGET)
    assert len(step_model) == 4098  # kept after the clear


OBJ = [
    ObjectiveSpec(metric="tenants", direction="maximize"),
    ObjectiveSpec(metric="fidelity.kl_mean", direction="minimize"),
    ObjectiveSpec(metric="needles.accuracy", direction="maximize"),
]


def test_objective_values_are_raw_values_in_the_specs_order() -> None:
    # maximised or minimised, each value is given as measured (Optuna applies directions)
    summary = {"fidelity.kl_mean": 0.25, "needles.accuracy": 1, "other": 7.0}
    got = objective_values(OBJ, {"capacity.tenants": 12}, summary)
    assert got == [12.0, 0.25, 1.0]
    assert all(type(v) is float for v in got)
    reordered = [OBJ[2], OBJ[1], OBJ[0]]
    assert objective_values(reordered, {"capacity.tenants": 12}, summary) == [1.0, 0.25, 12.0]


def test_the_slo_objective_reads_its_own_capacity_line() -> None:
    obj = [ObjectiveSpec(metric="tenants_at_slo", direction="maximize"), OBJ[1]]
    lines = {"capacity.tenants": 12, "capacity.tenants_at_slo": 9}
    assert objective_values(obj, lines, {"fidelity.kl_mean": 0.5}) == [9.0, 0.5]


def test_a_missing_capacity_line_is_an_error() -> None:
    with pytest.raises(KeyError):
        objective_values(OBJ[:1], {"capacity.tenants_at_slo": 9}, {})


def test_an_objective_the_suite_did_not_produce_names_the_available_metrics() -> None:
    # 45 numeric metrics (the message lists the first 40, sorted), strings and a bool
    summary = {f"m{i:02d}": float(i) for i in range(45)} | {"name": "x", "flag": True}
    summary["m07"] = 7  # an int is numeric
    with pytest.raises(ValueError) as err:
        objective_values(OBJ[1:2], {}, summary)
    listed = ", ".join(f"m{i:02d}" for i in range(40))
    # `flag` (a bool is an int to isinstance) sorts first among the numeric ones
    assert str(err.value) == (
        "objective 'fidelity.kl_mean' is not a number in the suite's results; "
        f"metrics available: flag, {listed.rsplit(', ', 1)[0]}"
    )


@pytest.mark.parametrize("value", ["0.5", True, False, None, [0.5]])
def test_an_objective_that_is_not_a_number_is_refused(value) -> None:
    with pytest.raises(ValueError, match="^objective 'fidelity.kl_mean' is not a number"):
        objective_values(OBJ[1:2], {}, {"fidelity.kl_mean": value, "b": 1.0, "a": 2})


def test_the_available_metrics_are_sorted_names_of_numbers() -> None:
    with pytest.raises(ValueError) as err:
        objective_values(OBJ[1:2], {}, {"z": 1.0, "s": "x", "a": 2, "m": 0.5})
    assert str(err.value).endswith("metrics available: a, m, z")


@pytest.mark.parametrize(
    ("value", "shown"), [(math.inf, "inf"), (-math.inf, "-inf"), (math.nan, "nan")]
)
def test_a_non_finite_objective_is_refused(value: float, shown: str) -> None:
    with pytest.raises(ValueError) as err:
        objective_values(OBJ, {"capacity.tenants": 4}, {"fidelity.kl_mean": value})
    assert str(err.value) == f"objective 'fidelity.kl_mean' is {shown} (not a finite number)"


def test_constraints_default_to_the_suites_gates() -> None:
    gates = {"fidelity": {"constraint": -0.5, "ok": True}, "needles": {"constraint": 2}}
    got = constraint_values(None, {}, gates)
    assert got == {"fidelity": -0.5, "needles": 2.0}
    assert all(type(v) is float for v in got.values())


def test_spec_constraints_are_the_bound_less_its_tolerance() -> None:
    constraints = [
        ConstraintSpec(metric="fidelity.kl_mean", tolerance=0.25),  # ci_high by default
        ConstraintSpec(metric="needles.accuracy", tolerance=0.5, bound="ci_low"),
        ConstraintSpec(metric="f1", tolerance=0.0, bound="value"),
    ]
    summary = {
        "fidelity.kl_mean": 9.0,
        "fidelity.kl_mean.ci_high": 1.0,
        "needles.accuracy": 9.0,
        "needles.accuracy.ci_low": 2,
        "f1": 0.75,
        "f1.ci_high": 9.0,
    }
    got = constraint_values(constraints, summary, {"gate": {"constraint": 5.0}})
    assert got == {"fidelity.kl_mean": 0.75, "needles.accuracy": 1.5, "f1": 0.75}
    assert all(type(v) is float for v in got.values())
    assert constraint_values([], summary, {"gate": {"constraint": 5.0}}) == {}


@pytest.mark.parametrize("value", [None, "0.5", True])
def test_a_constraint_whose_bound_is_absent_is_an_error(value) -> None:
    c = [ConstraintSpec(metric="fidelity.kl_mean", tolerance=0.1)]
    summary = {"fidelity.kl_mean": 0.5} | (
        {} if value is None else {"fidelity.kl_mean.ci_high": value}
    )
    with pytest.raises(ValueError) as err:
        constraint_values(c, summary, {})
    assert str(err.value) == (
        "constraint on 'fidelity.kl_mean' needs 'fidelity.kl_mean.ci_high' in the suite's "
        "results; it is absent"
    )
