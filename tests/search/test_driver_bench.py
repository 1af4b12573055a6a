"""`python -m tenantq.bench driver` runs end to end on a small size (a bench that crashes
with its own arguments has happened here before), and its rows count what the ledger
promises: every trial of the budget is a distinct plan on the per-tensor space."""

from __future__ import annotations

import json

import pytest

from tenantq.bench import driver as bench


@pytest.mark.slow
def test_driver_bench_measures_distinct_plans_and_the_ratio(capsys) -> None:
    assert bench.main(["--trials", "15", "30", "--workers", "1", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["rows"]
    assert {(r["trials"], r["workers"]) for r in rows} == {(15, 1), (30, 1), (15, 3), (30, 3)}
    for r in rows:
        # The budget counts distinct settled plans (issue 22): with instant workers that
        # never fail, every one of the `trials` is a measured, distinct plan.
        assert r["plans"] == r["trials"], r
        assert r["asks"] >= r["plans"]
        assert r["ms_per_trial"] > 0 and r["plan_and_budget_ms"] > 0
    assert set(out["ratios"]) == {"1", "3"}
