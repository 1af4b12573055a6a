"""The driver end to end on a capacity-only study: real Optuna sqlite and MLflow sqlite in a tmp
dir, no Ray (a study with only the exact capacity objective needs no worker).

Expected figures are exact: each trial's objective is `capacity.budget(...).tenants` of the
plan its parameters make; the three baselines come first; a plan already measured is answered
from the study and never counted twice.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from mlflow import MlflowClient

from tenantq.capacity import budget
from tenantq.quant.plan import QuantPlan
from tenantq.search.driver import SearchDriver, study_context
from tenantq.search.spec import parse_spec

SPEC_TEXT = """
model = "reference"
objectives = [{{ metric = "tenants", direction = "maximize" }}]
[deployment]
hardware = "cpu"
memory = "9830KiB"
context_tokens = 256
[space]
weight_formats = ["bf16", "fp8_e4m3", "int4"]
key_formats = ["bf16", "fp8_e4m3"]
value_formats = ["bf16", "fp8_e4m3"]
key_axes = ["channel"]
sink_tokens = [0]
bf16_first_layers = [0]
bf16_last_layers = [0]
kv_bf16_layers = ["none"]
[sampler]
kind = "{sampler}"
seed = 3
[study]
name = "cap"
trials = {trials}
storage = "sqlite:///{tmp}/optuna.db"
[tracking]
uri = "sqlite:///{tmp}/mlflow.db"
"""


def _spec(tmp: Path, trials: int, sampler: str = "tpe"):
    import tomllib

    text = SPEC_TEXT.format(tmp=tmp, trials=trials, sampler=sampler)
    return parse_spec(tomllib.loads(text)), text


def _study(tmp: Path):
    return optuna.load_study(study_name="cap", storage=f"sqlite:///{tmp}/optuna.db")


@pytest.mark.slow
def test_capacity_study_trials_runs_and_front(tmp_path) -> None:
    spec, text = _spec(tmp_path, trials=8)
    outcome = SearchDriver(spec, text, progress=False, out_dir=tmp_path / "out").run()
    study = _study(tmp_path)
    trials = study.trials
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 8
    prep = study_context(spec, text)
    for t in trials:  # the objective is the exact budget of the trial's own plan
        plan = QuantPlan.from_json(t.user_attrs["plan"])
        assert t.values == [budget(prep.config, plan, prep.deployment, 256).tenants]
    # Baselines first: bf16 (16 tenants of 256 tokens on this deployment), fp8 + fp8 KV.
    assert QuantPlan.from_json(trials[0].user_attrs["plan"]) == QuantPlan()
    assert trials[0].values == [16]
    assert trials[1].values == [40]  # fp8 weights + fp8 KV, `tenantq capacity --compare`
    # Each distinct plan is measured once; repeats point at the first trial with that plan.
    first: dict[str, int] = {}
    for t in trials:
        fp = t.user_attrs["plan_fingerprint"]
        if fp in first:
            assert t.user_attrs["duplicate_of"] == first[fp]
        else:
            assert "duplicate_of" not in t.user_attrs
            first[fp] = t.number
    # MLflow: a parent run and one nested run per trial, same param keys in every one.
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("cap")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get("tenantq.kind") == "study"]
    nested = [r for r in runs if r.data.tags.get("tenantq.kind") == "trial"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert parents[0].data.params["model.identity"]
    assert len(nested) == 8
    assert {r.data.tags["mlflow.parentRunId"] for r in nested} == {parents[0].info.run_id}
    keys = {frozenset(r.data.params) for r in nested}
    assert len(keys) == 1 and "weights.mlp_down" in next(iter(keys))
    by_trial = {int(r.data.tags["tenantq.trial"]): r for r in nested}
    for t in trials:
        assert by_trial[t.number].data.metrics["capacity.tenants"] == t.values[0]
    # The front: the most tenants, tagged in MLflow, exported as plans that load.
    best = max(t.values[0] for t in trials)
    assert [r.tenants for r in outcome.front] == [best]
    assert by_trial[outcome.front[0].trial].data.tags.get("tenantq.pareto") == "true"
    assert len(outcome.exported) == 1 and QuantPlan.load(outcome.exported[0]).fingerprint()
    assert "tenants" in outcome.table and f"{int(best)} " in outcome.table


@pytest.mark.slow
def test_resume_continues_the_same_study(tmp_path) -> None:
    spec, text = _spec(tmp_path, trials=4)
    SearchDriver(spec, text, progress=False, out_dir=tmp_path / "o").run()
    before = {t.number: t.datetime_complete for t in _study(tmp_path).trials}
    with pytest.raises(ValueError, match="already exists .* --resume"):
        SearchDriver(spec, text, progress=False).run()
    spec6, text6 = _spec(tmp_path, trials=6)
    SearchDriver(spec6, text6, resume=True, progress=False, out_dir=tmp_path / "o").run()
    after = _study(tmp_path).trials
    assert len(after) == 6
    assert {t.number: t.datetime_complete for t in after[:4]} == before  # nothing re-run
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("cap")
    parents = client.search_runs([exp.experiment_id], "tags.`tenantq.kind` = 'study'")
    assert len(parents) == 1  # the resumed study reopened its parent run


@pytest.mark.slow
def test_resume_needs_an_existing_study_and_the_same_spec(tmp_path) -> None:
    spec, text = _spec(tmp_path, trials=2)
    with pytest.raises(ValueError, match="no study 'cap'"):
        SearchDriver(spec, text, resume=True, progress=False).run()
    SearchDriver(spec, text, progress=False, out_dir=tmp_path / "o").run()
    other, other_text = _spec(tmp_path, trials=2, sampler="random")
    with pytest.raises(ValueError, match=r"spec changed .*sampler.kind"):
        SearchDriver(other, other_text, resume=True, progress=False).run()


@pytest.mark.slow
@pytest.mark.e2e
def test_resume_after_killing_the_driver(tmp_path) -> None:
    """SIGKILL the driver process mid-study; --resume finishes it with every completed trial
    kept as it was and none run twice (one MLflow run per trial number)."""
    spec_path = tmp_path / "cap.toml"
    spec_path.write_text(SPEC_TEXT.format(tmp=tmp_path, trials=16, sampler="random"))
    cmd = [sys.executable, "-m", "tenantq", "search", str(spec_path), "--no-progress"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 120
    complete = []
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
        try:
            complete = _study(tmp_path).get_trials(states=(optuna.trial.TrialState.COMPLETE,))
        except Exception:  # the study is not created yet
            continue
        if len(complete) >= 3:
            break
    assert proc.poll() is None, "the driver finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed = {
        t.number: t.datetime_complete for t in _study(tmp_path).trials if t.state.is_finished()
    }
    assert len(killed) >= 3
    done = subprocess.run(cmd + ["--resume"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    trials = _study(tmp_path).trials
    states = optuna.trial.TrialState
    for number, when in killed.items():
        assert trials[number].datetime_complete == when  # kept, not re-run
    finished = [t for t in trials if t.state in (states.COMPLETE, states.FAIL)]
    # study.trials counts distinct plans (duplicates and retries are not plans)
    plans = {t.user_attrs["plan_fingerprint"] for t in trials if t.state == states.COMPLETE}
    assert len(plans) == 16
    assert not [t for t in trials if t.state == states.RUNNING]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("cap")
    nested = client.search_runs(
        [exp.experiment_id], "tags.`tenantq.kind` = 'trial'", max_results=1000
    )
    numbers = [int(r.data.tags["tenantq.trial"]) for r in nested]
    assert sorted(numbers) == sorted({t.number for t in finished})  # one run per trial, no repeats


@pytest.mark.slow
def test_resume_requeues_a_trial_a_dead_driver_left_running(tmp_path) -> None:
    """A trial left RUNNING with a heartbeat that stopped (its driver died): --resume waits out
    the grace period, Optuna fails it and re-queues the same parameters, which then complete."""
    from tenantq.search.driver import GRACE_PERIOD_S, make_sampler, make_storage
    from tenantq.search.space import suggest

    spec, text = _spec(tmp_path, trials=2)
    SearchDriver(spec, text, progress=False, out_dir=tmp_path / "o").run()
    # The "dead driver": asks a trial, gives it parameters and one heartbeat, then stops.
    storage = make_storage(spec.study.storage, spec.study.max_trial_retries)
    study = optuna.load_study(study_name="cap", storage=storage, sampler=make_sampler(spec))
    orphan = study.ask()
    params = suggest(orphan, spec.space, study_context(spec, text).config)
    storage.record_heartbeat(orphan._trial_id)
    began = time.monotonic()
    spec3, text3 = _spec(tmp_path, trials=3)
    SearchDriver(spec3, text3, resume=True, progress=False, out_dir=tmp_path / "o").run()
    assert time.monotonic() - began >= GRACE_PERIOD_S  # not failed while it could be alive
    trials = _study(tmp_path).trials
    S = optuna.trial.TrialState
    assert trials[orphan.number].state == S.FAIL
    retry = [t for t in trials if t.system_attrs.get("failed_trial") == orphan.number]
    assert len(retry) == 1 and retry[0].state == S.COMPLETE and retry[0].params == params
    assert len({t.user_attrs["plan_fingerprint"] for t in trials if t.state == S.COMPLETE}) == 3
