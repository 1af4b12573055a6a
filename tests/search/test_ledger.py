"""The trial ledger against real Optuna (in-memory storage): each transition's rule, and a
hypothesis state machine that drives random sequences of asks, results, failures, deaths,
deadlines and driver restarts against a small model of what must hold.

Bounds are exact counts: how many times Optuna was told about each trial (exactly once), how
many distinct plans were settled (the budget), how many attempts a failing plan had (at most
its failure budget)."""

from __future__ import annotations

import math
import sys
import warnings

import optuna
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tenantq.search.ledger import Ledger, LedgerError, State

optuna.logging.set_verbosity(optuna.logging.WARNING)
PLANS = ["p0", "p1", "p2", "p3", "p4", "p5", "a", "b", "c", "killer"]


class CountingStudy:
    """An Optuna study that counts tells per trial number (the invariant under test)."""

    def __init__(self, study: optuna.Study) -> None:
        self._study = study
        self.tells: dict[int, int] = {}

    def ask(self):
        return self._study.ask()

    def tell(self, trial, values=None, state=None):
        self.tells[trial.number] = self.tells.get(trial.number, 0) + 1
        if state is None:
            return self._study.tell(trial, values)
        return self._study.tell(trial, state=state)

    def add_trial(self, trial) -> None:
        self._study.add_trial(trial)

    def get_trials(self, **kw):
        return self._study.get_trials(**kw)


def _study(seed: int = 0) -> CountingStudy:
    return CountingStudy(
        optuna.create_study(directions=["minimize"], sampler=optuna.samplers.RandomSampler(seed))
    )


def _ask(ledger: Ledger, plan: str):
    entry = ledger.ask()
    entry.trial.suggest_categorical("plan", PLANS)  # the sampler's draw; `plan` is the route's
    return entry, ledger.route(entry, plan)


def test_a_trial_is_never_told_twice() -> None:
    # Fault 5: an exception after study.tell reached the failure path, which told again.
    study = _study()
    ledger = Ledger(study, trials=3, failure_budget=2)
    entry, where = _ask(ledger, "a")
    assert where == "run"
    ledger.dispatched(entry, "w0")
    ledger.complete(entry, [1.0])
    with pytest.raises(LedgerError, match="told already|not allowed"):
        ledger.fail(entry, "error", "logging raised after the tell")
    assert study.tells == {entry.number: 1}
    assert study.get_trials()[0].state == optuna.trial.TrialState.COMPLETE


def test_a_nan_objective_fails_the_trial_and_is_not_measured() -> None:
    # Fault 3: NaN went to study.tell (Optuna FAILs it) while the driver counted the plan
    # measured; the next duplicate then read values of a failed trial (None).
    study = _study()
    ledger = Ledger(study, trials=3, failure_budget=2)
    entry, _ = _ask(ledger, "a")
    ledger.dispatched(entry, "w0")
    ledger.complete(entry, [math.nan])
    assert entry.outcome == "failed" and entry.reason == "nan"
    assert "a" not in ledger.measured and "a" in ledger.settled  # an error of the plan itself
    again, where = _ask(ledger, "a")
    assert where == "refused" and again.reason == "failed_before"
    assert ledger.done == 1  # the refusal cost an ask, not the budget


def test_duplicates_do_not_count_toward_the_budget() -> None:
    # Fault 9: `done = complete + failed - retries` counted duplicates as plans measured.
    study = _study()
    ledger = Ledger(study, trials=2, failure_budget=2)
    for plan, expected in (("a", "run"), ("a", "duplicate"), ("a", "duplicate")):
        entry, where = _ask(ledger, plan)
        assert where == expected
        if where == "run":
            ledger.dispatched(entry, "w0")
            ledger.complete(entry, [0.5])
    assert ledger.done == 1 and ledger.wants_more()
    entry, _ = _ask(ledger, "b")
    ledger.dispatched(entry, "w0")
    ledger.complete(entry, [0.7])
    assert ledger.done == 2 and not ledger.wants_more()
    dup = [t for t in study.get_trials() if "duplicate_of" in t.user_attrs]
    assert len(dup) == 2 and all(t.values == [0.5] for t in dup)


