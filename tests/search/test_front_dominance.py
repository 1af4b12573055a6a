"""The front's dominance checks against a brute-force reference, ties included.

Pareto dominance (minimising every objective after flipping the maximised ones): a dominates
b when a is no worse on every objective and strictly better on at least one. Two rows with
identical figures therefore do not dominate each other; both stay on the front. The fronts
below are random and drawn from a few values per objective so ties are common.
"""

from __future__ import annotations

import random

import optuna
import pytest

from tenantq.search.front import confirmed_front, own_best_trials
from tenantq.search.ledger import COPIED_ATTR
from tenantq.search.pareto import FrontRow
from tenantq.search.spec import ObjectiveSpec

OBJ = [
    ObjectiveSpec(metric="tenants", direction="maximize"),
    ObjectiveSpec(metric="fidelity.kl_mean", direction="minimize"),
    ObjectiveSpec(metric="needles.accuracy", direction="maximize"),
]


def _dominates(a: list[float], b: list[float]) -> bool:
    """Reference: a <= b everywhere and a < b somewhere (all objectives minimised)."""
    return all(x <= y for x, y in zip(a, b, strict=True)) and any(
        x < y for x, y in zip(a, b, strict=True)
    )


def _reference_front(vectors: dict[int, list[float]]) -> set[int]:
    return {
        i
        for i, v in vectors.items()
        if not any(_dominates(w, v) for j, w in vectors.items() if j != i)
    }


def _row(rng: random.Random, trial: int) -> FrontRow:
    quality = {
        "fidelity.kl_mean": (rng.choice([0.0, 0.01, 0.02]), None, None),
        "needles.accuracy": (rng.choice([0.9, 1.0]), None, None),
    }
    row = FrontRow(
        trial=trial, fingerprint=f"p{trial}", tenants=rng.choice([8, 16, 24]), quality=quality,
        feasible=True, verdicts="", weights="", kv="", plan_json="{}",
    )  # fmt: skip
    state = rng.choice(["confirmed", "failed gate", "could not run", "not confirmed"])
    if state in ("confirmed", "failed gate"):
        row.confirmed = {
            "fidelity.kl_mean": (rng.choice([0.0, 0.01, 0.02]), None, None),
            "needles.accuracy": (rng.choice([0.9, 1.0]), None, None),
        }
        row.confirmed_feasible = state == "confirmed"
    elif state == "could not run":
        row.confirmed_error = "RuntimeError: worker lost"
    return row


def _minimised(row: FrontRow) -> list[float]:
    figures = row.confirmed or row.quality
    return [
        -float(row.tenants),
        figures["fidelity.kl_mean"][0],
        -figures["needles.accuracy"][0],
    ]


def test_rows_with_identical_figures_both_stay_on_the_confirmed_front() -> None:
    rows = [
        FrontRow(
            trial=n,
            fingerprint=f"p{n}",
            tenants=16,
            quality={"fidelity.kl_mean": (0.01, None, None), "needles.accuracy": (1.0, None, None)},
            feasible=True,
            verdicts="",
            weights="",
            kv="",
            plan_json="{}",
        )  # fmt: skip
        for n in (3, 7)
    ]
    assert [r.trial for r in confirmed_front(rows, OBJ)] == [3, 7]


@pytest.mark.parametrize("seed", range(40))
def test_confirmed_front_matches_brute_force_dominance(seed: int) -> None:
    rng = random.Random(seed)
    rows = [_row(rng, n) for n in range(rng.randint(1, 9))]
    kept = confirmed_front(rows, OBJ)
    # Rows that failed their confirmation gate leave; the rest are judged among themselves.
    candidates = {r.trial: _minimised(r) for r in rows if r.confirmed_feasible is not False}
    assert {r.trial for r in kept} == _reference_front(candidates)
    assert [r.trial for r in kept] == sorted(r.trial for r in kept)  # the input order stays


