"""The confirmed front (search/front.py): which rows count as confirmed, tagging, the export.

Confirmation re-measures each front row on the held-out suite. A row counts as confirmed
when its worker returned a summary: its confirmed figures (`quality_with_ci` of that summary)
replace the search-time ones in the dominance check, and it stays only while its confirmed
constraints are all <= 0 (0 included: Optuna's feasibility). A row whose worker failed keeps
its search-time figures and carries the error line. Measured figures are kept in the study
(user attr `tenantq.confirmed`), so a resume submits only the rows not measured yet. The
expected fronts come from a brute-force dominance check written here (a dominates b: no
worse anywhere, strictly better somewhere, all objectives minimised after flipping the
maximised ones).
"""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import optuna
import pytest

from tenantq.search.front import (
    CONFIRMED_ATTR,
    POLL_S,
    clear_export,
    confirm,
    export,
    front,
    tag_front,
)
from tenantq.search.objectives import CapacityObjective
from tenantq.search.pareto import FrontRow
from tenantq.search.spec import ObjectiveSpec

OBJ = [
    ObjectiveSpec(metric="tenants", direction="maximize"),
    ObjectiveSpec(metric="fidelity.kl_mean", direction="minimize"),
]
SUITE = "held-out"


def _spec(suite: str | None = SUITE, objectives=OBJ, constraints=None):
    return SimpleNamespace(
        objectives=objectives, constraints=constraints, eval=SimpleNamespace(confirm_suite=suite)
    )


class _Pool:
    """A pool of `workers` stand-in workers: `outcomes` maps a trial to the summary and gates
    its confirmation returns, or to the exception it raises. Each `wait` hands back the
    oldest submission; submitting with no idle worker is an error, as in WorkerPool."""

    def __init__(self, outcomes: dict, workers: int = 1) -> None:
        self.outcomes, self.workers = outcomes, workers
        self.submitted: list[tuple] = []
        self.waits: list[float] = []
        self._running: list[tuple] = []

    @property
    def idle(self) -> int:
        return self.workers - len(self._running)

    @property
    def in_flight(self) -> int:
        return len(self._running)

    def submit(self, key, plan_json, suite=None, split="search"):
        if not self.idle:
            raise RuntimeError("no idle worker")
        self.submitted.append((key, plan_json, suite, split))
        self._running.append(key)

    def wait(self, timeout_s):
        self.waits.append(timeout_s)
        if not self._running:
            return []
        key = self._running.pop(0)
        got = self.outcomes[key[1]]
        if isinstance(got, BaseException):
            return [SimpleNamespace(key=key, result=None, error=got)]
        summary, gates = got
        result = SimpleNamespace(summary=summary, gates=gates)
        return [SimpleNamespace(key=key, result=result, error=None)]


def _row(trial: int, tenants: int, kl: float) -> FrontRow:
    return FrontRow(
        trial=trial, fingerprint=f"fp{trial}", tenants=tenants,
        quality={"fidelity.kl_mean": (kl, kl - 0.01, kl + 0.01)}, feasible=True, verdicts="",
        weights="", kv="", plan_json=f'{{"plan": {trial}}}',
    )  # fmt: skip


def _measured(kl: float, constraint: float, verdict: str = "pass"):
    summary = {
        "fidelity.kl_mean": kl,
        "fidelity.kl_mean.ci_low": kl - 0.02,
        "fidelity.kl_mean.ci_high": kl + 0.02,
        "verdict.fidelity": verdict,
    }
    return summary, {"fidelity": {"constraint": constraint}}


