"""The capacity-aware sampler in a real study: SearchDriver with Ray started locally, a real
HostWorker running the Evaluator on the reference model, Optuna sqlite and MLflow sqlite in a
tmp dir. The bounds are exact: the sampler measures the fewest-tenant plan (all bf16: KL 0
against itself) first and never proposes a plan the study already holds.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import optuna
import pytest

from tenantq.search.driver import SearchDriver
from tenantq.search.spec import parse_spec
from tenantq.testing import tiny_study_spec

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SUITE = Path(__file__).with_name("tiny_suite.toml")


def test_capacity_aware_study_end_to_end(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    raw = tomllib.loads(
        tiny_study_spec(tmp_path, name="ca", trials=4, suite=SUITE, sampler="capacity_aware",
                        workers=1)
    )  # fmt: skip
    # 3 weight formats (one for all linears) x 3 key formats = 9 plans
    raw["space"].update(
        uniform_weights=True, embed_formats=["bf16"], bf16_first_layers=[0],
        bf16_last_layers=[0], key_axes=["channel"], value_formats=["bf16"], sink_tokens=[0],
        kv_bf16_layers=["none"],
    )  # fmt: skip
    raw["study"]["baselines"] = False
    spec = parse_spec(raw)
    SearchDriver(spec, "", progress=False, out_dir=tmp_path / "out").run()
    study = optuna.load_study(study_name="ca", storage=f"sqlite:///{tmp_path}/optuna.db")
    trials = study.trials
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 4
    assert trials[0].values == [16, 0.0]  # all bf16: the reference, measured first
    fingerprints = [t.user_attrs["plan_fingerprint"] for t in trials]
    assert len(set(fingerprints)) == 4 and not any("duplicate_of" in t.user_attrs for t in trials)