def test_a_plan_that_kills_its_worker_fails_at_most_its_budget() -> None:
    # Fault 8: each worker death re-queued the plan with no per-plan bound.
    study = _study()
    ledger = Ledger(study, trials=2, failure_budget=2)
    attempts = 0
    while ledger.wants_more() and attempts < 10:
        entry = ledger.ask()
        plan = entry.trial.suggest_categorical("plan", PLANS) and "killer"
        if ledger.route(entry, plan) != "run":
            break
        ledger.dispatched(entry, "w0")
        attempts += 1
        ledger.fail(entry, "worker_died", "ActorDiedError")
    assert attempts == 2  # the failure budget, then the plan is settled as failed
    assert "killer" in ledger.settled and ledger.counts["retries"] == 1


def test_a_parked_duplicate_waits_for_its_plan() -> None:
    study = _study()
    ledger = Ledger(study, trials=3, failure_budget=2)
    first, _ = _ask(ledger, "a")
    ledger.dispatched(first, "w0")
    second, where = _ask(ledger, "a")
    assert where == "parked" and second.state == State.PARKED
    ledger.complete(first, [0.25])
    assert second.outcome == "complete" and second.duplicate_of == first.number
    assert study.tells == {first.number: 1, second.number: 1}


def test_restore_counts_distinct_plans_and_failures_from_the_study() -> None:
    study = _study()
    ledger = Ledger(study, trials=5, failure_budget=2)
    for plan in ("a", "a", "b"):
        entry, where = _ask(ledger, plan)
        if where == "run":
            ledger.dispatched(entry, "w0")
            ledger.complete(entry, [0.1])
    entry, _ = _ask(ledger, "c")
    ledger.dispatched(entry, "w0")
    ledger.fail(entry, "timeout", "past the deadline")
    again = Ledger(study, trials=5, failure_budget=2)
    again.restore(study.get_trials(deepcopy=False))
    assert again.done == ledger.done == 2
    assert again.failures == {"c": 1} and again.measured.keys() == {"a", "b"}
    entry, where = _ask(again, "a")  # a resumed duplicate is answered, not re-run
    assert where == "duplicate" and entry.values == [0.1]


def test_trials_failed_before_they_had_a_plan_count_no_plan_live_or_restored() -> None:
    # Killed before their plan existed (no params, no fingerprint), two trials used to settle
    # one shared key `params:[]`: a study of 3 plans then stopped after 2 measured.
    study = _study()
    ledger = Ledger(study, trials=3, failure_budget=2)
    for _ in range(2):
        entry = ledger.ask()  # no suggest: the driver died right after ask
        ledger.fail(entry, "driver_died", "the driver died")
    bad = ledger.ask()
    bad.trial.suggest_categorical("plan", PLANS)
    ledger.fail(bad, "plan", "plan: no such tenant")  # params, but no plan came of them
    assert ledger.done == 0 and not ledger.settled and not ledger.failures
    again = Ledger(study, trials=3, failure_budget=2)
    again.restore(study.get_trials(deepcopy=False))
    assert again.done == 0 and not again.settled and not again.failures


def test_a_trial_stopped_with_the_driver_settles_nothing_on_restore() -> None:
    # Live, `driver_stopped` blames no plan; restore settled it, so after Ctrl-C + --resume
    # the plan was refused for good (`failed_before`) and counted toward the budget.
    study = _study()
    ledger = Ledger(study, trials=3, failure_budget=2)
    entry, _ = _ask(ledger, "a")
    ledger.dispatched(entry, "w0")
    ledger.fail(entry, "driver_stopped", "the driver stopped before this finished")
    assert ledger.done == 0
    again = Ledger(study, trials=3, failure_budget=2)
    again.restore(study.get_trials(deepcopy=False))
    assert again.done == 0 and "a" not in again.settled
    _, where = _ask(again, "a")
    assert where == "run"