def test_measured_rows_are_confirmed_failed_ones_keep_their_search_figures() -> None:
    study = optuna.create_study(directions=["maximize", "minimize"])
    # four rows none of which dominates another, before or after confirmation
    rows = [_row(1, 40, 0.4), _row(2, 30, 0.3), _row(3, 20, 0.2), _row(4, 10, 0.1)]
    pool = _Pool(
        {
            1: _measured(0.5, -0.25),
            2: RuntimeError("worker lost"),
            3: _measured(0.25, 0.5, "fail"),  # over its gate: leaves the front
            4: _measured(0.125, 0.0),  # exactly on its gate: feasible
        }
    )
    kept = confirm(study, _spec(), pool, rows)
    # submitted in the front's order, one at a time, on the confirmation suite and split
    assert pool.submitted == [
        (("confirm", n), f'{{"plan": {n}}}', SUITE, "confirm") for n in (1, 2, 3, 4)
    ]
    assert pool.waits and set(pool.waits) == {POLL_S}
    assert [r.trial for r in kept] == [1, 2, 4]
    one, two, four = kept
    assert one.confirmed == {"fidelity.kl_mean": (0.5, 0.48, 0.52)}
    assert one.confirmed_feasible is True and one.confirmed_verdicts == "fidelity=pass"
    assert one.confirmed_error == ""
    assert four.confirmed == {"fidelity.kl_mean": (0.125, 0.105, 0.145)}
    assert four.confirmed_feasible is True and four.confirmed_error == ""
    # the failed row: no figures, its search-time ones stand, the error shown
    assert two.confirmed == {} and two.confirmed_feasible is None
    assert two.confirmed_verdicts == "" and two.confirmed_error == "RuntimeError: worker lost"
    assert two.quality == {"fidelity.kl_mean": (0.3, 0.29, 0.31)}
    # the dropped row was measured too
    assert rows[2].confirmed_feasible is False and rows[2].confirmed_verdicts == "fidelity=fail"
    # the study keeps what was measured (the failure is not stored: a resume tries again)
    stored = study.user_attrs[CONFIRMED_ATTR]
    assert stored == {
        "1": {"summary": _measured(0.5, -0.25)[0], "constraints": {"fidelity": -0.25}},
        "3": {"summary": _measured(0.25, 0.5, "fail")[0], "constraints": {"fidelity": 0.5}},
        "4": {"summary": _measured(0.125, 0.0)[0], "constraints": {"fidelity": 0.0}},
    }


def test_spec_constraints_judge_the_confirmed_figures() -> None:
    from tenantq.search.spec import ConstraintSpec

    spec = _spec(constraints=[ConstraintSpec(metric="fidelity.kl_mean", tolerance=0.5)])
    study = optuna.create_study(directions=["maximize", "minimize"])
    rows = [_row(1, 20, 0.2), _row(2, 10, 0.1)]
    # ci_high 0.52 - 0.5 > 0: infeasible; 0.12 - 0.5 <= 0: feasible (the gates are not read)
    pool = _Pool({1: _measured(0.5, -1.0), 2: _measured(0.1, 1.0)}, workers=2)
    kept = confirm(study, spec, pool, rows)
    assert [r.trial for r in kept] == [2]
    assert study.user_attrs[CONFIRMED_ATTR]["1"]["constraints"] == {
        "fidelity.kl_mean": pytest.approx(0.02)
    }


def test_a_resume_submits_only_the_rows_not_measured_yet() -> None:
    study = optuna.create_study(directions=["maximize", "minimize"])
    rows = [_row(1, 20, 0.2), _row(2, 10, 0.1)]
    confirm(study, _spec(), _Pool({1: _measured(0.25, -1.0), 2: RuntimeError("lost")}), rows)
    again = [_row(1, 20, 0.2), _row(2, 10, 0.1)]
    pool = _Pool({2: _measured(0.125, -1.0)})
    kept = confirm(study, _spec(), pool, again)
    assert pool.submitted == [(("confirm", 2), '{"plan": 2}', SUITE, "confirm")]
    assert [r.confirmed["fidelity.kl_mean"][0] for r in kept] == [0.25, 0.125]
    assert [r.confirmed_error for r in kept] == ["", ""]
    # everything measured: nothing is submitted, the stored figures are used
    third = [_row(1, 20, 0.2), _row(2, 10, 0.1)]
    idle = _Pool({}, workers=0)
    kept = confirm(study, _spec(), idle, third)
    assert idle.submitted == [] and [r.confirmed_feasible for r in kept] == [True, True]
    assert sorted(study.user_attrs[CONFIRMED_ATTR]) == ["1", "2"]


