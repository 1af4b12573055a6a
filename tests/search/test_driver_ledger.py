"""The driver's bookkeeping end to end with real Optuna sqlite and MLflow sqlite in a tmp dir,
without Ray: capacity-only studies (the exact objective needs no worker) and studies on
`InProcessPool` workers (instant closed-form results, or a NaN, a hang, a dead worker, on
purpose). Each test is a regression test of one fault of issue 22 or 24 (named in its
comment); the bounds are exact counts of trials, plans and runs.
"""

from __future__ import annotations

import json
import math
import shutil
import tomllib
from pathlib import Path

import optuna
import pytest
from mlflow import MlflowClient

from tenantq.search.driver import SearchDriver
from tenantq.search.spec import parse_spec
from tenantq.testing import tiny_study_spec
from tenantq.workers.inprocess import HANG, InProcessPool, WorkerLost, closed_form_result

S = optuna.trial.TrialState
SUITE = Path(__file__).with_name("tiny_suite.toml")

CAPACITY_SPEC = """
model = "{model}"
objectives = [{{ metric = "tenants", direction = "maximize" }}]
[deployment]
hardware = "cpu"
memory = "9830KiB"
context_tokens = 256
[space]
weight_formats = ["bf16", "fp8_e4m3", "int4"]
uniform_weights = true
key_formats = ["bf16"]
value_formats = ["bf16"]
key_axes = ["channel"]
sink_tokens = [0]
bf16_first_layers = [0]
bf16_last_layers = [0]
kv_bf16_layers = ["none"]
[sampler]
kind = "random"
seed = {seed}
[study]
name = "{name}"
trials = {trials}
baselines = false
storage = "sqlite:///{tmp}/optuna.db"
[tracking]
uri = "sqlite:///{tmp}/mlflow.db"
"""


@pytest.fixture(scope="module")
def template_db(tmp_path_factory) -> Path:
    """An MLflow sqlite store created once: its schema migrations take 10-15 s on a loaded
    machine, and every test copies the file instead."""
    from tenantq.tracking import StudyTracker

    folder = tmp_path_factory.mktemp("mlflow-template")
    StudyTracker(f"sqlite:///{folder}/mlflow.db", "template")
    return folder / "mlflow.db"


