"""`[deployment] slo` and the `tenants_at_slo` capacity objective: spec checks, the logged
metrics and the objective value, from `capacity.roofline` (the search's smallest hook)."""

from __future__ import annotations

import copy

import pytest

from tenantq.capacity import Deployment, budget, get_model_config
from tenantq.capacity.roofline import tenants_at_slo
from tenantq.quant.plan import QuantPlan
from tenantq.search.objectives import capacity_metrics, objective_values
from tenantq.search.spec import ObjectiveSpec, parse_spec

BASE = {
    "model": "reference",
    "deployment": {"hardware": "h100-sxm", "context_tokens": 8192, "slo": "20tok/s"},
    "objectives": [
        {"metric": "tenants_at_slo", "direction": "maximize"},
        {"metric": "fidelity.kl_mean", "direction": "minimize"},
    ],
    "study": {"name": "s", "trials": 3},
}


def _spec(mutate=lambda d: None):
    d = copy.deepcopy(BASE)
    mutate(d)
    return parse_spec(d, "x.toml")


def test_slo_spec_validates_and_keeps_quality_objectives_apart():
    spec = _spec()
    assert spec.deployment.slo == "20tok/s"
    assert [o.metric for o in spec.quality_objectives()] == ["fidelity.kl_mean"]


@pytest.mark.parametrize(
    ("mutate", "words"),
    [
        (lambda d: d["deployment"].update(slo="fast"), ["deployment.slo", "20tok/s"]),
        (lambda d: d["deployment"].update(slo="0tok/s"), ["deployment.slo", "positive"]),
        (lambda d: d["deployment"].pop("slo"), ["tenants_at_slo", "[deployment] slo"]),
        (
            lambda d: d["deployment"].update(hardware="cpu", memory="10MiB"),
            ["deployment.slo", "hardware cpu"],
        ),
    ],
)
def test_bad_slo_specs_are_one_line(mutate, words):
    with pytest.raises(ValueError) as err:
        _spec(mutate)
    text = str(err.value)
    assert "\n" not in text and all(w in text for w in words), text


def test_tenants_at_slo_is_logged_and_is_the_objective():
    config = get_model_config("llama-3.1-8b")
    plan, d = QuantPlan.uniform("int4", "fp8_e4m3"), Deployment.of("h100-sxm")
    b = budget(config, plan, d, 8192)
    level = tenants_at_slo(config, plan, d, 8192, "20tok/s", tenants_by_memory=b.tenants)
    metrics = capacity_metrics(b, level)
    assert metrics["capacity.tenants"] == b.tenants  # memory: 135
    assert metrics["capacity.tenants_at_slo"] == level.tenants < b.tenants  # the SLO binds
    objectives = [ObjectiveSpec(metric="tenants_at_slo", direction="maximize"),
                  ObjectiveSpec(metric="tenants", direction="maximize")]  # fmt: skip
    assert objective_values(objectives, b.tenants, {}, metrics) == [level.tenants, b.tenants]
    assert "capacity.tenants_at_slo" not in capacity_metrics(b)  # no SLO, no metric


def test_report_waterfall_splits_the_memorys_tenants_at_the_slo():
    from tenantq.report.figures import waterfall_figure

    config = get_model_config("llama-3.1-8b")
    plan, d = QuantPlan.uniform("int4", "fp8_e4m3"), Deployment.of("h100-sxm")
    b = budget(config, plan, d, 8192)
    level = tenants_at_slo(config, plan, d, 8192, "20tok/s", tenants_by_memory=b.tenants)
    doc = b.to_dict() | {"service_level": level.to_dict()}

    class Trial:  # the report's TrialRecord, as far as the waterfall reads it
        number = 3

        def artifact_json(self, name):
            return doc if name == "budget.json" else None

    fig = waterfall_figure(Trial(), None)
    labels = list(fig.data[0].x)
    served, beyond = level.tenants, b.tenants - level.tenants
    assert labels[4:6] == [f"{served} tenants at 20 tok/s", f"{beyond} beyond the SLO"]
    y = list(fig.data[0].y)
    # Both bars together are the memory's tenants' bytes, to the byte.
    assert -(y[4] + y[5]) * 1024**2 == pytest.approx(b.tenants * b.tenant_bytes_per_chip, abs=1)
