"""`[deployment] slo` and `tenants_at_slo` as a study's capacity objective (issue 30).

The capacity value of a trial comes from one place (`objectives.CapacityObjective`): with
`tenants_at_slo` it is min(tenants by memory, tenants by the SLO) of the roofline step model,
and the objective Optuna is told, the front rows, the confirmed front's vectors, the export,
the MLflow metrics and the report's front table and waterfall all carry that value. Bounds are
exact: the expected figures are `capacity.budget` and `capacity.roofline.tenants_at_slo` of the
same plan, computed here independently of the driver.
"""

from __future__ import annotations

import copy
import json
import tomllib

import optuna
import pytest

from tenantq.capacity import Deployment, budget
from tenantq.capacity.roofline import tenants_at_slo
from tenantq.quant.plan import QuantPlan
from tenantq.search.spec import parse_spec

BASE = {
    "model": "reference",
    "deployment": {"hardware": "tpu-v5e", "context_tokens": 256, "slo": "1500tok/s"},
    "objectives": [
        {"metric": "tenants_at_slo", "direction": "maximize"},
        {"metric": "fidelity.kl_mean", "direction": "minimize"},
    ],
    "sampler": {"kind": "random"},
    "study": {"name": "s", "trials": 3},
}


def _spec(mutate=lambda d: None):
    d = copy.deepcopy(BASE)
    mutate(d)
    return parse_spec(d, "x.toml")


def test_an_slo_objective_keeps_quality_objectives_apart_and_defaults_to_capacity_aware():
    spec = _spec(lambda d: d["sampler"].pop("kind"))
    assert spec.deployment.slo == "1500tok/s" and spec.capacity_metric == "tenants_at_slo"
    assert [o.metric for o in spec.quality_objectives()] == ["fidelity.kl_mean"]
    # capacity_aware ranks its picks by each plan's exact tenants at the SLO (issue 30)
    assert spec.sampler.kind == "capacity_aware"


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
        (
            lambda d: d["objectives"].append({"metric": "tenants", "direction": "maximize"}),
            ["objectives", "one capacity objective"],
        ),
    ],
)
def test_bad_slo_specs_are_one_line_naming_the_key(mutate, words):
    with pytest.raises(ValueError) as err:
        _spec(mutate)
    text = str(err.value)
    assert "\n" not in text and all(w in text for w in words), text


def test_the_capacity_value_is_min_of_memory_and_the_slo():
    from tenantq.model.config import ModelConfig
    from tenantq.reference import reference_model_path
    from tenantq.search.objectives import CapacityObjective, objective_values

    spec = _spec()
    config = ModelConfig.from_file(reference_model_path() / "config.json")
    deployment = Deployment.of("tpu-v5e")
    capacity = CapacityObjective.for_spec(spec, config, deployment)
    plan = QuantPlan.uniform("int4", "int8")
    b = budget(config, plan, deployment, 256)
    level = tenants_at_slo(config, plan, deployment, 256, "1500tok/s", tenants_by_memory=b.tenants)
    # the SLO binds on this deployment: memory holds ~118k tenants, the step model serves ~1k
    assert level.tenants_by_slo < b.tenants
    assert capacity.tenants(plan, b) == min(b.tenants, level.tenants_by_slo) == level.tenants
    lines, _ = capacity.lines(plan, b)
    assert lines["capacity.tenants"] == b.tenants
    assert lines["capacity.tenants_at_slo"] == level.tenants
    assert lines["capacity.tenants_by_slo"] == level.tenants_by_slo
    assert lines["capacity.step_ms"] == pytest.approx(level.step.step_s * 1e3)
    assert lines["capacity.tokens_per_s_per_tenant"] >= 1500
    assert objective_values(spec.objectives, lines, {"fidelity.kl_mean": 0.5}) == [
        level.tenants,
        0.5,
    ]
    memory = CapacityObjective.for_spec(_spec(_memory_objective), config, deployment)
    assert memory.tenants(plan, b) == b.tenants  # the same plan, the memory objective


def _memory_objective(d) -> None:
    d["objectives"][0]["metric"] = "tenants"


