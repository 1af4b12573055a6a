"""What a host worker hands back for one plan: the evaluator's gates, every field of each, in
plain Python values (the driver logs them as the trial's `gates.json` and reads `constraint`
from them). The evaluator is a stand-in returning real `Gate`s; no model, no Ray."""

from __future__ import annotations

import dataclasses
import json

import pyarrow as pa

from tenantq.evals import evaluator as ev
from tenantq.evals.suite import FidelitySpec, GateSpec, NeedleSpec, Suite
from tenantq.quant.plan import QuantPlan
from tenantq.search.objectives import constraint_values
from tenantq.workers.host import HostWorker


class _Evaluator:
    def __init__(self, result: ev.EvalResult) -> None:
        self.result = result

    def evaluate(self, plan) -> ev.EvalResult:
        return self.result


def test_a_trials_gates_carry_every_gate_field_higher_is_better_included() -> None:
    suite = Suite(
        name="t",
        fidelity=FidelitySpec(rows=2, row_tokens=64),
        needles=(NeedleSpec(lengths=(64,), per_length=8),),
        gates=(
            GateSpec(metric="fidelity.kl_mean", tolerance=0.01, higher_is_better=False),
            GateSpec(metric="needle.acc_delta.len64", tolerance=0.1, higher_is_better=True),
        ),
    )
    summary = {
        "fidelity.kl_mean": 0.004, "fidelity.kl_mean.ci_low": 0.003,
        "fidelity.kl_mean.ci_high": 0.006,
        "needle.acc_delta.len64": -0.05, "needle.acc_delta.len64.ci_low": -0.08,
        "needle.acc_delta.len64.ci_high": 0.02, "needle.mcnemar_p.len64": 0.04,
    }  # fmt: skip
    gates = ev.gates_for(suite, summary)
    result = ev.EvalResult(summary, gates, pa.table({"task": ["x"]}), {"total": 1.0}, {})
    host = object.__new__(HostWorker)  # the actor's state without loading a model
    host.name, host.default_suite = "w0", "suite.toml"
    host._evaluators = {("suite.toml", "search"): _Evaluator(result)}
    host._load_s = {("suite.toml", "search"): 2.5}

    got = host.evaluate(QuantPlan(rules=()).to_json())

    fields = {f.name for f in dataclasses.fields(ev.Gate)}
    assert set(got.gates) == set(gates)
    for name, gate in gates.items():
        assert set(got.gates[name]) == fields  # every field, none copied by hand and lost
        assert got.gates[name]["higher_is_better"] is gate.higher_is_better
    assert got.gates["needle.acc_delta.len64"]["higher_is_better"] is True
    assert got.gates["fidelity.kl_mean"]["higher_is_better"] is False
    # the trial's recorded artifact is JSON: plain values round-trip exactly
    assert json.loads(json.dumps(got.gates)) == got.gates
    # the driver's reading of the constraints is unchanged
    assert constraint_values(None, got.summary, got.gates) == {
        k: g.constraint for k, g in gates.items()
    }
    assert got.evaluator_load_s == 2.5  # the (suite, split) key, not a gate's name
