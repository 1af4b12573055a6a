"""The suite's own bars, applied to what an evaluation saw: a pass/fail task whose bf16 pass
rate is under `min_baseline_pass_rate` (60% by default, the bar the built-in suites chose
their tasks by) and a gate too tight for its example count are named warnings."""

from __future__ import annotations

import pytest

from tenantq.evals.suite import (
    Suite,
    baseline_pass_warnings,
    load_suite,
    unreachable_gate_warnings,
)


def _suite(**kw) -> Suite:
    return Suite.model_validate({"name": "t", **kw})


def test_task_below_the_pass_rate_bar_is_named_with_its_rate() -> None:
    # close_brackets at 55 of 96 (57%, README "Quality suite") is under 60%; needles at 46 of
    # 48 are not; exactly 60% is not under the bar.
    warned = baseline_pass_warnings(
        _suite(),
        {
            "structured.close_brackets": (55, 96),
            "needle.len1019": (46, 48),
            "needle_vartrack.len1019": (18, 30),
        },  # fmt: skip
    )
    assert list(warned) == ["warning.structured.close_brackets"]
    assert "57% (55 of 96)" in warned["warning.structured.close_brackets"]
    assert "60%" in warned["warning.structured.close_brackets"]


def test_the_pass_rate_bar_is_the_suites_own() -> None:
    assert baseline_pass_warnings(_suite(min_baseline_pass_rate=0.5), {"s.x": (55, 96)}) == {}
    with pytest.raises(ValueError):
        Suite.model_validate({"name": "t", "min_baseline_pass_rate": 1.5})


GATE = {"metric": "needle.acc_delta.len1019", "higher_is_better": True}


def test_gate_tighter_than_no_flips_allows_is_named() -> None:
    # 32 examples and no flip: Tango's lower bound is -z^2 / (32 + z^2) = -0.107; a 5-point
    # tolerance can never be met, a 15-point one can.
    tight = _suite(gates=[{**GATE, "tolerance": 0.05}])
    warned = unreachable_gate_warnings(tight, {"needle.acc_delta.len1019": 32})
    assert list(warned) == ["warning.gate.needle.acc_delta.len1019"]
    assert "0.107" in warned["warning.gate.needle.acc_delta.len1019"]
    loose = _suite(gates=[{**GATE, "tolerance": 0.15}])
    assert unreachable_gate_warnings(loose, {"needle.acc_delta.len1019": 32}) == {}


@pytest.mark.parametrize("name", ["quick", "standard", "long"])
def test_built_in_suites_gates_can_all_pass(name) -> None:
    # each built-in suite's pass/fail gate must be reachable with its own example count
    suite = load_suite(name)
    examples = {}
    for spec in suite.needles:
        for length in spec.lengths:
            task = "needle" if spec.variant == "single" else f"needle_{spec.variant}"
            examples[f"{task}.acc_delta.len{length}"] = spec.per_length
    assert unreachable_gate_warnings(suite, examples) == {}
