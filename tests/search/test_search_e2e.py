"""The search end to end with real components: Ray started locally, real HostWorkers running
the real Evaluator on the shipped reference model, Optuna sqlite and MLflow sqlite in tmp dirs.

A tiny suite (tests/search/tiny_suite.toml: fidelity on 4 x 128 tokens) keeps a trial to
seconds. What is checked is bookkeeping, so the bounds are exact counts: every trial has its
nested MLflow run with params and metrics; a killed worker's trial still completes; a trial that
raises is FAILED with its error while the study goes on. The quickstart variant starts and
stops its own Ray, as `tenantq search` does; the other studies share one Ray per module, and
the failed-trial study is the session's `failing` study (tests/conftest.py), which the report
tests also read.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import tomllib
from pathlib import Path

import optuna
import pytest
from mlflow import MlflowClient

from tenantq.search.driver import SearchDriver
from tenantq.search.spec import parse_spec
from tenantq.testing import tiny_study_spec
from tenantq.workers.faults import INJECTED_ERROR

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SUITE = Path(__file__).with_name("tiny_suite.toml")


def _spec(tmp: Path, trials: int, *, confirm: bool = False, **kw):
    text = tiny_study_spec(
        tmp, name="e2e", trials=trials, suite=SUITE, confirm_suite=SUITE if confirm else None, **kw
    )
    return parse_spec(tomllib.loads(text)), text


def _study(tmp: Path, name: str = "e2e") -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{tmp}/optuna.db")


def _nested_runs(tmp: Path, name: str = "e2e"):
    client = MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    exp = client.get_experiment_by_name(name)
    runs = client.search_runs([exp.experiment_id], "tags.`tenantq.kind` = 'trial'")
    return client, {int(r.data.tags["tenantq.trial"]): r for r in runs}


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray for this module's studies after the quickstart's (the driver joins a Ray
    that is already up and leaves it running; its actors are killed when each study ends)."""
    import ray

    assert not ray.is_initialized(), "another test left Ray running"
    ray.init(num_cpus=2, include_dashboard=False, namespace="tenantq", log_to_driver=False)
    yield
    ray.shutdown()


def test_quickstart_variant_end_to_end(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    spec, text = _spec(tmp_path, trials=5, confirm=True)
    outcome = SearchDriver(spec, text, progress=False, out_dir=tmp_path / "out").run()
    trials = _study(tmp_path).trials
    S = optuna.trial.TrialState
    assert [t.state for t in trials] == [S.COMPLETE] * 5
    client, runs = _nested_runs(tmp_path)
    assert sorted(runs) == [t.number for t in trials]  # one nested run per trial
    keys = {frozenset(r.data.params) for r in runs.values()}
    assert len(keys) == 1  # the same param names in every trial (MLflow compare views)
    for t in trials:
        run = runs[t.number]
        assert run.info.status == "FINISHED"
        assert run.data.metrics["capacity.tenants"] == t.values[0]
        assert run.data.metrics["fidelity.kl_mean"] == pytest.approx(t.values[1])
        assert "fidelity.kl_mean.ci_high" in run.data.metrics
        if "duplicate_of" not in t.user_attrs:
            assert run.data.metrics["time.total_s"] > 0
            names = {a.path for a in client.list_artifacts(run.info.run_id)}
            assert {"plan.json", "examples.parquet", "budget.txt", "memory_report.json"} <= names
    # bf16 is the baseline: KL exactly 0 against itself (the suite pairs on the same tokens).
    assert trials[0].values == [16, 0.0]
    # The front was confirmed on the held-out split and both figures are side by side.
    assert outcome.front and all(r.confirmed for r in outcome.front)
    assert "confirmed fidelity.kl_mean" in outcome.table
    for r in outcome.front:
        tags = runs[r.trial].data.tags
        assert tags["tenantq.pareto"] == "true"
        assert "confirmed.fidelity.kl_mean" in runs[r.trial].data.metrics
    assert len(outcome.exported) == len(outcome.front)


def test_killed_worker_is_replaced_and_its_trial_retried(tmp_path, monkeypatch, ray_local) -> None:
    import ray

    monkeypatch.chdir(tmp_path)
    spec, text = _spec(tmp_path, trials=3)
    driver = SearchDriver(spec, text, progress=False, out_dir=tmp_path / "out")
    errors: list[BaseException] = []

    def run() -> None:
        try:
            driver.run()
        except BaseException as err:  # surfaced in the main thread below
            errors.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    killed = None
    deadline = time.monotonic() + 300
    while killed is None and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.5)
        if not hasattr(driver, "study"):  # the driver has not created its study yet
            continue
        running = _study(tmp_path).get_trials(states=(optuna.trial.TrialState.RUNNING,))
        for t in running:
            if "worker" in t.user_attrs:
                actor = ray.get_actor(t.user_attrs["worker"], namespace="tenantq")
                pid = ray.get(actor.ping.remote())["pid"]
                os.kill(pid, signal.SIGKILL)  # the worker process dies mid-trial
                killed = (t.number, pid)
                break
    thread.join(timeout=600)
    assert not errors, errors
    assert killed is not None, "no trial was seen running"
    assert ray.is_initialized()  # the driver left the module's Ray running: it did not start it
    trials = _study(tmp_path).trials
    S = optuna.trial.TrialState
    finished = [t for t in trials if t.state in (S.COMPLETE, S.FAIL)]
    retries = [t for t in trials if "failed_trial" in t.system_attrs]
    assert len(finished) - len(retries) == 3  # every trial accounted for
    number, pid = killed
    victim = trials[number]
    if victim.state == S.COMPLETE:  # Ray restarted the actor and retried the task
        assert victim.user_attrs["worker_pid"] != pid
    else:  # Ray gave up: the driver replaced the worker and Optuna re-queued the trial
        assert any(t.system_attrs.get("failed_trial") == number for t in trials)
    _, runs = _nested_runs(tmp_path)
    assert sorted(runs) == sorted(t.number for t in finished)