SPEC = """
model = "reference"
[[objectives]]
metric = "tenants_at_slo"
direction = "maximize"
[[objectives]]
metric = "fidelity.kl_mean"
direction = "minimize"
[deployment]
hardware = "tpu-v5e"
context_tokens = 256
slo = "1500tok/s"
[space]
weight_formats = ["bf16", "int8", "int4"]
key_formats = ["bf16", "int8"]
value_formats = ["bf16", "int8"]
bf16_first_layers = [0]
bf16_last_layers = [0]
[eval]
suite = "quick"
[sampler]
kind = "random"
seed = 2
[study]
name = "slo"
trials = 6
baselines = false
storage = "sqlite:///{tmp}/optuna.db"
[tracking]
uri = "sqlite:///{tmp}/mlflow.db"
"""


@pytest.mark.slow
def test_an_slo_study_carries_tenants_at_slo_through_front_export_mlflow_and_report(
    tmp_path, monkeypatch
) -> None:
    # The reverted first version logged tenants_at_slo but ranked the front, the confirmed
    # front, the export and the report's table by memory tenants.
    from mlflow import MlflowClient

    from tenantq.report.figures import front_table_rows, pareto_figure, waterfall_figure
    from tenantq.report.study import load_study
    from tenantq.search.driver import SearchDriver
    from tenantq.workers.inprocess import InProcessPool

    monkeypatch.chdir(tmp_path)  # MLflow's sqlite store puts artifacts in ./mlruns
    text = SPEC.format(tmp=tmp_path)
    spec = parse_spec(tomllib.loads(text))
    outcome = SearchDriver(
        spec,
        text,
        progress=False,
        out_dir=tmp_path / "out",
        pool_factory=lambda d: InProcessPool(count=d.workers),
    ).run()
    study = optuna.load_study(study_name="slo", storage=spec.study.storage)
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len({t.user_attrs["plan_fingerprint"] for t in done}) == 6
    by_trial = {}
    for t in done:
        cap = t.user_attrs["capacity"]
        assert t.values[0] == cap["capacity.tenants_at_slo"] < cap["capacity.tenants"]
        by_trial[t.number] = cap
    # the front: ranked by tenants at the SLO, memory's count beside it
    assert outcome.front
    for r in outcome.front:
        assert r.tenants == by_trial[r.trial]["capacity.tenants_at_slo"]
        assert r.tenants_by_memory == by_trial[r.trial]["capacity.tenants"]
    assert outcome.table.splitlines()[0].split()[:6] == [
        "trial", "tenants", "at", "1500", "tok/s", "by",
    ]  # fmt: skip
    listing = json.loads((tmp_path / "out" / "front" / "front.json").read_text())
    assert [(x["trial"], x["tenants"]) for x in listing] == [
        (r.trial, r.tenants) for r in outcome.front
    ]
    assert {x["capacity"] for x in listing} == {"tenants at 1500 tok/s"}
    # MLflow: the four SLO lines on every trial run, the service level in budget.json
    client = MlflowClient(spec.tracking.uri)
    exp = client.get_experiment_by_name("slo")
    runs = client.search_runs([exp.experiment_id], "tags.`tenantq.kind` = 'trial'")
    keys = ("tenants_at_slo", "tenants_by_slo", "step_ms", "tokens_per_s_per_tenant")
    assert runs and all(f"capacity.{k}" in r.data.metrics for r in runs for k in keys)
    # the report: the front table, the Pareto axis and the waterfall use the SLO capacity
    record = load_study(spec.tracking.uri, "slo")
    rows = front_table_rows(record)
    # one label everywhere (issue 30): the spec's "1500tok/s" is written as search writes it
    assert [int(r["tenants at 1500 tok/s"]) for r in rows] == [r.tenants for r in outcome.front]
    assert [int(r["tenants by memory"]) for r in rows] == [
        r.tenants_by_memory for r in outcome.front
    ]
    assert pareto_figure(record).layout.xaxis.title.text == "tenants at 1500 tok/s"
    chosen = record.choose_trial()
    fig = waterfall_figure(chosen, None)
    b = chosen.artifact_json("budget.json")
    served = b["service_level"]["tenants_at_slo"]
    assert served == chosen.tenants
    labels = list(fig.data[0].x)
    assert labels[4:6] == [
        f"{served} tenants at 1500 tok/s",
        f"{b['tenants'] - served} beyond the SLO",
    ]
    y = list(fig.data[0].y)
    # both bars together are the memory's tenants' bytes, to the byte
    assert -(y[4] + y[5]) * 1024**2 == pytest.approx(b["tenants"] * b["tenant_bytes_per_chip"])