def test_values_optuna_refuses_on_tell_fail_the_trial_in_the_ledger() -> None:
    # Optuna fails (does not raise on) a tell whose values do not match the directions; the
    # ledger counted such a trial measured and answered duplicates with it.
    study = _study()
    ledger = Ledger(study, trials=3, failure_budget=2)
    entry, _ = _ask(ledger, "a")
    ledger.dispatched(entry, "w0")
    with pytest.warns(UserWarning, match="did not match"):
        ledger.complete(entry, [1.0, 2.0])  # two values, one direction
    assert entry.outcome == "failed" and "a" not in ledger.measured
    assert ledger.counts["complete"] == 0 and ledger.counts["failed"] == 1
    assert study.get_trials()[0].state == optuna.trial.TrialState.FAIL
    _, where = _ask(ledger, "a")
    assert where == "refused"  # the plan's own error settles it: never measured


def test_retries_still_waiting_when_the_budget_fills_are_closed_and_count_nothing() -> None:
    # A retry queued (WAITING) when other plans then filled the budget stayed WAITING in the
    # study for ever: a trial that would never run.
    study = _study()
    ledger = Ledger(study, trials=1, failure_budget=2)
    dying, _ = _ask(ledger, "a")
    other, _ = _ask(ledger, "b")  # two workers: both in flight
    ledger.dispatched(dying, "w0")
    ledger.dispatched(other, "w1")
    ledger.fail(dying, "worker_died", "ActorDiedError")  # a retry is queued
    ledger.complete(other, [0.5])
    assert not ledger.wants_more() and ledger.done == 1
    waiting = optuna.trial.TrialState.WAITING
    assert len(study.get_trials(states=(waiting,))) == 1
    assert ledger.close_waiting() == 1
    assert not study.get_trials(states=(waiting,))
    assert ledger.done == 1 and ledger.failures == {"a": 1}
    closed = study.get_trials()[-1]
    assert closed.user_attrs["failure_reason"] == "not_run" and "retry_of" in closed.user_attrs


def test_a_retry_closed_unrun_settles_nothing_on_restore() -> None:
    # Live, a retry closed when the budget filled (`not_run`) counts nothing; restore read its
    # copied fingerprint and settled the plan, so a resume with a larger budget refused a plan
    # with a retry left (`failed_before`) and counted it done.
    study = _study()
    ledger = Ledger(study, trials=1, failure_budget=2)
    dying, _ = _ask(ledger, "a")
    other, _ = _ask(ledger, "b")
    ledger.dispatched(dying, "w0")
    ledger.dispatched(other, "w1")
    ledger.fail(dying, "worker_died", "ActorDiedError")
    ledger.complete(other, [0.5])
    assert ledger.close_waiting() == 1
    again = Ledger(study, trials=2, failure_budget=2)
    again.restore(study.get_trials(deepcopy=False))
    assert again.done == ledger.done == 1 and again.failures == ledger.failures == {"a": 1}
    _, where = _ask(again, "a")
    assert where == "run"


def test_logged_moves_a_told_trial_out_of_the_live_set() -> None:
    # A no-op `logged()` left every trial live: `untold_logs` grew for ever.
    ledger = Ledger(_study(), trials=2, failure_budget=2)
    entry, _ = _ask(ledger, "a")
    ledger.dispatched(entry, "w0")
    ledger.complete(entry, [0.5])
    assert ledger.untold_logs() == [entry]
    ledger.logged(entry)
    assert entry.state == State.LOGGED and not ledger.live and not ledger.untold_logs()
    with pytest.raises(LedgerError):
        ledger.logged(entry)  # only forward


