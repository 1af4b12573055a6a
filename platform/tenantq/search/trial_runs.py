"""MLflow bookkeeping of a study: the parent run, a nested run per told trial, reconciled.

A trial's run is written only after Optuna was told (the ledger's TOLD -> LOGGED step) and in
one go (created, filled, terminated). A failure to log never touches the trial's outcome: the
trial stays TOLD and `reconcile` writes its run from what the study recorded, at the end of the
study and on every resume. Reconciling goes by run status: a run a crash left RUNNING is
half-written, so it is deleted and written again; MLflow then holds exactly one finished run
per finished trial.
"""

from __future__ import annotations

import contextlib
from typing import Any

from tenantq.search.ledger import Entry
from tenantq.search.store import PARENT_RUN_ATTR

DONE_STATUSES = ("FINISHED", "FAILED")


def open_parent(tracker, study, context, workers: int) -> None:
    """Reopen the study's parent run, or start it (params: what the study measures)."""
    from tenantq.tracking import code_version, source_tags

    spec = context.spec
    parent = study.user_attrs.get(PARENT_RUN_ATTR)
    if parent:
        tracker.resume_study(parent)
        return
    dep = spec.deployment
    identity = study.user_attrs.get("tenantq.identity") or context.identity()
    params = {
        "study.name": spec.study.name,
        "study.trials": spec.study.trials,
        "study.storage": spec.study.storage,
        "study.trial_timeout": spec.study.trial_timeout or "",
        "model.path": str(context.model_path),
        "model.identity": identity["model"],
        "deployment.hardware": dep.hardware,
        "deployment.memory": dep.memory or "",
        "deployment.chips": dep.chips,
        "deployment.context_tokens": dep.context_tokens,
        "deployment.page_tokens": dep.page_tokens,
        "deployment.reserve": dep.reserve if dep.reserve is not None else "10%",
        "deployment.slo": dep.slo or "",
        "capacity.metric": spec.capacity_metric,
        "space.kind": spec.space.kind,
        "sampler.kind": spec.sampler.kind,
        "sampler.seed": spec.sampler.seed,
        "eval.suite": spec.eval.suite,
        "eval.confirm_suite": spec.eval.confirm_suite or "",
        "objectives": ", ".join(f"{o.direction} {o.metric}" for o in spec.objectives),
        "workers.count": workers,
        "workers.kind": spec.workers.kind,
    }
    tags = {"tenantq.code_version": code_version(), "tenantq.study": spec.study.name}
    tags.update(source_tags())  # mlflow.source.git.commit and the dirty flag
    run_id = tracker.start_study(spec.study.name, params, tags, context.spec_text)
    study.set_user_attr(PARENT_RUN_ATTR, run_id)


def log_entry(tracker, entry: Entry, config, *, metrics: dict, tags: dict, artifacts: dict) -> str:
    """The nested run of a told trial."""
    arts = dict(artifacts)
    if entry.plan is not None:
        arts["plan.json"] = entry.plan_json or entry.plan.to_json()
    if entry.budget is not None:
        from tenantq.capacity.table import render_budget

        arts["budget.txt"] = render_budget(entry.budget)
        arts["budget.json"] = entry.budget.to_dict()
        if entry.service_level is not None:  # the report's waterfall splits at the SLO
            arts["budget.json"]["service_level"] = entry.service_level.to_dict()
    tags = dict(tags)
    attrs = getattr(entry.trial, "user_attrs", None) or {}
    if attrs.get("baseline"):  # the report's Pareto markers and timeline read these
        tags.setdefault("tenantq.baseline", "true")
    if entry.worker:
        tags.setdefault("tenantq.worker", entry.worker)
    if entry.duplicate_of is not None:
        tags.setdefault("tenantq.duplicate_of", str(entry.duplicate_of))
    if entry.reason:
        tags.setdefault("tenantq.failure_reason", entry.reason)
    error = entry.error if entry.outcome == "failed" else None
    return tracker.log_trial(
        entry.number,
        params=entry.params,
        metrics=dict(entry.capacity) | metrics,
        tags={k: str(v) for k, v in tags.items() if v},
        artifacts={k: v for k, v in arts.items() if v is not None},
        error=error,
    )


def reconcile(tracker, study, config, budget_of=None) -> int:
    """Give every finished trial one finished run: half-written (RUNNING) runs are deleted
    and written again from the study's record (with the plan's budget when `budget_of` gives
    it; what only the worker returned, the per-example table, is not in the record);
    returns how many runs were written."""
    import optuna

    from tenantq.quant.plan import QuantPlan
    from tenantq.tracking import flatten_plan

    S = optuna.trial.TrialState
    runs = tracker.trial_runs(with_status=True)
    written = 0
    for t in study.get_trials(deepcopy=False, states=(S.COMPLETE, S.FAIL)):
        have = runs.get(t.number, [])
        if any(status in DONE_STATUSES for _, status in have):
            for run_id, status in have:  # a finished run exists: drop half-written extras
                if status not in DONE_STATUSES:
                    tracker.delete_run(run_id)
            continue
        for run_id, _ in have:
            tracker.delete_run(run_id)
        attrs = t.user_attrs
        params: dict[str, Any] = {f"space.{k}": v for k, v in t.params.items()}
        plan = QuantPlan.from_json(attrs["plan"]) if "plan" in attrs else None
        if plan is not None:
            params |= flatten_plan(plan, config)
        summary = attrs.get("summary", {})
        metrics = {k: v for k, v in summary.items() if isinstance(v, int | float)}
        entry = Entry(number=t.number, trial=t, plan=plan, params=params)
        entry.plan_json = attrs.get("plan")
        if plan is not None and budget_of is not None:
            with contextlib.suppress(ValueError):  # a plan the model cannot take has none
                entry.budget = budget_of(plan)
        entry.capacity = dict(attrs.get("capacity", {}))
        entry.worker = attrs.get("worker")
        entry.duplicate_of = attrs.get("duplicate_of")
        if t.state == S.FAIL:
            entry.outcome = "failed"
            entry.reason = attrs.get("failure_reason", "driver_died")
            entry.error = attrs.get(
                "error", "the driver running this trial stopped (stale heartbeat)"
            )
        log_entry(
            tracker,
            entry,
            config,
            metrics=metrics,
            tags={"tenantq.logged_on_resume": "true"},
            artifacts={},
        )
        written += 1
    return written
