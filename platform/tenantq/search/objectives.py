"""Objective values and constraints of a trial, from its budget and its `TrialResult`.

Capacity is computed in the driver by `tenantq.capacity.budget` (exact, about a millisecond,
no accelerator); quality comes from the worker's summary. Constraints go to Optuna's
`trial.set_constraint` (<= 0 feasible): by default the suite's own gates, or the spec's
`[[constraints]]` (metric's CI bound minus its tolerance).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tenantq.search.spec import CAPACITY_METRIC, ConstraintSpec, ObjectiveSpec


def capacity_metrics(budget) -> dict[str, float]:
    """The capacity lines logged for every trial (`capacity.*`), from a `capacity.Budget`."""
    return {
        "capacity.tenants": budget.tenants,
        "capacity.pool_tokens": budget.pool_tokens,
        "capacity.pool_bytes_per_chip": budget.pool_bytes_per_chip,
        "capacity.weights_bytes_per_chip": budget.weights_bytes_per_chip,
        "capacity.kv_bytes_per_token_per_chip": float(budget.kv_bytes_per_token_per_chip),
        "capacity.tenant_bytes_per_chip": budget.tenant_bytes_per_chip,
        "capacity.max_context_tokens": budget.max_context_tokens,
    }


def objective_values(
    objectives: list[ObjectiveSpec], tenants: int, summary: Mapping[str, Any]
) -> list[float]:
    """Values in the spec's objective order; a metric the suite did not produce is an error."""
    out = []
    for obj in objectives:
        if obj.metric == CAPACITY_METRIC:
            out.append(float(tenants))
            continue
        value = summary.get(obj.metric)
        if not isinstance(value, int | float) or isinstance(value, bool):
            numeric = sorted(k for k, v in summary.items() if isinstance(v, int | float))
            raise ValueError(
                f"objective {obj.metric!r} is not a number in the suite's results; "
                f"metrics available: {', '.join(numeric[:40])}"
            )
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