class LedgerMachine(RuleBasedStateMachine):
    """Random sequences of asks (the sampler's proposal is drawn by hypothesis), results,
    non-finite values, trial errors, worker deaths, deadlines and driver restarts (a new
    ledger restored from the study, the live trials failed as the dead driver's)."""

    @initialize(trials=st.integers(1, 4), budget=st.integers(1, 3))
    def start(self, trials: int, budget: int) -> None:
        self.study = _study()
        self.trials, self.budget = trials, budget
        self.ledger = Ledger(self.study, trials=trials, failure_budget=budget)
        self.attempts: dict[str, int] = {}  # plan -> dispatched attempts that failed
        self.dispatched: list = []
        self.measured_before_restart: set[str] = set()
        self.rerun_after_restart: list[str] = []
        self.model_settled: set[str] = set()  # the model: measured, or failed for good
        self.rerun_settled: list[str] = []
        self.model_measured: dict[str, float] = {}  # plan -> its first finite value
        self.wrong_answers: list[tuple] = []
        self.logged: list = []

    @precondition(lambda self: self.ledger.wants_more())
    @rule(plan=st.sampled_from(PLANS[:3]))  # few plans: duplicates and exhaustion are common
    def ask(self, plan: str) -> None:
        entry = self.ledger.ask()
        retry_of_a_plan = "plan" in entry.trial.params  # a WAITING retry keeps its plan
        entry.trial.suggest_categorical("plan", PLANS)
        plan = entry.trial.params["plan"] if retry_of_a_plan else plan
        where = self.ledger.route(entry, plan)
        if plan in self.model_measured and entry.values != [self.model_measured[plan]]:
            self.wrong_answers.append((plan, where, entry.values))
        if where == "run":
            if plan in self.model_settled:
                self.rerun_settled.append(plan)
            if plan in self.measured_before_restart:
                self.rerun_after_restart.append(plan)
            self.ledger.dispatched(entry, "w")
            self.dispatched.append(entry)

    def _take(self, index: int):
        self.dispatched = [e for e in self.dispatched if e.state == State.DISPATCHED]
        return self.dispatched[index % len(self.dispatched)] if self.dispatched else None

    @rule(index=st.integers(0, 5), value=st.sampled_from([0.1, 0.5, math.nan, math.inf]))
    def result(self, index: int, value: float) -> None:
        entry = self._take(index)
        if entry is not None:
            self.ledger.complete(entry, [value])
            self.model_settled.add(entry.fingerprint)  # a number, or an error of the plan
            if math.isfinite(value):
                self.model_measured[entry.fingerprint] = value

    @rule(index=st.integers(0, 5), reason=st.sampled_from(["error", "worker_died", "timeout"]))
    def failure(self, index: int, reason: str) -> None:
        entry = self._take(index)
        if entry is not None:
            fp = entry.fingerprint
            if reason != "error":
                self.attempts[fp] = self.attempts.get(fp, 0) + 1
            if reason == "error" or self.attempts[fp] >= self.budget:
                self.model_settled.add(fp)
            self.ledger.fail(entry, reason, reason)

    @rule(index=st.integers(0, 5))
    def driver_stopped(self, index: int) -> None:
        # Ctrl-C or an error in the driver: the plan is not blamed (no attempt, not settled).
        entry = self._take(index)
        if entry is not None:
            self.ledger.fail(entry, "driver_stopped", "the driver stopped")

    @rule()
    def log_everything(self) -> None:
        for entry in self.ledger.untold_logs():
            self.ledger.logged(entry)
            self.logged.append(entry)

    @precondition(lambda self: self.ledger.wants_more())
    @rule()
    def killed_right_after_ask(self) -> None:
        # The driver dies inside ask: a trial with no parameters and no plan.
        self.ledger.ask()
        self.driver_killed_and_resumed()

    @rule()
    def driver_killed_and_resumed(self) -> None:
        # The dead driver's trials are failed as Optuna's stale-trial check does (no reason
        # recorded: "driver_died", retryable) and re-queued by its retry callback (at most
        # budget - 1 retries, as `RetryHeartbeatStaleTrialCallback(max_trial_retries)`);
        # a new ledger reads the study once.
        with warnings.catch_warnings():  # experimental in Optuna 5
            warnings.simplefilter("ignore")
            retry = optuna.storages.RetryFailedTrialCallback(max_retry=self.budget - 1)
        for entry in self.ledger.unfinished():
            if entry.state == State.DISPATCHED:
                fp = entry.fingerprint
                self.attempts[fp] = self.attempts.get(fp, 0) + 1
                if self.attempts[fp] >= self.budget:
                    self.model_settled.add(fp)
            frozen = self.study.tell(entry.trial, state=optuna.trial.TrialState.FAIL)
            retry(self.study._study, frozen)
        self.measured_before_restart |= set(self.ledger.measured)
        self.ledger = Ledger(self.study, trials=self.trials, failure_budget=self.budget)
        self.ledger.restore(self.study.get_trials(deepcopy=False))
        self.dispatched = []

    @invariant()
    def a_logged_trial_leaves_the_live_set(self) -> None:
        for entry in self.logged:
            assert entry.state == State.LOGGED and entry.number not in self.ledger.live

    @invariant()
    def the_study_holds_no_more_measured_plans_than_the_budget(self) -> None:
        # counted from Optuna's record, not from the ledger's own `done`
        measured = {
            t.user_attrs["plan_fingerprint"]
            for t in self.study.get_trials(deepcopy=False)
            if t.state == optuna.trial.TrialState.COMPLETE and "duplicate_of" not in t.user_attrs
        }
        assert len(measured) <= self.trials, (measured, self.trials)

    @invariant()
    def told_at_most_once(self) -> None:
        assert all(n == 1 for n in self.study.tells.values()), self.study.tells

    @invariant()
    def a_failing_plan_is_tried_at_most_its_budget(self) -> None:
        assert all(n <= self.budget for n in self.attempts.values()), self.attempts

    @invariant()
    def the_budget_is_never_exceeded(self) -> None:
        assert self.ledger.done <= self.trials
        assert self.ledger.done + len(self.ledger.in_flight) <= self.trials

    @invariant()
    def a_resume_reruns_no_measured_plan(self) -> None:
        assert not self.rerun_after_restart

    @invariant()
    def a_measured_plan_is_answered_with_its_measurement(self) -> None:
        assert not self.wrong_answers, self.wrong_answers

    @invariant()
    def a_settled_plan_is_never_run_again(self) -> None:
        assert not self.rerun_settled, self.rerun_settled

    @invariant()
    def every_told_trial_is_finished_in_optuna(self) -> None:
        states = {t.number: t.state for t in self.study.get_trials(deepcopy=False)}
        for number in self.study.tells:
            assert states[number].is_finished()

    def teardown(self) -> None:
        # Drain: finish every trial in flight, then ask until the ledger stops. Every asked
        # trial is then told exactly once and the budget is met (the space has 6 plans, at
        # most 4 trials: never exhausted unless failures settled every plan).
        if not hasattr(self, "ledger"):
            return
        for _ in range(200):
            for entry in list(self.ledger.unfinished()):
                if entry.state == State.DISPATCHED:
                    self.ledger.complete(entry, [0.3])
            if not self.ledger.wants_more():
                break
            self.ask(PLANS[len(self.study.tells) % 3])
        asked = {t.number for t in self.study.get_trials(deepcopy=False)} - {
            t.number
            for t in self.study.get_trials(
                deepcopy=False, states=(optuna.trial.TrialState.WAITING,)
            )
        }
        assert set(self.study.tells) == asked
        assert all(n == 1 for n in self.study.tells.values())
        assert self.ledger.done == self.trials or self.ledger.exhausted()
        # the budget as Optuna's record and the model see it: plans measured in the study,
        # and plans the model failed for good (a plan-less kill settles none)
        measured = {
            t.user_attrs["plan_fingerprint"]
            for t in self.study.get_trials(deepcopy=False)
            if t.state == optuna.trial.TrialState.COMPLETE and "duplicate_of" not in t.user_attrs
        }
        settled = measured | self.model_settled
        assert len(settled) == self.trials or self.ledger.exhausted(), (settled, self.trials)


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(
    derandomize=True,  # the same sequences on every run: a failure is reproducible
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    # Under mutmut (its runner imports it before collecting the tests) a failing mutant needs
    # no minimal example: without shrinking, a killed mutant stops at its first failure.
    phases=[p for p in settings.default.phases if p not in (Phase.shrink, Phase.explain)]
    if "mutmut" in sys.modules
    else settings.default.phases,
)


