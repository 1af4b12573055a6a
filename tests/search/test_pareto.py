"""The front table: one row per plan, CIs beside values, confirmed figures side by side."""

from __future__ import annotations

import math
import warnings

import optuna
import pytest

from tenantq.search.driver import _confirmed_front
from tenantq.search.pareto import front_rows, render_front
from tenantq.search.spec import ObjectiveSpec

OBJ = [
    ObjectiveSpec(metric="tenants", direction="maximize"),
    ObjectiveSpec(metric="fidelity.kl_mean", direction="minimize"),
]


def _trial(number: int, tenants: int, kl: float, fp: str, constraint: float = -1.0):
    t = optuna.trial.create_trial(
        values=[tenants, kl],
        user_attrs={
            "plan_fingerprint": fp,
            "capacity": {"capacity.tenants": tenants},
            "summary": {
                "fidelity.kl_mean": kl,
                "fidelity.kl_mean.ci_low": kl * 0.9,
                "fidelity.kl_mean.ci_high": kl * 1.1,
                "verdict.fidelity.kl_mean": "no detectable change",
            },
            "weights_summary": "int4",
            "kv_summary": "bf16",
            "plan": "{}",
        },
        system_attrs={"constraints:fidelity.kl_mean": constraint},
    )
    t.number = number
    return t


def test_rows_one_per_plan_most_tenants_first() -> None:
    rows = front_rows(
        [_trial(2, 40, 0.02, "b"), _trial(0, 16, 0.0, "a"), _trial(3, 40, 0.02, "b")], OBJ
    )
    assert [(r.trial, r.tenants) for r in rows] == [(2, 40), (0, 16)]  # trial 3 repeats plan b
    text = render_front(rows, OBJ)
    assert "0.02 [0.018, 0.022]" in text and "shippable" in text
    assert "confirmed" not in text.splitlines()[0]


def test_confirmation_drops_rows_that_fail_or_become_dominated() -> None:
    rows = front_rows(
        [_trial(0, 16, 0.0, "a"), _trial(1, 40, 0.002, "b"), _trial(2, 30, 0.001, "c")], OBJ
    )
    by = {r.trial: r for r in rows}
    by[0].confirmed, by[0].confirmed_feasible = {"fidelity.kl_mean": (0.0, 0.0, 0.0)}, True
    # Trial 1 fails its gate on fresh examples: the winner's curse; it leaves the front.
    by[1].confirmed, by[1].confirmed_feasible = {"fidelity.kl_mean": (0.02, 0.01, 0.03)}, False
    # Trial 2 confirms worse than trial 0 at fewer... no: more tenants, so it stays.
    by[2].confirmed, by[2].confirmed_feasible = {"fidelity.kl_mean": (0.003, 0.002, 0.004)}, True
    kept = _confirmed_front(rows, OBJ)
    assert [r.trial for r in kept] == [2, 0]
    text = render_front(kept, OBJ)
    assert "confirmed fidelity.kl_mean [CI]" in text.splitlines()[0]
    assert "0.003 [0.002, 0.004]" in text


def test_empty_front_says_why() -> None:
    assert "no completed trial met every constraint" in render_front([], OBJ)


def test_a_row_whose_confirmation_could_not_run_stays_on_search_figures() -> None:
    rows = front_rows([_trial(0, 16, 0.0, "a"), _trial(1, 40, 0.002, "b")], OBJ)
    by = {r.trial: r for r in rows}
    by[0].confirmed, by[0].confirmed_feasible = {"fidelity.kl_mean": (0.0, 0.0, 0.0)}, True
    by[1].confirmed_error = "ValueError: suite file broken"
    kept = _confirmed_front(rows, OBJ)
    assert [r.trial for r in kept] == [1, 0]
    text = render_front(kept, OBJ)
    assert "confirmation could not run" in text and "suite file broken" in text


def _dominance_reference(study) -> set[int]:
    """Brute force: the complete, feasible, own trials no other such trial dominates (no worse
    in every objective, better in one), each direction taken as it is written."""
    import optuna

    from tenantq.search.ledger import COPIED_ATTR

    minimize = [d == optuna.study.StudyDirection.MINIMIZE for d in study.directions]
    pool = [
        t
        for t in study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
        if COPIED_ATTR not in t.user_attrs and all(v <= 0 for v in (t.constraints or {}).values())
    ]

    def no_worse(a: float, b: float, low: bool) -> bool:
        return a <= b if low else a >= b

    def dominates(a, b) -> bool:
        pairs = list(zip(a.values, b.values, minimize, strict=True))
        return all(no_worse(x, y, lo) for x, y, lo in pairs) and any(x != y for x, y, _ in pairs)

    return {b.number for b in pool if not any(dominates(a, b) for a in pool)}


@pytest.mark.parametrize("seed", range(12))
def test_the_front_is_exactly_the_non_dominated_feasible_own_trials(seed: int) -> None:
    # The front's one-pass sweep (search.front.own_best_trials) replaced Optuna's
    # best_trials; it must give exactly the brute-force non-dominated set on studies with
    # ties, infinities, NaN (Optuna fails such a tell), FAIL trials, infeasible and copied
    # trials, in mixed directions.
    import random

    import optuna

    from tenantq.search.front import own_best_trials
    from tenantq.search.ledger import COPIED_ATTR

    rng = random.Random(seed)
    dims = rng.choice([1, 2, 3])
    directions = [rng.choice(["minimize", "maximize"]) for _ in range(dims)]
    study = optuna.create_study(directions=directions)
    choices = [0.0, 1.0, 2.0, 2.0, 3.0, math.inf, -math.inf, math.nan]
    copied_any = False
    for _ in range(rng.randint(0, 40)):
        t = study.ask()
        feasible = rng.random() < 0.8
        t.set_constraint("gate", 0.0 if feasible else rng.choice([1.0, math.inf]))
        if rng.random() < 0.1:
            t.set_user_attr(COPIED_ATTR, "old")
            copied_any = True
        if rng.random() < 0.1:
            study.tell(t, state=optuna.trial.TrialState.FAIL)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                study.tell(t, [rng.choice(choices) for _ in range(dims)])  # NaN -> FAIL
    got = [t.number for t in own_best_trials(study)]
    assert got == sorted(set(got))  # once each, in trial order
    assert set(got) == _dominance_reference(study)
    if not copied_any:  # and Optuna's own answer where it applies
        assert set(got) == {t.number for t in study.best_trials}
