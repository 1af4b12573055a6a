"""The capacity-aware sampler's bookkeeping against real Optuna (in-memory): a failed plan is
not proposed again, and the sensitivity space's integer parameter is asked with the
distribution `space.suggest` uses (issue 22, faults 1 and 2)."""

from __future__ import annotations

import tomllib

import optuna
import pyarrow as pa
import pyarrow.parquet as pq

from tenantq.search.capacity_aware import Candidate, CapacityAwareSampler
from tenantq.search.driver import make_sampler, study_context
from tenantq.search.spec import parse_spec

optuna.logging.set_verbosity(optuna.logging.WARNING)


def test_failed_plan_is_not_asked_again() -> None:
    # Fault 1: only COMPLETE counted as measured and RUNNING/WAITING as pending, so after a
    # FAIL the sampler proposed the same (largest, most precise) plan again, every time.
    candidates = [
        Candidate({"w": "bf16"}, tenants=10, key="bf16"),
        Candidate({"w": "fp8"}, tenants=20, key="fp8"),
        Candidate({"w": "int4"}, tenants=30, key="int4"),
    ]
    sampler = CapacityAwareSampler(candidates, quality_index=1, seed=0)
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)
    first = study.ask()
    assert first.suggest_categorical("w", ["bf16", "fp8", "int4"]) == "bf16"  # the reference
    study.tell(first, state=optuna.trial.TrialState.FAIL)
    proposals = []
    for _ in range(2):
        trial = study.ask()
        proposals.append(trial.suggest_categorical("w", ["bf16", "fp8", "int4"]))
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
    assert "bf16" not in proposals and sorted(proposals) == ["fp8", "int4"]


SENSITIVITY_SPEC = """
model = "reference"
[[objectives]]
metric = "tenants"
direction = "maximize"
[[objectives]]
metric = "fidelity.kl_mean"
direction = "minimize"
[deployment]
hardware = "cpu"
memory = "9830KiB"
context_tokens = 256
[space]
kind = "sensitivity"
profile = "{profile}"
weight_formats = ["int4"]
key_formats = ["bf16"]
value_formats = ["bf16"]
key_axes = ["channel"]
sink_tokens = [0]
[eval]
suite = "quick"
[sampler]
kind = "capacity_aware"
[study]
name = "sens"
trials = 3
"""


def test_capacity_aware_asks_the_sensitivity_space_with_its_own_distributions(tmp_path) -> None:
    # Fault 2: the sampler declared every parameter categorical while `space.suggest` asks
    # `sens.keep_bf16` with suggest_int: Optuna raised "Cannot set different distribution
    # kind" and every trial of such a study failed.
    from tenantq.search.space import suggest

    rows = [("layers/0/mlp/down_proj", "int4", 0.5), ("lm_head", "int4", 0.3)]
    profile = tmp_path / "profile.parquet"
    columns = ["tensor", "format", "kl_mean"]
    pq.write_table(pa.table({k: [r[i] for r in rows] for i, k in enumerate(columns)}), profile)
    spec = parse_spec(tomllib.loads(SENSITIVITY_SPEC.format(profile=profile)))
    prep = study_context(spec, "")
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=make_sampler(spec))
    for _ in range(3):
        trial = study.ask()
        params = suggest(trial, spec.space, prep.config, prep.profile)
        assert isinstance(params["sens.keep_bf16"], int)
        study.tell(trial, [1.0, 0.1])
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 3