@pytest.fixture(autouse=True)
def mlflow_db(tmp_path, template_db, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # MLflow's sqlite store puts artifacts in ./mlruns
    for folder in (tmp_path, tmp_path / "a", tmp_path / "b"):
        folder.mkdir(exist_ok=True)
        shutil.copy(template_db, folder / "mlflow.db")


def _capacity(tmp: Path, trials: int, *, seed: int = 3, name: str = "cap", model="reference"):
    text = CAPACITY_SPEC.format(tmp=tmp, trials=trials, seed=seed, name=name, model=model)
    return parse_spec(tomllib.loads(text)), text


def _run(spec, text, tmp: Path, **kw):
    return SearchDriver(spec, text, progress=False, out_dir=tmp / "out", **kw).run()


def _trials(tmp: Path, name: str = "cap"):
    return optuna.load_study(study_name=name, storage=f"sqlite:///{tmp}/optuna.db").trials


def _runs(tmp: Path, name: str = "cap"):
    client = MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    exp = client.get_experiment_by_name(name)
    return client, client.search_runs(
        [exp.experiment_id], "tags.`tenantq.kind` = 'trial'", max_results=5000
    )


def _distinct_plans(trials) -> set[str]:
    return {t.user_attrs["plan_fingerprint"] for t in trials if t.state == S.COMPLETE}


# ---------------------------------------------------------------- capacity-only studies


@pytest.mark.slow
def test_trials_counts_distinct_plans_not_duplicates(tmp_path) -> None:
    # Fault 9: duplicates (COMPLETE) counted toward study.trials. The space has 3 x 3 x 3 =
    # 27 plans; seed 5 proposes repeats within 12 asks, so the old count stopped short.
    spec, text = _capacity(tmp_path, trials=12, seed=5)
    outcome = _run(spec, text, tmp_path)
    trials = _trials(tmp_path)
    assert len(_distinct_plans(trials)) == 12
    dups = [t for t in trials if "duplicate_of" in t.user_attrs]
    assert outcome.counts["done"] == 12 and outcome.counts["duplicates"] == len(dups)
    study = optuna.load_study(study_name="cap", storage=spec.study.storage)
    assert study.metric_names == ["tenants"]  # optuna-dashboard labels the objective
    identity = study.user_attrs["tenantq.identity"]
    assert set(identity) == {"spec", "model", "eval.suite", "code", "files", "config_keys"}
    assert {"model/config.json", "model/tokenizer.json"} <= set(identity["files"])


@pytest.mark.slow
def test_a_resumed_study_does_not_replay_its_draws(tmp_path) -> None:
    # Fault 4: the resumed RandomSampler had the spec's seed again and asked the first
    # start's parameters again, in the same order.
    spec, text = _capacity(tmp_path, trials=4)
    _run(spec, text, tmp_path)
    first = [t.params for t in _trials(tmp_path)]
    spec8, text8 = _capacity(tmp_path, trials=8)
    _run(spec8, text8, tmp_path, resume=True)
    after = [t.params for t in _trials(tmp_path)][len(first) :]
    assert after[: len(first)] != first
    assert len(_distinct_plans(_trials(tmp_path))) == 8


@pytest.mark.slow
def test_no_trial_is_left_waiting_when_baselines_outnumber_the_budget(tmp_path) -> None:
    # Waiting retries were closed only when no enqueued baseline waited too; a baseline the
    # budget had no room for stayed WAITING for ever. Now every waiting trial is closed
    # (`not_run`) at the end, and a closed baseline is enqueued again on a later start.
    spec, text = _capacity(tmp_path, trials=1)
    text = text.replace("baselines = false", "baselines = true")
    spec = parse_spec(tomllib.loads(text))
    outcome = _run(spec, text, tmp_path)
    trials = _trials(tmp_path)
    assert not [t for t in trials if t.state in (S.WAITING, S.RUNNING)]
    closed = [t for t in trials if t.user_attrs.get("failure_reason") == "not_run"]
    assert len(closed) == 1 and closed[0].user_attrs.get("baseline")  # bf16, int4: 2 > 1
    assert outcome.counts["done"] == 1
    more = text.replace("trials = 1", "trials = 3")
    _run(parse_spec(tomllib.loads(more)), more, tmp_path, resume=True)
    trials = _trials(tmp_path)
    measured = [t for t in trials if t.state == S.COMPLETE and t.user_attrs.get("baseline")]
    assert len(measured) == 2  # the closed baseline ran on the resume
    assert not [t for t in trials if t.state in (S.WAITING, S.RUNNING)]


@pytest.mark.slow
def test_resume_is_not_blocked_by_a_trial_killed_inside_ask(tmp_path, monkeypatch) -> None:
    # Fault 6: a driver killed inside ask() leaves a RUNNING trial with no heartbeat row;
    # Optuna never finds it stale and every resume stopped with "another driver is running
    # it". Grace 2 s, heartbeat 1 s here (15 s and 5 s in a study) to keep the test short.
    import importlib

    for name in ("tenantq.search.driver", "tenantq.search.store"):
        try:
            module = importlib.import_module(name)
        except ImportError:  # before the split the constants lived in the driver
            continue
        monkeypatch.setattr(module, "GRACE_PERIOD_S", 2, raising=False)
        monkeypatch.setattr(module, "HEARTBEAT_INTERVAL_S", 1, raising=False)
    spec, text = _capacity(tmp_path, trials=2)
    _run(spec, text, tmp_path)
    orphan = optuna.load_study(study_name="cap", storage=spec.study.storage).ask()  # no beat
    spec3, text3 = _capacity(tmp_path, trials=3)
    _run(spec3, text3, tmp_path, resume=True)
    trials = _trials(tmp_path)
    assert trials[orphan.number].state == S.FAIL
    assert not [t for t in trials if t.state == S.RUNNING]
    assert len(_distinct_plans(trials)) == 3


@pytest.mark.slow
def test_a_half_written_mlflow_run_is_written_again_on_resume(tmp_path) -> None:
    # Fault 10: a crash between creating a trial's run and closing it left a RUNNING run with
    # no metrics, and resume skipped every trial that had a run.
    spec, text = _capacity(tmp_path, trials=2)
    _run(spec, text, tmp_path)
    client, runs = _runs(tmp_path)
    victim = next(r for r in runs if r.data.tags["tenantq.trial"] == "1")
    client.delete_run(victim.info.run_id)
    half = client.create_run(
        victim.info.experiment_id,
        tags={k: v for k, v in victim.data.tags.items() if k.startswith(("tenantq.", "mlflow.p"))},
    )  # created, never filled nor terminated: RUNNING
    spec3, text3 = _capacity(tmp_path, trials=3)
    _run(spec3, text3, tmp_path, resume=True)
    _, runs = _runs(tmp_path)
    by_trial: dict[str, list] = {}
    for r in runs:
        by_trial.setdefault(r.data.tags["tenantq.trial"], []).append(r)
    assert {n: len(rs) for n, rs in by_trial.items()} == {
        str(t.number): 1 for t in _trials(tmp_path)
    }
    assert by_trial["1"][0].info.run_id != half.info.run_id
    assert by_trial["1"][0].info.status == "FINISHED"
    assert by_trial["1"][0].data.metrics["capacity.tenants"] == _trials(tmp_path)[1].values[0]
    # The budget is the plan's, recomputed by the driver: the rewritten run carries it too,
    # as the run written live does (only what the worker returned, examples, is lost).
    rewritten = {a.path for a in client.list_artifacts(by_trial["1"][0].info.run_id)}
    live = {a.path for a in client.list_artifacts(by_trial["0"][0].info.run_id)}
    assert {"plan.json", "budget.json", "budget.txt"} <= rewritten, rewritten
    assert rewritten == live, (rewritten, live)


@pytest.mark.slow
def test_a_fresh_study_leaves_no_plan_files_of_an_earlier_one(tmp_path) -> None:
    # Issue 24, item 1: a fresh study under an existing name with the same --out left the
    # earlier study's plan files beside the new front.
    spec, text = _capacity(tmp_path / "a", trials=2)
    _run(spec, text, tmp_path)
    stale = tmp_path / "out" / "front" / "trial-0099-0123456789abcdef.json"
    stale.write_text("{}")
    spec_b, text_b = _capacity(tmp_path / "b", trials=2, seed=11)
    outcome = _run(spec_b, text_b, tmp_path)
    files = sorted(p.name for p in (tmp_path / "out" / "front").glob("trial-*.json"))
    assert files == sorted(p.name for p in outcome.exported)
    listed = json.loads((tmp_path / "out" / "front" / "front.json").read_text())
    assert sorted(f"trial-{r['trial']:04d}-{r['fingerprint']}.json" for r in listed) == files


@pytest.mark.slow
def test_resume_refuses_a_changed_model_and_continue_as_copies_it(tmp_path) -> None:
    # Issue 24, item 1: config.json edited in place, then --resume: accepted, old and new
    # trials mixed two models. Now one line names what changed; --continue-as goes on under
    # a new name with the old trials copied.
    from tenantq.reference import reference_model_path

    model = tmp_path / "model"
    shutil.copytree(reference_model_path(), model)
    spec, text = _capacity(tmp_path, trials=2, model=model)
    _run(spec, text, tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"note": 1}))  # a key added
    spec3, text3 = _capacity(tmp_path, trials=3, model=model)
    refusal = r"model/config.json changed \(keys: note\).*--continue-as"
    with pytest.raises(ValueError, match=refusal):
        _run(spec3, text3, tmp_path, resume=True)
    renamed, text_r = _capacity(tmp_path, trials=3, model=model, name="cap2")
    _run(renamed, text_r, tmp_path, continue_from="cap")
    assert len(_trials(tmp_path, "cap")) == 2  # the old study is untouched
    copied = [t for t in _trials(tmp_path, "cap2") if "tenantq.copied_from" in t.user_attrs]
    assert len(copied) == 2  # kept as history, marked
    own = [t for t in _trials(tmp_path, "cap2") if t not in copied]
    assert len(_distinct_plans(own)) == 3  # the budget is measured afresh
    _, runs = _runs(tmp_path, "cap2")
    assert len(runs) == len(_trials(tmp_path, "cap2"))  # copied trials logged in the new run