def test_a_waiting_baseline_does_not_keep_retries_waiting_at_the_end() -> None:
    # Issue 22 follow-up: waiting retries were closed only when no enqueued baseline waited
    # too, so a study with a baseline the budget had no room for ended holding WAITING trials.
    study = _study()
    ledger = Ledger(study, trials=1, failure_budget=2)
    dying, _ = _ask(ledger, "a")
    other, _ = _ask(ledger, "b")
    ledger.dispatched(dying, "w0")
    ledger.dispatched(other, "w1")
    ledger.fail(dying, "worker_died", "ActorDiedError")  # a retry is queued
    study._study.enqueue_trial({"plan": "p0"}, user_attrs={"baseline": True})
    ledger.complete(other, [0.5])
    assert not ledger.wants_more()
    assert ledger.close_waiting() == 2
    S = optuna.trial.TrialState
    assert not study.get_trials(states=(S.WAITING, S.RUNNING))
    closed = [t for t in study.get_trials() if t.user_attrs.get("failure_reason") == "not_run"]
    assert len(closed) == 2 and ledger.done == 1 and ledger.failures == {"a": 1}
    # The closed retry carries its plan's fingerprint (copied): restore blames no plan for it.
    again = Ledger(study, trials=1, failure_budget=2)
    again.restore(study.get_trials(deepcopy=False))
    assert again.failures == {"a": 1} and again.settled == {"b"}


