"""Objective values and constraints of a trial, from its budget and its `TrialResult`.

Capacity is computed in the driver by `tenantq.capacity.budget` (exact, about a millisecond,
no accelerator) and, with `[deployment] slo`, the roofline step model; `CapacityObjective` is
the one place that says what the capacity value of a trial is (tenants by memory, or tenants
at the SLO), for the objective, the front, the export and the samplers. Quality comes from the
worker's summary. Constraints go to Optuna's
`trial.set_constraint` (<= 0 feasible): by default the suite's own gates, or the spec's
`[[constraints]]` (metric's CI bound minus its tolerance).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tenantq.search.spec import CAPACITY_METRIC, CAPACITY_METRICS, ConstraintSpec, ObjectiveSpec


def capacity_key(metric: str) -> str:
    """The `capacity.*` line (trial user attribute `capacity`, MLflow metric) holding a
    capacity metric: `tenants` -> `capacity.tenants`, `tenants_at_slo` ->
    `capacity.tenants_at_slo`."""
    return f"capacity.{metric}"


@dataclass(frozen=True)
class CapacityObjective:
    """What the capacity value of a trial is in a study: `metric` is `tenants` (by memory,
    the budget) or `tenants_at_slo` (min of that and the tenants whose decode rate meets
    `slo`). Samplers take it through `tenants(plan, budget)`; everything that reads a
    finished trial takes it through `value(capacity_lines)`."""

    metric: str
    slo: str | None
    config: Any  # the capacity model's ModelConfig
    deployment: Any  # tenantq.capacity.Deployment
    context_tokens: int
    # plan fingerprint -> ServiceLevel: the step model costs tens of ms a plan, and a study
    # asks the same plan again (duplicates, samplers ranking candidates)
    _levels: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def for_spec(cls, spec, config, deployment) -> CapacityObjective:
        return cls(
            spec.capacity_metric, spec.deployment.slo, config, deployment,
            spec.deployment.context_tokens,
        )  # fmt: skip

    @property
    def key(self) -> str:
        return capacity_key(self.metric)

    @property
    def label(self) -> str:
        """The column and axis title: `tenants`, or `tenants at 20 tok/s`."""
        if self.metric == CAPACITY_METRIC or self.slo is None:
            return "tenants"
        from tenantq.capacity.roofline import parse_slo

        return f"tenants at {parse_slo(self.slo):g} tok/s"

    def service_level(self, plan, budget):
        """The plan's `capacity.roofline.ServiceLevel` (None without an slo)."""
        if self.slo is None:
            return None
        from tenantq.capacity.roofline import tenants_at_slo

        fp = plan.fingerprint()
        if fp not in self._levels:
            if len(self._levels) >= 4096:
                self._levels.clear()
            self._levels[fp] = tenants_at_slo(
                self.config, plan, self.deployment, self.context_tokens, self.slo,
                tenants_by_memory=budget.tenants,
            )  # fmt: skip
        return self._levels[fp]

    def lines(self, plan, budget) -> tuple[dict[str, float], Any]:
        """(the `capacity.*` lines logged for the trial, its ServiceLevel or None)."""
        level = self.service_level(plan, budget)
        return capacity_metrics(budget, level), level

    def tenants(self, plan, budget) -> int:
        """The capacity value of `plan` whose budget is `budget` (for samplers)."""
        if self.metric == CAPACITY_METRIC:
            return budget.tenants
        return int(self.value(self.lines(plan, budget)[0]))

    def value(self, capacity: Mapping[str, float]) -> float:
        """The capacity value of a trial from its `capacity.*` lines; 0 when a trial
        recorded none (a plan that failed before its budget)."""
        return float(capacity.get(self.key, 0))


def capacity_metrics(budget, level=None) -> dict[str, float]:
    """The capacity lines logged for every trial (`capacity.*`), from a `capacity.Budget`
    and, with a service level, its `capacity.roofline.ServiceLevel`."""
    slo = {}
    if level is not None:
        slo = {
            "capacity.tenants_at_slo": level.tenants,
            "capacity.tenants_by_slo": level.tenants_by_slo,
            "capacity.step_ms": level.step.step_s * 1e3,
            "capacity.tokens_per_s_per_tenant": level.tokens_per_s_per_tenant,
        }
    return slo | {
        "capacity.tenants": budget.tenants,
        "capacity.pool_tokens": budget.pool_tokens,
        "capacity.pool_bytes_per_chip": budget.pool_bytes_per_chip,
        "capacity.weights_bytes_per_chip": budget.weights_bytes_per_chip,
        "capacity.kv_bytes_per_token_per_chip": float(budget.kv_bytes_per_token_per_chip),
        "capacity.tenant_bytes_per_chip": budget.tenant_bytes_per_chip,
        "capacity.max_context_tokens": budget.max_context_tokens,
    }


def objective_values(
    objectives: list[ObjectiveSpec], capacity: Mapping[str, float], summary: Mapping[str, Any]
) -> list[float]:
    """Values in the spec's objective order: a capacity objective from the trial's
    `capacity.*` lines, the others from the suite's summary (a metric it did not produce is an
    error)."""
    out = []
    for obj in objectives:
        if obj.metric in CAPACITY_METRICS:
            out.append(float(capacity[capacity_key(obj.metric)]))
            continue
        value = summary.get(obj.metric)
        if not isinstance(value, int | float) or isinstance(value, bool):
            numeric = sorted(k for k, v in summary.items() if isinstance(v, int | float))
            raise ValueError(
                f"objective {obj.metric!r} is not a number in the suite's results; "
                f"metrics available: {', '.join(numeric[:40])}"
            )
        if not math.isfinite(value):  # Optuna would FAIL the trial on tell: refuse it first
            raise ValueError(f"objective {obj.metric!r} is {value} (not a finite number)")
        out.append(float(value))
    return out


def constraint_values(
    constraints: list[ConstraintSpec] | None,
    summary: Mapping[str, Any],
    gates: Mapping[str, Mapping[str, Any]],
) -> dict[str, float]:
    """Constraint name -> value (<= 0 within tolerance) for `trial.set_constraint`."""
    if constraints is None:
        return {name: float(g["constraint"]) for name, g in gates.items()}
    out = {}
    for c in constraints:
        key = c.metric if c.bound == "value" else f"{c.metric}.{c.bound}"
        value = summary.get(key)
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ValueError(
                f"constraint on {c.metric!r} needs {key!r} in the suite's results; it is absent"
            )
        out[c.metric] = float(value) - c.tolerance
    return out