@pytest.mark.slow
def test_resume_compares_the_model_by_content_and_names_the_changed_file(tmp_path) -> None:
    # Identity hashed config.json's bytes (a reformatted file refused the resume) and the
    # model's path (a copy elsewhere refused as a changed spec), and skipped the tokenizer;
    # the refusal named no file. Now: canonical JSON, by content, one digest per file.
    from tenantq.reference import reference_model_path

    first = tmp_path / "model"
    shutil.copytree(reference_model_path(), first)
    spec, text = _capacity(tmp_path, trials=2, model=first)
    _run(spec, text, tmp_path)
    moved = tmp_path / "elsewhere"
    shutil.copytree(first, moved)
    config = json.loads((moved / "config.json").read_text())
    reordered = dict(reversed(list(config.items())))
    (moved / "config.json").write_text(json.dumps(reordered, indent=4))  # same values
    spec3, text3 = _capacity(tmp_path, trials=3, model=moved)
    _run(spec3, text3, tmp_path, resume=True)  # accepted: the same model, by content
    tokenizer = next(p for p in sorted(moved.iterdir()) if p.name.startswith("tokenizer"))
    tokenizer.write_bytes(tokenizer.read_bytes() + b" ")
    spec4, text4 = _capacity(tmp_path, trials=4, model=moved)
    with pytest.raises(ValueError, match=rf"model/{tokenizer.name} changed"):
        _run(spec4, text4, tmp_path, resume=True)


