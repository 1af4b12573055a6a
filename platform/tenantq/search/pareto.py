"""The Pareto front of a study as rows and as a plain-text table.

The front is Optuna's (`study.best_trials`: completed, feasible, non-dominated), one row per
distinct plan. Each quality figure is shown with its CI from the suite's summary, and, when the
front was confirmed on held-out examples, the confirmed figure beside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tenantq.model.terminal import text_table
from tenantq.search.spec import CAPACITY_METRICS, ObjectiveSpec


@dataclass
class FrontRow:
    trial: int
    fingerprint: str
    tenants: int  # the study's capacity value (`CapacityObjective`): by memory or at the SLO
    quality: dict[str, tuple[float, float | None, float | None]]  # metric -> (value, lo, hi)
    feasible: bool
    verdicts: str
    weights: str
    kv: str
    plan_json: str
    confirmed: dict[str, tuple[float, float | None, float | None]] = field(default_factory=dict)
    confirmed_feasible: bool | None = None
    confirmed_verdicts: str = ""
    confirmed_error: str = ""
    tenants_by_memory: int = 0
    capacity_label: str = "tenants"  # "tenants", or "tenants at 20 tok/s"


def quality_with_ci(
    summary: dict[str, Any], metric: str
) -> tuple[float, float | None, float | None]:
    return (
        float(summary.get(metric, float("nan"))),
        _num(summary.get(f"{metric}.ci_low")),
        _num(summary.get(f"{metric}.ci_high")),
    )


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def verdict_text(summary: dict[str, Any]) -> str:
    return ", ".join(
        f"{k.removeprefix('verdict.')}={v}"
        for k, v in sorted(summary.items())
        if k.startswith("verdict.")
    )


def front_rows(
    trials: Sequence[Any], objectives: list[ObjectiveSpec], capacity: Any = None
) -> list[FrontRow]:
    """Rows for the front trials (FrozenTrials), one per plan fingerprint, most tenants first;
    `capacity`: the study's `CapacityObjective` (None: tenants by memory)."""
    rows: dict[str, FrontRow] = {}
    key = capacity.key if capacity is not None else "capacity.tenants"
    label = capacity.label if capacity is not None else "tenants"
    for t in sorted(trials, key=lambda t: t.number):
        attrs = t.user_attrs
        fp = attrs.get("plan_fingerprint", str(t.number))
        if fp in rows:
            continue
        summary = attrs.get("summary", {})
        rows[fp] = FrontRow(
            trial=t.number,
            fingerprint=fp,
            tenants=int(attrs.get("capacity", {}).get(key, 0)),
            tenants_by_memory=int(attrs.get("capacity", {}).get("capacity.tenants", 0)),
            capacity_label=label,
            quality={
                o.metric: quality_with_ci(summary, o.metric)
                for o in objectives
                if o.metric not in CAPACITY_METRICS
            },
            feasible=all(v <= 0 for v in t.constraints.values()),
            verdicts=verdict_text(summary),
            weights=attrs.get("weights_summary", ""),
            kv=attrs.get("kv_summary", ""),
            plan_json=attrs.get("plan", "{}"),
        )
    return sorted(rows.values(), key=lambda r: (-r.tenants, r.trial))


def _fmt(q: tuple[float, float | None, float | None] | None) -> str:
    if q is None:
        return "-"
    value, lo, hi = q
    if lo is None or hi is None:
        return f"{value:.4g}"
    return f"{value:.4g} [{lo:.4g}, {hi:.4g}]"


def render_front(rows: list[FrontRow], objectives: list[ObjectiveSpec]) -> str:
    """The front as a fixed-width table; confirmed columns appear when any row has them."""
    if not rows:
        return "Pareto front: empty (no completed trial met every constraint)"
    metrics = [o.metric for o in objectives if o.metric not in CAPACITY_METRICS]
    confirmed = any(r.confirmed or r.confirmed_error for r in rows)
    by_memory = rows[0].capacity_label != "tenants"  # at an SLO: memory's count beside it
    head = ["trial", rows[0].capacity_label] + (["by memory"] if by_memory else [])
    for m in metrics:
        head.append(f"{m} [CI]")
        if confirmed:
            head.append(f"confirmed {m} [CI]")
    head += ["shippable"] + (["confirmed"] if confirmed else []) + ["weights", "KV"]
    body = []
    for r in rows:
        cells = [str(r.trial), str(r.tenants)] + ([str(r.tenants_by_memory)] if by_memory else [])
        for m in metrics:
            cells.append(_fmt(r.quality.get(m)))
            if confirmed:
                cells.append(_fmt(r.confirmed.get(m)))
        cells.append("yes" if r.feasible else "no")
        if confirmed:
            cells.append(
                "-" if r.confirmed_feasible is None else ("yes" if r.confirmed_feasible else "no")
            )
        cells += [r.weights, r.kv]
        body.append(cells)
    lines = text_table(head, body, rule=True)
    verdicts = [f"  trial {r.trial}: {r.verdicts}" for r in rows if r.verdicts]
    if verdicts:
        lines += ["", "verdicts:", *verdicts]
    failed = [f"  trial {r.trial}: {r.confirmed_error}" for r in rows if r.confirmed_error]
    if failed:
        lines += ["", "confirmation could not run (search-time figures shown):", *failed]
    return "\n".join(lines)