def test_trial_that_raises_is_failed_and_the_study_goes_on(studies) -> None:
    # The session's `failing` study (tests/conftest.py): 3 trials on the quickstart variant's
    # spec whose workers raise on every quantized plan (FailQuantizedTrials), inside the Ray
    # actor as a real failure would; the bf16 baseline completes. Objectives: tenants, KL and
    # the needle accuracy delta at 256 tokens.
    trials = _study(studies.root, "failing").trials
    S = optuna.trial.TrialState
    assert trials[0].state == S.COMPLETE and trials[0].values == [16, 0.0, 0.0]
    failed = [t for t in trials if t.state == S.FAIL]
    assert len(failed) == 2  # trials 1 and 2: the fp8 and int4 baselines the driver enqueues
    assert all(INJECTED_ERROR in t.user_attrs["error"] for t in failed)
    assert len(trials) == 3  # a trial's own error is not retried; the study went on to 3
    _, runs = _nested_runs(studies.root, "failing")
    for t in failed:
        assert runs[t.number].info.status == "FAILED"
        assert INJECTED_ERROR in runs[t.number].data.tags["tenantq.error"]


def test_gptq_study_calibrates_in_the_workers(tmp_path, monkeypatch, ray_local) -> None:
    # [calibration] algorithm = "gptq" with 4 windows of 64 tokens: the workers' Evaluators
    # collect the statistics and GPTQ-round the linears (the embedding stays RTN: it has no
    # input activations), so the quantized baseline completes instead of failing.
    monkeypatch.chdir(tmp_path)
    spec, text = _spec(tmp_path, trials=2, algorithm="gptq", calibration_windows=(4, 64))
    assert spec.calibration.worker_args() == {
        "data": None, "sequences": 4, "sequence_tokens": 64, "seed": 0, "sequential": False
    }  # fmt: skip
    SearchDriver(spec, text, progress=False, out_dir=tmp_path / "out").run()
    trials = _study(tmp_path).trials
    # 2 trials run: the bf16 and fp8 baselines; the int4 one stays enqueued (WAITING)
    assert [t.state for t in trials[:2]] == [optuna.trial.TrialState.COMPLETE] * 2
    plan = json.loads(trials[1].user_attrs["plan"])
    algorithms = {r["pattern"]: r.get("algorithm", "rtn") for r in plan["rules"]}
    assert algorithms.pop("embed") == "rtn" and set(algorithms.values()) == {"gptq"}, plan
    assert trials[1].values[1] > 0  # fp8 weights and KV: a measured, nonzero KL
    assert list((tmp_path / "cache" / "calibration").iterdir())  # the statistics were cached


def test_worker_on_a_node_without_the_model_fails_the_pool_in_one_line(tmp_path, ray_local) -> None:
    # A real HostWorker actor whose node cannot read the model (the shared volume is not
    # mounted there): the pool's start error is one line naming the node and the path.
    from tenantq.search.spec import WorkersSpec
    from tenantq.workers.pool import WorkerPool, WorkerStartError

    missing = tmp_path / "models" / "reference"
    pool = WorkerPool(
        WorkersSpec(count=1, kind="cpu", cpus_per_worker=1),
        str(missing),
        "unused",
        cache_dir=str(tmp_path / "cache"),
    )
    try:
        with pytest.raises(WorkerStartError) as err:
            pool.wait_ready(timeout_s=120)
    finally:
        pool.shutdown()
    line = str(err.value)
    assert "\n" not in line, line
    # Ray's node: its IP and the start of its id (workers.host.node_name), then the path.
    assert re.search(rf"node \S+ \(node [0-9a-f]{{12}}\) cannot read the model at {missing} ", line)