@pytest.mark.slow
def test_trials_continue_as_copied_answer_no_duplicate_and_join_no_front(tmp_path) -> None:
    # Copied trials were measured on the old inputs: the ledger answered duplicates with
    # their figures and they entered the new front. The space holds 3 plans (3 uniform
    # weight formats); the old study measured 2, so the new one must measure all 3 itself.
    spec, text = _capacity(tmp_path, trials=2)
    _run(spec, text, tmp_path)
    renamed, text_r = _capacity(tmp_path, trials=3, name="cap2")
    outcome = _run(renamed, text_r, tmp_path, continue_from="cap")
    trials = _trials(tmp_path, "cap2")
    copied = {t.number for t in trials if t.user_attrs.get("tenantq.copied_from") == "cap"}
    assert len(copied) == len(_trials(tmp_path, "cap"))
    own = [t for t in trials if t.number not in copied]
    assert all(t.user_attrs.get("duplicate_of") not in copied for t in own)
    measured = {
        t.user_attrs["plan_fingerprint"]
        for t in own
        if t.state == S.COMPLETE and "duplicate_of" not in t.user_attrs
    }
    assert len(measured) == 3
    assert outcome.front and not {r.trial for r in outcome.front} & copied


# ---------------------------------------------------------------- in-process workers


def _quality(tmp: Path, trials: int, *, timeout: float | None = None, workers: int = 1):
    text = tiny_study_spec(
        tmp, name="q", trials=trials, suite=SUITE, sampler="random", seed=5, workers=workers
    )
    if timeout is not None:
        text = text.replace("[study]", f"[study]\ntrial_timeout = {timeout}")
    return parse_spec(tomllib.loads(text)), text


def _with_pool(evaluate, **kw):
    return lambda driver: InProcessPool(
        evaluate,
        count=driver.workers,
        trial_timeout_s=driver.spec.study.trial_timeout,
        max_replacements=2 * driver.workers + 1 + driver.spec.study.max_trial_retries,
        **kw,
    )


def _int4(plan_json: str) -> bool:
    return '"int4"' in plan_json


