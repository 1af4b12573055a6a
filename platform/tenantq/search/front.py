"""The study's end: the Pareto front, confirmed on the held-out suite, tagged and exported.

Confirmation re-measures the front on `eval.confirm_suite` (the winner's curse: the front is
selected on the search suite's noise); figures are stored in the study, so a resume does not
re-measure. The export folder holds exactly the current front: plan files of an earlier study
of the same name, or of an earlier front, are removed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tenantq.model.files import atomic_write_text
from tenantq.search.objectives import constraint_values
from tenantq.search.pareto import FrontRow, front_rows, quality_with_ci, verdict_text
from tenantq.search.spec import CAPACITY_METRICS, ExperimentSpec

CONFIRMED_ATTR = "tenantq.confirmed"  # study user attr: trial number -> confirmed figures
POLL_S = 0.5


def front(study, spec: ExperimentSpec, pool, capacity=None) -> list[FrontRow]:
    """The study's front rows (`capacity`: its `CapacityObjective`, whose value is each
    row's `tenants`), confirmed when the spec has a confirmation suite."""
    rows = front_rows(own_best_trials(study), spec.objectives, capacity)
    if spec.eval.confirm_suite and rows and pool is not None:
        rows = confirm(study, spec, pool, rows)
    return rows


def own_best_trials(study) -> list[Any]:
    """`study.best_trials` (complete, feasible, non-dominated) among the study's own trials:
    those `--continue-as` copied (measured on the old inputs) are left out. Computed on the
    study's trials without copying them (`best_trials` deep-copies every trial of the study).
    Equal values do not dominate each other: every trial of a front plan is kept."""
    from optuna.study import StudyDirection
    from optuna.trial import TrialState

    from tenantq.search.ledger import COPIED_ATTR

    signs = [1.0 if d == StudyDirection.MINIMIZE else -1.0 for d in study.directions]
    keyed = sorted(
        (
            ([s * v for s, v in zip(signs, t.values, strict=True)], t.number, t)
            for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if COPIED_ATTR not in t.user_attrs
            and all(v <= 0 for v in (t.constraints or {}).values())
        ),
        key=lambda k: (k[0], k[1]),
    )
    # In lexicographic order a dominating point comes first, and whatever dominates a point
    # is dominated by (or is) a front member already seen: one pass against the front.
    front: list[tuple[list[float], int, Any]] = []
    for key in keyed:
        b = key[0]
        if not any(all(x <= y for x, y in zip(a, b, strict=True)) and a != b for a, _, _ in front):
            front.append(key)
    return [t for _, _, t in sorted(front, key=lambda k: k[1])]


def tag_front(tracker, rows: list[FrontRow]) -> None:
    runs = tracker.trial_runs()
    for r in rows:
        if r.trial not in runs:
            continue
        tracker.tag(runs[r.trial], "tenantq.pareto", "true")
        if r.confirmed:
            tracker.log_metrics(
                runs[r.trial],
                {f"confirmed.{m}": v[0] for m, v in r.confirmed.items()}
                | {
                    f"confirmed.{m}.ci_high": v[2]
                    for m, v in r.confirmed.items()
                    if v[2] is not None
                },
            )


def confirm(study, spec: ExperimentSpec, pool, rows: list[FrontRow]) -> list[FrontRow]:
    """Re-evaluate the front on the held-out confirmation suite."""
    done: dict[str, Any] = dict(study.user_attrs.get(CONFIRMED_ATTR, {}))
    todo = [r for r in rows if "summary" not in done.get(str(r.trial), {})]
    errors: dict[int, str] = {}
    while todo or pool.in_flight:
        while todo and pool.idle:
            r = todo.pop(0)
            pool.submit(("confirm", r.trial), r.plan_json, spec.eval.confirm_suite, "confirm")
        for finished in pool.wait(POLL_S):
            number = finished.key[1]
            if finished.error is not None:  # shown, not stored: a resume tries again
                errors[number] = f"{type(finished.error).__name__}: {finished.error}"
            else:
                res = finished.result
                done[str(number)] = {
                    "summary": res.summary,
                    "constraints": constraint_values(spec.constraints, res.summary, res.gates),
                }
            study.set_user_attr(CONFIRMED_ATTR, done)
    for r in rows:
        got = done.get(str(r.trial), {})
        if "summary" in got:
            r.confirmed = {m: quality_with_ci(got["summary"], m) for m in r.quality}
            r.confirmed_feasible = all(v <= 0 for v in got["constraints"].values())
            r.confirmed_verdicts = verdict_text(got["summary"])
        r.confirmed_error = errors.get(r.trial, "")
    return confirmed_front(rows, spec.objectives)


def export(rows: list[FrontRow], out_dir: Path) -> list[Path]:
    """The front's plans as `trial-NNNN-FINGERPRINT.json` plus `front.json`; other plan
    files in the folder (an earlier front, an earlier study of the same name) are removed."""
    folder = out_dir / "front"
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for r in rows:
        path = folder / f"trial-{r.trial:04d}-{r.fingerprint}.json"
        atomic_write_text(path, r.plan_json)
        paths.append(path)
    for stale in folder.glob("trial-*.json"):
        if stale not in paths:
            stale.unlink()
    listing = [
        {
            "trial": r.trial,
            "fingerprint": r.fingerprint,
            "tenants": r.tenants,
            "capacity": r.capacity_label,
            "tenants_by_memory": r.tenants_by_memory,
            "quality": r.quality,
            "confirmed": r.confirmed,
            "shippable": r.feasible,
            "confirmed_shippable": r.confirmed_feasible,
            "plan": json.loads(r.plan_json),
        }
        for r in rows
    ]
    atomic_write_text(folder / "front.json", json.dumps(listing, indent=2))
    return paths


def clear_export(out_dir: Path) -> None:
    """A fresh study: no plan file of an earlier study of the same name stays beside it."""
    folder = out_dir / "front"
    for stale in [*folder.glob("trial-*.json"), folder / "front.json"]:
        stale.unlink(missing_ok=True)


def confirmed_front(rows: list[FrontRow], objectives) -> list[FrontRow]:
    """Rows still shippable and non-dominated when judged on their confirmed figures; a row
    whose confirmation could not run stays, judged on its search-time figures."""
    keep = [r for r in rows if r.confirmed_feasible is not False]

    def vector(r: FrontRow) -> list[float]:
        out = []
        for o in objectives:
            figures = r.confirmed or r.quality
            # a row's `tenants` is the study's capacity value, whichever capacity objective
            v = float(r.tenants) if o.metric in CAPACITY_METRICS else figures[o.metric][0]
            out.append(-v if o.direction == "maximize" else v)
        return out

    vecs = {r.trial: vector(r) for r in keep}

    def dominated(a: FrontRow) -> bool:
        va = vecs[a.trial]
        return any(
            all(x <= y for x, y in zip(vecs[b.trial], va, strict=True)) and vecs[b.trial] != va
            for b in keep
            if b is not a
        )

    return [r for r in keep if not dominated(r)]