def test_an_entry_without_a_summary_is_measured_again() -> None:
    study = optuna.create_study(directions=["maximize", "minimize"])
    study.set_user_attr(CONFIRMED_ATTR, {"1": {"constraints": {}}})
    pool = _Pool({1: _measured(0.25, -1.0)})
    kept = confirm(study, _spec(), pool, [_row(1, 20, 0.2)])
    assert [s[0] for s in pool.submitted] == [("confirm", 1)]
    assert kept[0].confirmed == {"fidelity.kl_mean": (0.25, 0.23, 0.27)}


def test_a_row_dominated_on_its_confirmed_figures_leaves_the_front() -> None:
    # At search time 2 (fewer tenants, lower KL) and 1 are both on the front; confirmed,
    # 2's KL is above 1's: 1 dominates it. A row confirmed worse but not dominated stays.
    study = optuna.create_study(directions=["maximize", "minimize"])
    rows = [_row(1, 20, 0.2), _row(2, 10, 0.1), _row(3, 5, 0.05)]
    pool = _Pool({1: _measured(0.25, -1.0), 2: _measured(0.5, -1.0), 3: _measured(0.125, -1.0)})
    assert [r.trial for r in confirm(study, _spec(), pool, rows)] == [1, 3]


def test_a_failed_row_is_judged_on_its_search_figures_against_confirmed_ones() -> None:
    study = optuna.create_study(directions=["maximize", "minimize"])
    rows = [_row(1, 20, 0.2), _row(2, 10, 0.3)]  # 2 is dominated by 1 at search time
    kept = confirm(study, _spec(), _Pool({1: _measured(0.4, -1.0), 2: ValueError("x")}), rows)
    # confirmed, 1's KL is 0.4: 2's search-time 0.3 is no longer dominated
    assert [(r.trial, r.confirmed_error) for r in kept] == [(1, ""), (2, "ValueError: x")]