@pytest.mark.slow
def test_a_loose_slo_study_is_bound_by_memory_through_front_and_report(
    tmp_path, monkeypatch
) -> None:
    # The other edge of min(memory, SLO): at 1 tok/s every plan's step at its memory tenants
    # is far under a second (tpu-v5e, reference model, context 256), so memory binds: the
    # value Optuna is told is memory's count, the SLO's count lies above it, the budget says
    # memory binds and the report's waterfall serves every tenant memory holds.
    from tenantq.report.figures import front_table_rows, waterfall_figure
    from tenantq.report.study import load_study
    from tenantq.search.driver import SearchDriver
    from tenantq.workers.inprocess import InProcessPool

    monkeypatch.chdir(tmp_path)  # MLflow's sqlite store puts artifacts in ./mlruns
    text = SPEC.format(tmp=tmp_path).replace('slo = "1500tok/s"', 'slo = "1tok/s"')
    text = text.replace("trials = 6", "trials = 3")
    spec = parse_spec(tomllib.loads(text))
    outcome = SearchDriver(
        spec,
        text,
        progress=False,
        out_dir=tmp_path / "out",
        pool_factory=lambda d: InProcessPool(count=d.workers),
    ).run()
    study = optuna.load_study(study_name="slo", storage=spec.study.storage)
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert done
    for t in done:
        cap = t.user_attrs["capacity"]
        assert t.values[0] == cap["capacity.tenants_at_slo"] == cap["capacity.tenants"]
        assert cap["capacity.tenants_by_slo"] > cap["capacity.tenants"]
    assert outcome.front and all(r.tenants == r.tenants_by_memory for r in outcome.front)
    assert outcome.table.splitlines()[0].split()[:5] == ["trial", "tenants", "at", "1", "tok/s"]
    record = load_study(spec.tracking.uri, "slo")
    assert [int(r["tenants at 1 tok/s"]) for r in front_table_rows(record)] == [
        r.tenants for r in outcome.front
    ]
    chosen = record.choose_trial()
    b = chosen.artifact_json("budget.json")
    assert b["service_level"]["binding"] == "memory"
    labels = list(waterfall_figure(chosen, None).data[0].x)
    assert labels[4:6] == [f"{b['tenants']} tenants at 1 tok/s", "0 beyond the SLO"]


def test_the_report_reads_the_capacity_the_study_used():
    from tenantq.report.study import StudyRecord, TrialRecord

    def trial(n, memory, at_slo):
        return TrialRecord(
            number=n,
            run_id=str(n),
            status="FINISHED",
            params={},
            metrics={"capacity.tenants": memory, "capacity.tenants_at_slo": at_slo},
            tags={"tenantq.pareto": "true"},
            logged_ms=0,
        )

    params = {
        "objectives": "maximize tenants_at_slo, minimize fidelity.kl_mean",
        "deployment.slo": "20tok/s",
    }
    slo = StudyRecord("u", "e", "s", "p", params, {}, [trial(0, 90, 30), trial(1, 50, 40)])
    assert [t.tenants for t in slo.trials] == [30, 40]
    assert slo.choose_trial().number == 1  # most tenants at the SLO, not by memory
    assert slo.quality_metrics == ["fidelity.kl_mean"]
    # the label `tenantq search` prints (CapacityObjective.label), whatever the spec's spelling
    for written in ("20tok/s", "20 tokens/s", "20", 20):
        again = StudyRecord("u", "e", "s", "p", dict(params, **{"deployment.slo": written}), {}, [])
        assert again.capacity_label == "tenants at 20 tok/s"
    mem = dict(params, objectives="maximize tenants, minimize fidelity.kl_mean")
    memory = StudyRecord("u", "e", "s", "p", mem, {}, [trial(0, 90, 30), trial(1, 50, 40)])
    assert [t.tenants for t in memory.trials] == [90, 50]
    assert memory.choose_trial().number == 0