def _old_fail(study, number_params: str, attrs: dict, system: dict | None = None) -> None:
    """A FAIL trial as a driver before `dispatched_trial` (or `failure_reason`) wrote it."""
    dist = optuna.distributions.CategoricalDistribution(PLANS)
    study._study.add_trial(
        optuna.trial.create_trial(
            state=optuna.trial.TrialState.FAIL,
            params={"plan": number_params},
            distributions={"plan": dist},
            user_attrs=attrs,
            system_attrs=system or {},
        )
    )


def test_failures_recorded_before_dispatched_trial_existed_count_on_restore() -> None:
    # Restore counted a retryable failure only with `dispatched_trial` == its number, so every
    # failure an older driver recorded counted nothing: after an upgrade a plan that had
    # killed its worker twice got two more attempts. Budget: 2 attempts per plan.
    lost = "ActorDiedError: the actor died (worker lost; Ray's restarts and retries exhausted)"
    study = _study()
    # Before `failure_reason` (the single-file driver): the reason is in the error text.
    _old_fail(study, "killer", {"plan_fingerprint": "killer", "worker": "w0", "error": lost})
    _old_fail(  # its retry ran and died too (an error and a worker of its own)
        study,
        "killer",
        {"plan_fingerprint": "killer", "worker": "w1", "error": lost + " again"},
        {"failed_trial": 0, "retry_history": [0]},
    )
    _old_fail(study, "a", {"plan_fingerprint": "a", "worker": "w0", "error": "ValueError: x"})
    # The ledger before `dispatched_trial`: a reason, a worker.
    _old_fail(study, "b", {"plan_fingerprint": "b", "failure_reason": "timeout", "worker": "w0"})
    # Not the plan's fault: a copy killed before it ran (everything inherited from trial 4),
    # and a parked duplicate killed with the driver (no worker, no error).
    _old_fail(study, "c", {"plan_fingerprint": "c", "worker": "w0", "error": lost})
    _old_fail(
        study,
        "c",
        {"plan_fingerprint": "c", "worker": "w0", "error": lost},
        {"failed_trial": 4, "retry_history": [4]},
    )
    _old_fail(study, "p0", {"plan_fingerprint": "p0"})
    ledger = Ledger(study, trials=9, failure_budget=2)
    ledger.restore(study.get_trials(deepcopy=False))
    assert ledger.failures == {"killer": 2, "b": 1, "c": 1}
    assert ledger.settled == {"killer", "a"}
    assert [_ask(ledger, plan)[1] for plan in ("killer", "a", "b", "p0")] == [
        "refused",
        "refused",
        "run",
        "run",
    ]


