"""The plans shipped under experiments/plans load, and every rule in them takes effect."""

from __future__ import annotations

from pathlib import Path

import pytest

from tenantq.capacity import get_model_config
from tenantq.quant.plan import QuantPlan

PLANS = sorted((Path(__file__).resolve().parents[1] / "experiments" / "plans").glob("*.*"))


def test_there_are_plans() -> None:
    assert PLANS, "experiments/plans is empty"


@pytest.mark.parametrize("path", PLANS, ids=lambda p: p.name)
@pytest.mark.parametrize("model", ["llama-3.1-8b", "qwen3-8b"])
def test_plan_loads_and_has_no_unused_rules(path: Path, model: str) -> None:
    plan = QuantPlan.load(path)
    assert plan.unused_rules(get_model_config(model)) == []
    # Round trip through the other serialisation keeps the plan (and its hash) identical.
    again = QuantPlan.from_toml(plan.to_toml()) if path.suffix == ".json" else plan
    assert QuantPlan.from_json(again.to_json()).fingerprint() == plan.fingerprint()