def _frozen(number: int, values: list[float], *, copied: bool = False, constraint: float = -1.0):
    t = optuna.trial.create_trial(
        values=values,
        user_attrs={COPIED_ATTR: 99} if copied else {},
        system_attrs={"constraints:fidelity.kl_mean": constraint},
    )
    t.number = number
    return t


@pytest.mark.parametrize("seed", range(15))
def test_own_front_after_a_continue_as_copy_matches_brute_force_dominance(seed: int) -> None:
    """With copied trials in the study, the driver computes the front itself: it must agree
    with dominance on the study's own feasible trials (copied and infeasible ones left out)."""
    rng = random.Random(seed)
    study = optuna.create_study(directions=["maximize", "minimize"])
    study.add_trial(_frozen(0, [64.0, 0.0], copied=True))  # would dominate everything
    own: dict[int, list[float]] = {}
    for n in range(1, rng.randint(2, 10)):
        values = [float(rng.choice([8, 16, 24])), rng.choice([0.0, 0.01, 0.02])]
        feasible = rng.random() < 0.8
        study.add_trial(_frozen(n, values, constraint=-1.0 if feasible else 1.0))
        if feasible:
            own[n] = [-values[0], values[1]]
    got = {t.number for t in own_best_trials(study)}
    assert got == _reference_front(own)


def test_trials_with_identical_figures_both_stay_on_the_own_front() -> None:
    """Equal values do not dominate each other (the front keeps every trial of a front plan),
    and a constraint of exactly 0 is feasible (Optuna's `<= 0`)."""
    study = optuna.create_study(directions=["maximize", "minimize"])
    study.add_trial(_frozen(0, [16.0, 0.01]))
    study.add_trial(_frozen(1, [16.0, 0.01], constraint=0.0))
    study.add_trial(_frozen(2, [16.0, 0.02]))  # dominated by both: worse on one, equal on one
    study.add_trial(_frozen(3, [8.0, 0.01]))  # dominated by both the same way
    study.add_trial(_frozen(4, [24.0, 0.0], constraint=0.5))  # would dominate: infeasible
    assert [t.number for t in own_best_trials(study)] == [0, 1]


def test_the_own_front_is_the_studys_own_complete_trials_in_trial_order() -> None:
    """The front comes back in trial-number order (not value order), as the study's own
    trial objects (`get_trials(deepcopy=False)`, not copies), with only COMPLETE trials
    judged: a failed or running trial has no values and is left out."""
    study = optuna.create_study(directions=["minimize", "maximize"])
    study.add_trial(_frozen(0, [3.0, 3.0]))
    study.add_trial(_frozen(1, [1.0, 1.0]))
    study.add_trial(_frozen(2, [2.0, 2.0]))
    study.add_trial(_frozen(3, [0.0, 0.0], constraint=0.0))
    study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL))
    study.ask()  # running
    got = own_best_trials(study)
    assert [t.number for t in got] == [0, 1, 2, 3]
    own = {t.number: t for t in study.get_trials(deepcopy=False)}
    assert all(t is own[t.number] for t in got)
    assert [t.values for t in got] == [[3.0, 3.0], [1.0, 1.0], [2.0, 2.0], [0.0, 0.0]]


@pytest.mark.parametrize("direction", ["minimize", "maximize"])
def test_the_own_front_orders_figures_up_to_the_largest_floats(direction: str) -> None:
    """The sweep only flips the sign of a maximised value: figures near the largest float
    (1.797e308) stay distinct and ordered, nothing is scaled into infinity."""
    better, worse = (1.0e308, 1.5e308) if direction == "minimize" else (1.5e308, 1.0e308)
    study = optuna.create_study(directions=[direction, "minimize"])
    study.add_trial(_frozen(0, [worse, 0.0]))
    study.add_trial(_frozen(1, [better, 0.0]))
    assert [t.number for t in own_best_trials(study)] == [1]