def test_trials_closed_unrun_are_not_counted_as_failed_or_asked() -> None:
    # A trial closed `not_run` (a baseline the budget had no room for) never ran: counting it
    # in `failed` made a study with no failure print "1 failed" (CLI, MLflow study.failed),
    # and counting its ask spent the cap on asks. Live and on restore alike.
    study = _study()
    ledger = Ledger(study, trials=1, failure_budget=2)
    study._study.enqueue_trial({"plan": "p0"}, user_attrs={"baseline": True})
    study._study.enqueue_trial({"plan": "p1"}, user_attrs={"baseline": True})
    first, _ = _ask(ledger, "p0")
    ledger.dispatched(first, "w0")
    ledger.complete(first, [0.5])
    assert ledger.close_waiting() == 1
    assert ledger.counts["failed"] == 0 and ledger.counts["not_run"] == 1
    assert ledger.asks == 1
    again = Ledger(study, trials=1, failure_budget=2)
    again.restore(study.get_trials(deepcopy=False))
    assert again.counts["failed"] == 0 and again.counts["not_run"] == 1
    assert again.asks == 1 and again.done == 1


def test_a_baseline_whose_requeued_copy_was_closed_unrun_is_enqueued_again() -> None:
    # Kill and resume: the fp8 baseline was running when the driver was killed; on resume
    # Optuna failed it stale (no reason: driver_died) and queued a copy, which the full budget
    # closed `not_run`. The next start with a larger budget did not enqueue the baseline again
    # (the stale original "held" it), so it was never measured. A baseline is held only by a
    # trial that measures or will measure it, or by its plan being settled for good.
    from tenantq.search.store import enqueue_baselines

    raw = optuna.create_study(directions=["minimize"])
    dist = {"plan": optuna.distributions.CategoricalDistribution(PLANS)}

    def add(plan, state, attrs=None, system=None):
        raw.add_trial(
            optuna.trial.create_trial(
                state=state,
                params={"plan": plan},
                distributions=dist,
                values=[1.0] if state == optuna.trial.TrialState.COMPLETE else None,
                user_attrs={"baseline": True, **(attrs or {})},
                system_attrs={"fixed_params": {"plan": plan}, **(system or {})},
            )
        )

    S = optuna.trial.TrialState
    add("p0", S.FAIL, {"dispatched_trial": 0, "plan_fingerprint": "f0"})  # stale: driver_died
    add("p0", S.FAIL, {"failure_reason": "not_run"}, {"failed_trial": 0, "retry_history": [0]})
    add("p1", S.COMPLETE, {"plan_fingerprint": "f1"})
    add("p2", S.FAIL, {"failure_reason": "error", "plan_fingerprint": "f2"})
    add("p3", S.FAIL, {"failure_reason": "driver_stopped", "plan_fingerprint": "f3"})
    settled = {"f1", "f2"}
    enqueue_baselines(
        raw,
        [{"plan": p} for p in ("p0", "p1", "p2", "p3")],
        settled=lambda params: "f" + params["plan"][1:] in settled,
    )
    waiting = raw.get_trials(states=(S.WAITING,))
    assert sorted(t.system_attrs["fixed_params"]["plan"] for t in waiting) == ["p0", "p3"]
    enqueue_baselines(raw, [{"plan": "p0"}], settled=lambda params: False)
    assert len(raw.get_trials(states=(S.WAITING,))) == 2  # a waiting baseline holds it


def test_a_ledger_era_trial_killed_while_running_counts_by_its_own_worker() -> None:
    # Records of the ledger before `dispatched_trial`: a trial killed with the driver while
    # its plan ran has no reason (Optuna failed it stale) but a `worker` of its own, and
    # counts against its plan; Optuna's copy of it inherited that worker and, killed before
    # it was dispatched, counts nothing. Budget 3: one attempt counted leaves the plan open.
    study = _study()
    _old_fail(study, "a", {"plan_fingerprint": "a", "worker": "w0"})
    _old_fail(
        study,
        "a",
        {"plan_fingerprint": "a", "worker": "w0"},
        {"failed_trial": 0, "retry_history": [0]},
    )
    _old_fail(study, "b", {"plan_fingerprint": "b"})  # killed before dispatch: no worker
    ledger = Ledger(study, trials=5, failure_budget=3)
    ledger.restore(study.get_trials(deepcopy=False))
    assert ledger.failures == {"a": 1} and not ledger.settled