@pytest.mark.slow
def test_a_nan_objective_fails_its_trial_and_the_study_completes(tmp_path) -> None:
    # Fault 3: NaN was told (Optuna FAILed the trial) while the driver recorded the plan as
    # measured; its next duplicate read None values (TypeError) and stopped the study.
    def evaluate(plan_json: str):
        result = closed_form_result(plan_json)
        if _int4(plan_json):
            result.summary["fidelity.kl_mean"] = math.nan
        return result

    spec, text = _quality(tmp_path, trials=6)
    outcome = _run(spec, text, tmp_path, pool_factory=_with_pool(evaluate))
    trials = _trials(tmp_path, "q")
    nan = [t for t in trials if t.state == S.FAIL]
    assert nan and all(t.user_attrs["failure_reason"] == "nan" for t in nan)
    assert all(t.user_attrs["plan_fingerprint"] not in _distinct_plans(trials) for t in nan)
    assert outcome.counts["done"] == 6


@pytest.mark.slow
def test_an_mlflow_error_after_the_tell_neither_retells_nor_stops(tmp_path, monkeypatch) -> None:
    # Fault 5: an exception while logging (pyarrow's ArrowInvalid is a ValueError) reached
    # the failure path: a second tell, or a KeyError. Now the trial stays as told and its run
    # is written from the study at the end.
    from tenantq.tracking import StudyTracker

    real = StudyTracker.log_trial
    calls = {"n": 0}

    def flaky(self, number, **kw):
        calls["n"] += 1
        if calls["n"] == 2 and "tenantq.logged_on_resume" not in kw.get("tags", {}):
            raise ValueError("ArrowInvalid: could not convert 'x' with type str")
        return real(self, number, **kw)

    monkeypatch.setattr(StudyTracker, "log_trial", flaky)
    spec, text = _quality(tmp_path, trials=4)
    _run(spec, text, tmp_path, pool_factory=_with_pool(closed_form_result))
    trials = _trials(tmp_path, "q")
    assert [t.state for t in trials] == [S.COMPLETE] * len(trials)
    _, runs = _runs(tmp_path, "q")
    assert sorted(int(r.data.tags["tenantq.trial"]) for r in runs) == [t.number for t in trials]
    assert {r.info.status for r in runs} == {"FINISHED"}


@pytest.mark.slow
def test_a_hung_trial_fails_at_its_deadline_and_the_study_completes(tmp_path) -> None:
    # Fault 7: nothing ended a hung trial; the study never ended.
    spec, text = _quality(tmp_path, trials=4, timeout=0.3)
    evaluate = lambda plan_json: HANG if _int4(plan_json) else closed_form_result(plan_json)  # noqa: E731
    outcome = _run(spec, text, tmp_path, pool_factory=_with_pool(evaluate))
    trials = _trials(tmp_path, "q")
    hung = [t for t in trials if t.state == S.FAIL]
    assert hung and {t.user_attrs["failure_reason"] for t in hung} == {"timeout"}
    per_plan: dict[str, int] = {}
    for t in hung:
        fp = t.user_attrs["plan_fingerprint"]
        per_plan[fp] = per_plan.get(fp, 0) + 1
    assert max(per_plan.values()) <= 1 + spec.study.max_trial_retries
    assert outcome.counts["done"] == 4


@pytest.mark.slow
def test_a_plan_that_kills_its_worker_is_tried_at_most_its_budget(tmp_path) -> None:
    # Fault 8: each death re-queued the plan with no per-plan bound, and each round spent a
    # worker replacement of the 2 x count the whole study had: with count = 1 the study
    # aborted. Budget: 1 + max_trial_retries = 2 attempts per plan.
    killer: list[str] = []

    def evaluate(plan_json: str):  # the first int4 plan kills its worker, every time
        if _int4(plan_json) and not killer:
            killer.append(plan_json)
        if plan_json in killer:
            raise WorkerLost("the worker process died")
        return closed_form_result(plan_json)

    spec, text = _quality(tmp_path, trials=5)
    outcome = _run(spec, text, tmp_path, pool_factory=_with_pool(evaluate))
    trials = _trials(tmp_path, "q")
    died: dict[str, int] = {}
    for t in trials:
        if t.state == S.FAIL and t.user_attrs["failure_reason"] == "worker_died":
            fp = t.user_attrs["plan_fingerprint"]
            died[fp] = died.get(fp, 0) + 1
    assert list(died.values()) == [2]  # the killer plan: its budget, then settled
    assert outcome.counts["done"] == 5


# ---------------------------------------------------------------- stopping


