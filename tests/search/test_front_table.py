"""The front's rows and its plain-text table, character for character: what a reader of
`tenantq search` sees at the end of a study (search/pareto.py)."""

from __future__ import annotations

import math

import optuna

from tenantq.search.pareto import front_rows, quality_with_ci, render_front, verdict_text
from tenantq.search.spec import ObjectiveSpec

OBJ = [
    ObjectiveSpec(metric="tenants", direction="maximize"),
    ObjectiveSpec(metric="kl", direction="minimize"),
    ObjectiveSpec(metric="flips", direction="minimize"),
]


def _trial(number, tenants, summary, *, constraints=(-1.0,), fp=None, **attrs):
    t = optuna.trial.create_trial(
        values=[tenants, 0.0, 0.0],
        user_attrs={
            **({"plan_fingerprint": fp} if fp else {}),
            "capacity": {"capacity.tenants": tenants},
            "summary": summary,
            **attrs,
        },
        system_attrs={f"constraints:c{i}": c for i, c in enumerate(constraints)},
    )
    t.number = number
    return t


def test_a_quality_figure_keeps_its_ci_only_when_both_bounds_are_numbers() -> None:
    summary = {"kl": 0.5, "kl.ci_low": 0.25, "kl.ci_high": 1, "f": 2, "f.ci_low": True}
    assert quality_with_ci(summary, "kl") == (0.5, 0.25, 1.0)
    assert quality_with_ci(summary, "f") == (2.0, None, None)  # a bool is not a bound
    value, lo, hi = quality_with_ci({}, "kl")
    assert math.isnan(value) and lo is None and hi is None
    assert quality_with_ci({"kl": 1, "kl.ci_high": "3"}, "kl") == (1.0, None, None)


def test_verdicts_are_listed_by_metric_without_their_prefix() -> None:
    summary = {"verdict.z": "worse", "kl": 1.0, "verdict.a": "non-inferior", "xverdict.b": "?"}
    assert verdict_text(summary) == "a=non-inferior, z=worse"
    assert verdict_text({}) == ""


def test_rows_read_the_trial_attributes_and_fall_back_when_they_are_missing() -> None:
    full = _trial(
        4, 24, {"kl": 0.1}, fp="abc", weights_summary="int4 mlp", kv_summary="fp8 K/V",
        plan='{"rules": []}', constraints=(-1.0, 0.0),
    )  # fmt: skip
    bare = optuna.trial.create_trial(values=[1.0, 0.0, 0.0])
    bare.number = 7
    infeasible = _trial(9, 24, {}, fp="def", constraints=(-1.0, 0.01))
    rows = front_rows([bare, infeasible, full], OBJ)
    assert [r.trial for r in rows] == [4, 9, 7]  # most tenants first, then trial number
    r = rows[0]
    assert (r.fingerprint, r.tenants, r.weights, r.kv) == ("abc", 24, "int4 mlp", "fp8 K/V")
    assert r.plan_json == '{"rules": []}' and r.feasible  # a constraint of exactly 0 is met
    assert set(r.quality) == {"kl", "flips"}  # the capacity objective is not a quality figure
    assert r.confirmed == {} and r.confirmed_feasible is None and r.confirmed_error == ""
    assert not rows[1].feasible
    b = rows[2]
    assert (b.fingerprint, b.tenants, b.weights, b.kv, b.plan_json) == ("7", 0, "", "", "{}")
    assert b.verdicts == "" and math.isnan(b.quality["kl"][0])


def test_the_table_without_confirmation() -> None:
    rows = front_rows(
        [
            _trial(
                0,
                16,
                {"kl": 0.0, "flips": 0.125, "verdict.kl": "non-inferior"},
                fp="a",
                weights_summary="bf16",
                kv_summary="bf16",
            ),
            _trial(
                3,
                40,
                {"kl": 0.0123456, "kl.ci_low": 0.01, "kl.ci_high": 0.015},
                fp="b",
                weights_summary="int4",
                kv_summary="fp8",
                constraints=(0.5,),
            ),
        ],  # fmt: skip
        OBJ,
    )
    assert render_front(rows, OBJ).splitlines() == [
        "trial  tenants  kl [CI]                flips [CI]  shippable  weights  KV",
        "-" * 73,
        "3      40       0.01235 [0.01, 0.015]  nan         no         int4     fp8",
        "0      16       0                      0.125       yes        bf16     bf16",
        "",
        "verdicts:",
        "  trial 0: kl=non-inferior",
    ]


def test_the_table_with_confirmed_figures_and_a_confirmation_that_could_not_run() -> None:
    rows = front_rows(
        [_trial(0, 16, {"kl": 0.0, "flips": 0.0}, fp="a", weights_summary="w", kv_summary="k"),
         _trial(1, 40, {"kl": 0.5, "flips": 0.0}, fp="b", weights_summary="w", kv_summary="k"),
         _trial(2, 30, {"kl": 0.2, "flips": 0.0}, fp="c", weights_summary="w", kv_summary="k")],
        OBJ,
    )  # fmt: skip
    by = {r.trial: r for r in rows}
    by[1].confirmed = {"kl": (0.25, 0.125, 0.375), "flips": (0.0, None, None)}
    by[1].confirmed_feasible = False
    by[0].confirmed = {"kl": (0.0, None, None)}
    by[0].confirmed_feasible = True
    by[2].confirmed_error = "RuntimeError: worker lost"
    assert render_front(rows, OBJ).splitlines() == [
        "trial  tenants  kl [CI]  confirmed kl [CI]    flips [CI]  confirmed flips [CI]  "
        "shippable  confirmed  weights  KV",
        "-" * 113,
        "1      40       0.5      0.25 [0.125, 0.375]  0           0                     "
        "yes        no         w        k",
        "2      30       0.2      -                    0           -                     "
        "yes        -          w        k",
        "0      16       0        0                    0           -                     "
        "yes        yes        w        k",
        "",
        "confirmation could not run (search-time figures shown):",
        "  trial 2: RuntimeError: worker lost",
    ]


def test_a_confirmation_error_alone_adds_the_confirmed_columns() -> None:
    rows = front_rows([_trial(0, 16, {"kl": 0.0, "flips": 0.0}, fp="a")], OBJ)
    rows[0].confirmed_error = "ValueError: bad suite"
    head = render_front(rows, OBJ).splitlines()[0]
    assert "confirmed kl [CI]" in head and "confirmed flips [CI]" in head


def test_a_repeated_plan_keeps_its_first_trial_and_later_plans_still_count() -> None:
    trials = [_trial(n, 8 * (n + 1), {"kl": 0.0}, fp=fp) for n, fp in enumerate("aab")]
    rows = front_rows(list(reversed(trials)), OBJ)  # any order in, trial order decides
    assert [(r.trial, r.fingerprint) for r in rows] == [(2, "b"), (0, "a")]


def test_a_figure_with_one_bound_only_is_shown_without_an_interval() -> None:
    rows = front_rows([_trial(0, 16, {"kl": 0.5, "kl.ci_low": 0.25, "flips": 0.0})], OBJ)
    assert rows[0].quality["kl"] == (0.5, 0.25, None)
    assert render_front(rows, OBJ).splitlines()[2].split()[:4] == ["0", "16", "0.5", "0"]


def test_an_empty_front_says_why_in_one_line() -> None:
    assert render_front([], OBJ) == (
        "Pareto front: empty (no completed trial met every constraint)"
    )