def _dominates(a: list[float], b: list[float]) -> bool:
    return all(x <= y for x, y in zip(a, b, strict=True)) and any(
        x < y for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("seed", range(25))
def test_the_confirmed_front_matches_brute_force_dominance(seed: int) -> None:
    """Random fronts and outcomes (few distinct values, so ties are common): the rows kept are
    exactly the feasible-or-unmeasured rows that no other such row dominates, judged on the
    confirmed figures where measured and the search-time ones where not."""
    rng = random.Random(seed)
    objectives = [*OBJ, ObjectiveSpec(metric="needles.accuracy", direction="maximize")]
    rows, outcomes, expected_vectors = [], {}, {}
    for n in range(rng.randint(1, 8)):
        kl, acc = rng.choice([0.1, 0.2]), rng.choice([0.5, 1.0])
        tenants = rng.choice([8, 16])
        row = _row(n, tenants, kl)
        row.quality["needles.accuracy"] = (acc, None, None)
        rows.append(row)
        what = rng.choice(["ok", "ok", "infeasible", "error"])
        if what == "error":
            outcomes[n] = RuntimeError("lost")
            expected_vectors[n] = [-tenants, kl, -acc]
            continue
        ckl, cacc = rng.choice([0.1, 0.2]), rng.choice([0.5, 1.0])
        summary, gates = _measured(ckl, 1.0 if what == "infeasible" else rng.choice([0.0, -1.0]))
        summary["needles.accuracy"] = cacc
        outcomes[n] = (summary, gates)
        if what == "ok":
            expected_vectors[n] = [-tenants, ckl, -cacc]
    pool = _Pool(outcomes, workers=rng.randint(1, 3))
    study = optuna.create_study(directions=["maximize", "minimize", "maximize"])
    kept = confirm(study, _spec(objectives=objectives), pool, rows)
    expected = [
        n
        for n, v in expected_vectors.items()
        if not any(_dominates(w, v) for m, w in expected_vectors.items() if m != n)
    ]
    assert [r.trial for r in kept] == expected
    assert sorted(s[0][1] for s in pool.submitted) == list(range(len(rows)))


def _trial(number: int, tenants: int, at_slo: int, kl: float, constraint: float = -1.0):
    t = optuna.trial.create_trial(
        values=[float(at_slo), kl],
        user_attrs={
            "plan_fingerprint": f"fp{number}",
            "capacity": {"capacity.tenants": tenants, "capacity.tenants_at_slo": at_slo},
            "summary": {"fidelity.kl_mean": kl},
            "plan": f'{{"plan": {number}}}',
        },
        system_attrs={"constraints:fidelity": constraint},
    )
    t.number = number
    return t


def _study():
    study = optuna.create_study(directions=["maximize", "minimize"])
    study.add_trial(_trial(0, 50, 20, 0.2))
    study.add_trial(_trial(1, 40, 10, 0.1))
    study.add_trial(_trial(2, 60, 5, 0.3))  # dominated by 0 at the SLO
    return study


SLO = CapacityObjective("tenants_at_slo", "20tok/s", None, None, 256)


def test_the_front_takes_the_studys_capacity_objective() -> None:
    rows = front(_study(), _spec(suite=None), _Pool({}, workers=0), SLO)
    assert [(r.trial, r.tenants, r.tenants_by_memory) for r in rows] == [(0, 20, 50), (1, 10, 40)]
    assert {r.capacity_label for r in rows} == {"tenants at 20 tok/s"}
    assert all(r.confirmed == {} and r.confirmed_feasible is None for r in rows)


def test_the_front_is_confirmed_when_the_spec_has_a_confirmation_suite() -> None:
    study = _study()
    pool = _Pool({0: _measured(0.25, -1.0), 1: _measured(0.125, -1.0)})
    rows = front(study, _spec(), pool, SLO)
    assert [s[0] for s in pool.submitted] == [("confirm", 0), ("confirm", 1)]
    assert [r.confirmed["fidelity.kl_mean"][0] for r in rows] == [0.25, 0.125]


@pytest.mark.parametrize(
    ("suite", "pool_given"),
    [(None, True), ("", True), (SUITE, False)],
    ids=["no-suite", "empty-suite", "no-pool"],
)
def test_the_front_is_not_confirmed_without_a_suite_or_a_pool(suite, pool_given) -> None:
    pool = _Pool({0: _measured(0.25, -1.0), 1: _measured(0.125, -1.0)})
    rows = front(_study(), _spec(suite=suite), pool if pool_given else None, SLO)
    assert [r.trial for r in rows] == [0, 1] and pool.submitted == []
    assert all(r.confirmed == {} for r in rows)


def test_an_empty_front_asks_no_worker() -> None:
    study = optuna.create_study(directions=["maximize", "minimize"])
    study.add_trial(_trial(0, 50, 20, 0.2, constraint=1.0))  # infeasible: no front
    pool = _Pool({}, workers=0)  # any submission would fail
    assert front(study, _spec(), pool, SLO) == [] and pool.waits == []


class _Tracker:
    def __init__(self, runs: dict[int, str]) -> None:
        self.runs, self.calls = runs, []

    def trial_runs(self) -> dict[int, str]:
        return self.runs

    def tag(self, run_id, key, value) -> None:
        self.calls.append(("tag", run_id, key, value))

    def log_metrics(self, run_id, metrics) -> None:
        self.calls.append(("metrics", run_id, metrics))


def test_front_rows_are_tagged_and_their_confirmed_figures_logged() -> None:
    untracked = _row(2, 30, 0.3)  # no MLflow run (first): skipped, the others still tagged
    untracked.confirmed = {"fidelity.kl_mean": (0.3, None, None)}
    confirmed = _row(1, 20, 0.2)
    confirmed.confirmed = {
        "fidelity.kl_mean": (0.25, 0.2, 0.375),
        "needles.accuracy": (0.75, 0.5, None),  # no upper bound: no ci_high line
    }
    plain = _row(3, 10, 0.1)  # not confirmed: tagged, no metrics
    tracker = _Tracker({1: "run-1", 3: "run-3", 4: "run-4"})
    tag_front(tracker, [untracked, confirmed, plain])
    assert tracker.calls == [
        ("tag", "run-1", "tenantq.pareto", "true"),
        (
            "metrics",
            "run-1",
            {
                "confirmed.fidelity.kl_mean": 0.25,
                "confirmed.needles.accuracy": 0.75,
                "confirmed.fidelity.kl_mean.ci_high": 0.375,
            },
        ),
        ("tag", "run-3", "tenantq.pareto", "true"),
    ]


def test_the_export_holds_exactly_the_current_front(tmp_path) -> None:
    out = tmp_path / "a" / "b"  # not there yet
    first = _row(7, 24, 0.2)
    first.confirmed = {"fidelity.kl_mean": (0.25, 0.2, 0.375)}
    first.confirmed_feasible = True
    first.tenants_by_memory, first.capacity_label = 30, "tenants at 20 tok/s"
    second = _row(12, 16, 0.1)
    second.feasible = False
    export([_row(1, 8, 0.5)], out)  # an earlier front
    (out / "front" / "notes.txt").write_text("kept")
    paths = export([first, second], out)
    folder = out / "front"
    assert paths == [folder / "trial-0007-fp7.json", folder / "trial-0012-fp12.json"]
    assert sorted(p.name for p in folder.iterdir()) == [
        "front.json", "notes.txt", "trial-0007-fp7.json", "trial-0012-fp12.json",
    ]  # fmt: skip
    assert paths[0].read_text() == '{"plan": 7}' and paths[1].read_text() == '{"plan": 12}'
    KL = "fidelity.kl_mean"
    listing = [
        {
            "trial": 7, "fingerprint": "fp7", "tenants": 24, "capacity": "tenants at 20 tok/s",
            "tenants_by_memory": 30, "quality": {"fidelity.kl_mean": [*first.quality[KL]]},
            "confirmed": {"fidelity.kl_mean": [0.25, 0.2, 0.375]}, "shippable": True,
            "confirmed_shippable": True, "plan": {"plan": 7},
        },
        {
            "trial": 12, "fingerprint": "fp12", "tenants": 16, "capacity": "tenants",
            "tenants_by_memory": 0, "quality": {"fidelity.kl_mean": [*second.quality[KL]]},
            "confirmed": {}, "shippable": False, "confirmed_shippable": None,
            "plan": {"plan": 12},
        },
    ]  # fmt: skip
    text = (folder / "front.json").read_text()
    assert json.loads(text) == listing
    assert text == json.dumps(json.loads(text), indent=2)  # indented two spaces


def test_an_empty_front_exports_an_empty_listing(tmp_path) -> None:
    export([_row(1, 8, 0.5)], tmp_path)
    assert export([], tmp_path) == []
    assert sorted(p.name for p in (tmp_path / "front").iterdir()) == ["front.json"]
    assert json.loads((tmp_path / "front" / "front.json").read_text()) == []


def test_clearing_the_export_removes_only_plans_and_the_listing(tmp_path) -> None:
    clear_export(tmp_path)  # no folder yet: nothing to do
    folder = tmp_path / "front"
    export([_row(1, 8, 0.5), _row(2, 4, 0.25)], tmp_path)
    (folder / "notes.txt").write_text("kept")
    clear_export(tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
    clear_export(tmp_path)  # again: nothing left to remove