class _Tracker:
    """What `_stop` calls on the MLflow tracker (a unit test: no MLflow needed)."""

    def __init__(self) -> None:
        self.logged: list[int] = []
        self.ended: list[str] = []

    def log_trial(self, number, **kw) -> str:
        self.logged.append(number)
        return f"run-{number}"

    def end_study(self, status, metrics=None) -> None:
        self.ended.append(status)


class _Pool:
    def __init__(self) -> None:
        self.shut = 0

    def shutdown(self) -> None:
        self.shut += 1


def test_stopping_with_a_parked_duplicate_fails_each_trial_once_and_ends_the_run() -> None:
    # `_stop` failed a dispatched trial (which fails its parked duplicate with it), then its
    # snapshot loop failed the duplicate again: LedgerError, and the pool, Ray and the parent
    # MLflow run (left RUNNING) were never shut or ended.
    from tenantq.search.driver import Heartbeats
    from tenantq.search.ledger import Ledger
    from tenantq.search.metrics import StudyMetrics

    study = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    driver = SearchDriver.__new__(SearchDriver)
    driver.ledger = ledger = Ledger(study, trials=3, failure_budget=2)
    driver.tracker, driver.study, driver._started_ray = _Tracker(), study, False
    driver.metrics = StudyMetrics("s", enabled=False)
    driver.heartbeats = Heartbeats(study._storage, study.study_name)
    driver.context = type("Ctx", (), {"config": None})()
    first, second = ledger.ask(), ledger.ask()
    assert ledger.route(first, "p") == "run"
    ledger.dispatched(first, "w0")
    assert ledger.route(second, "p") == "parked"
    pool = _Pool()
    driver._stop(pool, "FAILED")
    assert [t.state for t in study.trials] == [S.FAIL, S.FAIL]
    assert pool.shut == 1 and driver.tracker.ended == ["FAILED"]
    assert sorted(driver.tracker.logged) == [first.number, second.number]


@pytest.mark.parametrize("value", ["true", "inf", "1e308", '"90"'])
def test_trial_timeout_that_is_not_a_number_of_seconds_is_refused(tmp_path, value) -> None:
    # `true` was read as a 1 s deadline; inf and 1e308 meant "no deadline" without saying so.
    text = CAPACITY_SPEC.format(tmp=tmp_path, trials=2, seed=0, name="t", model="reference")
    text = text.replace("[study]", f"[study]\ntrial_timeout = {value}")
    with pytest.raises(ValueError, match="study.trial_timeout"):
        parse_spec(tomllib.loads(text))


def test_trial_timeout_on_a_capacity_only_study_is_named_as_having_no_effect(
    tmp_path, capsys
) -> None:
    from tenantq.search.context import study_context

    spec, text = _capacity(tmp_path, trials=2)
    study_context(spec, text)
    assert "trial_timeout" not in capsys.readouterr().err
    text = text.replace("[study]", "[study]\ntrial_timeout = 60")
    spec = parse_spec(tomllib.loads(text))
    study_context(spec, text)
    assert "study.trial_timeout = 60 has no effect" in capsys.readouterr().err


@pytest.mark.slow
def test_a_resume_refused_for_a_live_driver_leaves_the_parent_run_alone(
    tmp_path, monkeypatch
) -> None:
    # The parent MLflow run was reopened (RUNNING) before the refusal and never ended. The
    # refusal itself is Optuna's fresh heartbeats (a 25 s wait): stood in for here.
    import tenantq.search.driver as driver_mod

    spec, text = _capacity(tmp_path, trials=2)
    outcome = _run(spec, text, tmp_path)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    assert client.get_run(outcome.mlflow_parent_run_id).info.status == "FINISHED"

    def live(study, storage, name):
        raise ValueError(f"study {name!r} has trials [2] still running: another driver")

    monkeypatch.setattr(driver_mod, "requeue_dead_driver_trials", live)
    spec3, text3 = _capacity(tmp_path, trials=3)
    with pytest.raises(ValueError, match="another driver"):
        _run(spec3, text3, tmp_path, resume=True)
    assert client.get_run(outcome.mlflow_parent_run_id).info.status == "FINISHED"