@pytest.mark.slow
def test_capacity_aware_ranks_its_picks_by_the_exact_tenants_at_the_slo():
    # issue 30's left item: capacity_aware under `tenants_at_slo`. The knapsack's levels are
    # tenants by memory, an upper bound of tenants at the SLO (min of the two); a pick is
    # re-ranked at its exact capacity before it is taken. Here the SLO binds (about 500-1400
    # tenants at 1500 tok/s against 59k-157k by memory), so every knapsack pick is credited
    # with what `capacity.roofline.tenants_at_slo` gives the plan, computed here on its own.
    from tenantq.search.capacity_aware import KnapsackSampler
    from tenantq.search.context import study_context
    from tenantq.search.samplers import make_sampler
    from tenantq.search.space import suggest

    def structured(d):
        d["sampler"].pop("kind")
        d["space"] = {
            "kind": "structured", "group_size": 64, "weight_formats": ["bf16", "int8", "int4"],
            "uniform_weights": True, "bf16_first_layers": [0], "bf16_last_layers": [0],
            "key_axes": ["channel"], "sink_tokens": [0], "kv_bf16_layers": ["none"],
            "key_formats": ["bf16", "int8", "int4"], "value_formats": ["bf16", "int8", "int4"],
        }  # fmt: skip

    spec = _spec(structured)
    ctx = study_context(spec, "")
    sampler = make_sampler(spec, ctx)
    assert isinstance(sampler, KnapsackSampler)
    deployment = ctx.deployment
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)
    plans = set()
    for n in range(6):
        trial = study.ask()
        params = suggest(trial, spec.space, ctx.config)
        plan, b = ctx.plan_and_budget(params)
        at_slo = tenants_at_slo(
            ctx.capacity_config, plan, deployment, 256, "1500tok/s", tenants_by_memory=b.tenants
        ).tenants
        assert at_slo < b.tenants  # the SLO binds
        pick = sampler.last_pick
        if n > 0:
            assert pick["reason"] == "knapsack"
            assert pick["tenants"] == at_slo and pick["level"] <= at_slo, pick
        plans.add(plan.fingerprint())
        kl = 0.01 * sum(v == "int4" for v in params.values()) + 0.002 * sum(
            v == "int8" for v in params.values()
        )
        study.tell(trial, [at_slo, kl])
    assert len(plans) == 6


@pytest.mark.slow
def test_capacity_aware_under_a_binding_slo_keeps_planning_on_a_per_tensor_space():
    # A per-tensor space (~1e20 plans) where the SLO binds (~500-1600 tenants at 1500 tok/s
    # against 59k-189k by memory): every knapsack level is a memory level far above any
    # incumbent, so every DP plan ties at an infinite gain and is re-ranked at its exact
    # capacity. The walk used to spend its MAX_TRIES on those re-ranks and hand the ask to
    # the random fallback (3 of 8 asks) at up to 256 step-model evaluations per ask; now at
    # most MAX_RERANKS plans are re-ranked per ask and the best of them is taken.
    from tenantq.search import capacity_aware
    from tenantq.search.context import study_context
    from tenantq.search.samplers import make_sampler
    from tenantq.search.space import suggest

    def per_tensor(d):
        d["sampler"].pop("kind")
        d["space"] = {"kind": "per_tensor", "group_size": 64}

    spec = _spec(per_tensor)
    ctx = study_context(spec, "")
    sampler = make_sampler(spec, ctx)
    located = []
    locate = sampler._locate_fn
    sampler._locate_fn = lambda params: located.append(1) or locate(params)
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)
    for n in range(6):
        located.clear()
        trial = study.ask()
        params = suggest(trial, spec.space, ctx.config, ctx.profile)
        plan, b = ctx.plan_and_budget(params)
        at_slo = ctx.capacity.tenants(plan, b)
        pick = sampler.last_pick
        if n > 0:
            assert pick["reason"] == "knapsack", (n, pick)
            assert pick["tenants"] == at_slo < b.tenants
            # the pick's own location plus at most MAX_RERANKS re-ranked plans (uncached)
            assert len(located) <= capacity_aware.MAX_RERANKS + 1, (n, len(located))
        kl = 0.01 * sum(v == "int4" for v in params.values()) + 0.002 * sum(
            v == "int8" for v in params.values()
        )
        study.tell(trial, [at_slo, kl])
