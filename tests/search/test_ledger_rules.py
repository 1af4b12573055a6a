"""The ledger's smaller rules, each alone against real Optuna (in-memory storage): what a
retry copies, what a told trial carries (constraints, worker, a bounded error), the budget's
floors and cap, the `on_told` hook, deferred logging, and the one-line `LedgerError`s.

Bounds are exact: the numbers come from the rule under test (a failure budget below 1 is 1,
ten asks per trial of the budget, errors kept to 2,000 characters)."""

from __future__ import annotations

import warnings

import optuna
import pytest

from tenantq.search.ledger import (
    ASKS_PER_TRIAL,
    COPIED_ATTR,
    Ledger,
    LedgerError,
    State,
    failure_of,
)

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _study() -> optuna.Study:
    return optuna.create_study(directions=["minimize"], sampler=optuna.samplers.RandomSampler(0))


def _run(ledger: Ledger, plan: str, worker: str | None = "w0"):
    entry = ledger.ask()
    entry.trial.suggest_categorical("plan", ["a", "b", "c"])
    assert ledger.route(entry, plan) == "run"
    ledger.dispatched(entry, worker)
    return entry


def test_a_retry_copies_the_plan_and_attributes_but_not_the_failures_own() -> None:
    study = _study()
    ledger = Ledger(study, trials=2, failure_budget=3)
    entry = _run(ledger, "a", worker="w7")
    entry.trial.set_user_attr("worker_pid", 4242)
    entry.trial.set_user_attr("summary", {"kl": 0.1})
    ledger.fail(entry, "worker_died", "ActorDiedError: the node died")
    (retry,) = study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert retry.params == entry.trial.params
    assert retry.system_attrs["failed_trial"] == entry.number
    # the plan's own attributes travel, the failed attempt's (error, reason, worker) do not
    assert retry.user_attrs == {
        "plan_fingerprint": "a",
        "dispatched_trial": entry.number,
        "summary": {"kl": 0.1},
        "retry_of": entry.number,
    }
    assert ledger.counts["retries"] == 1 and ledger.failures == {"a": 1}


def test_a_told_trial_records_its_worker_its_reason_and_at_most_2000_characters_of_error() -> None:
    study = _study()
    ledger = Ledger(study, trials=2, failure_budget=1)
    entry = _run(ledger, "a", worker="w3")
    ledger.fail(entry, "error", "x" * 2500)
    (frozen,) = study.get_trials()
    assert frozen.user_attrs["worker"] == entry.worker == "w3"
    assert frozen.user_attrs["failure_reason"] == "error"
    assert frozen.user_attrs["error"] == "x" * 2000
    assert entry.error == "x" * 2500  # the driver's own record keeps it whole
    nameless = _run(ledger, "b", worker=None)
    ledger.complete(nameless, [0.5])
    assert "worker" not in study.get_trials()[-1].user_attrs and nameless.worker is None


def test_constraints_are_told_with_the_values_and_a_duplicate_repeats_them() -> None:
    study = _study()
    ledger = Ledger(study, trials=2, failure_budget=1)
    entry = _run(ledger, "a")
    entry.trial.set_user_attr("summary", {"tenants": 7})  # as the driver records it
    ledger.complete(entry, [0.5], constraints={"fits": -1.0}, summary={"tenants": 7})
    assert entry.constraints == {"fits": -1.0} and entry.summary == {"tenants": 7}
    dup = ledger.ask()
    dup.trial.suggest_categorical("plan", ["a", "b", "c"])
    assert ledger.route(dup, "a") == "duplicate"
    first, second = study.get_trials()
    assert first.constraints == second.constraints == {"fits": -1.0}
    assert second.user_attrs["summary"] == {"tenants": 7}
    assert second.user_attrs["duplicate_of"] == entry.number == dup.duplicate_of
    assert dup.values == [0.5] and dup.constraints == {"fits": -1.0}
    # resumed, the duplicate's answer comes from the study's record: the same constraints
    again = Ledger(study, trials=2, failure_budget=1)
    again.restore(study.get_trials(deepcopy=False))
    assert again.results[entry.number] == ([0.5], {"fits": -1.0}, {"tenants": 7})


def test_a_failure_budget_below_one_still_allows_one_attempt() -> None:
    for budget in (0, -3):
        ledger = Ledger(_study(), trials=1, failure_budget=budget)
        assert ledger.failure_budget == 1
        entry = _run(ledger, "a")
        ledger.fail(entry, "worker_died", "lost")
        assert ledger.counts["retries"] == 0 and "a" in ledger.settled and ledger.done == 1


def test_asks_are_capped_at_ten_per_trial_of_the_budget_unless_given() -> None:
    assert ASKS_PER_TRIAL == 10
    assert Ledger(_study(), trials=3, failure_budget=1).max_asks == 30
    assert Ledger(_study(), trials=3, failure_budget=1, max_asks=0).max_asks == 0
    ledger = Ledger(_study(), trials=2, failure_budget=1, max_asks=2)
    first = _run(ledger, "a")
    ledger.complete(first, [0.1])
    dup = ledger.ask()
    dup.trial.suggest_categorical("plan", ["a", "b", "c"])
    ledger.route(dup, "a")  # a measured plan again: an ask used, no plan settled
    assert ledger.asks == 2 and ledger.done == 1
    assert not ledger.wants_more() and ledger.exhausted() and ledger.finished()


def test_a_study_that_settled_its_budget_is_not_exhausted_at_the_cap() -> None:
    ledger = Ledger(_study(), trials=1, failure_budget=1, max_asks=1)
    ledger.complete(_run(ledger, "a"), [0.1])
    assert ledger.asks == 1 and ledger.done == 1 and not ledger.exhausted()


def test_on_told_hears_each_trial_once_after_optuna_was_told() -> None:
    heard: list[tuple[int, str, str]] = []
    study = _study()

    def hook(entry) -> None:
        state = study.get_trials()[entry.number].state.name
        heard.append((entry.number, entry.outcome, state))

    ledger = Ledger(study, trials=3, failure_budget=1, on_told=hook)
    ledger.complete(_run(ledger, "a"), [0.1])
    ledger.fail(_run(ledger, "b"), "plan", "plan: no such tenant")
    assert heard == [(0, "complete", "COMPLETE"), (1, "failed", "FAIL")]


def test_a_trial_whose_run_could_not_be_logged_leaves_the_live_set_and_is_remembered() -> None:
    ledger = Ledger(_study(), trials=2, failure_budget=1)
    entry = _run(ledger, "a")
    with pytest.raises(LedgerError, match=r"^trial 0 is dispatched, not told$"):
        ledger.log_deferred(entry)  # not told yet: its outcome does not exist
    ledger.complete(entry, [0.1])
    ledger.log_deferred(entry)
    assert ledger.deferred == {0} and 0 not in ledger.live and entry.state == State.TOLD
    assert not ledger.untold_logs()


def test_an_unknown_reason_or_a_second_tell_is_a_one_line_ledger_error() -> None:
    ledger = Ledger(_study(), trials=2, failure_budget=1)
    entry = _run(ledger, "a")
    with pytest.raises(LedgerError) as err:
        ledger.fail(entry, "oops", "?")
    assert str(err.value) == "unknown failure reason 'oops'"
    assert entry.outcome is None and entry.state == State.DISPATCHED  # nothing was told
    ledger.complete(entry, [0.1])
    with pytest.raises(LedgerError) as err:
        ledger.complete(entry, [0.2])
    assert str(err.value) == "trial 0 was told already (complete)"
    with pytest.raises(LedgerError) as err:
        ledger.dispatched(entry, "w1")
    assert str(err.value) == "trial 0: told -> dispatched is not allowed"
    with pytest.raises(LedgerError) as err:
        ledger.route(entry, "b")
    assert str(err.value) == "trial 0 is told, not asked"
    with pytest.raises(LedgerError) as err:
        ledger._tell(entry, "failed")  # the ledger's one door to Optuna refuses a second tell
    assert str(err.value) == "trial 0 was told already (complete)"


def test_non_finite_or_non_numeric_values_fail_the_trial_with_reason_nan() -> None:
    for bad in ([float("nan")], [float("inf")], ["0.5"], [None]):
        ledger = Ledger(_study(), trials=1, failure_budget=1)
        entry = _run(ledger, "a")
        ledger.complete(entry, bad)
        assert entry.outcome == "failed" and entry.reason == "nan"
        assert entry.error == f"objective values {bad} are not all finite numbers"
        assert "a" in ledger.settled and "a" not in ledger.measured
    ledger = Ledger(_study(), trials=1, failure_budget=1)
    entry = _run(ledger, "a")
    ledger.complete(entry, [1])  # an int is a number
    assert entry.outcome == "complete" and entry.values == [1.0]
    assert isinstance(entry.values[0], float)


def test_a_ledger_with_asks_left_or_a_trial_in_flight_is_not_finished() -> None:
    ledger = Ledger(_study(), trials=1, failure_budget=1)
    assert ledger.wants_more() and not ledger.unfinished()
    assert not ledger.finished()  # nothing in flight, but the budget is not filled
    entry = _run(ledger, "a")
    assert not ledger.wants_more() and ledger.unfinished() == [entry]
    assert not ledger.finished()  # no more asks, but a trial is still out
    ledger.complete(entry, [0.1])
    assert ledger.finished()


def test_closing_the_waiting_trials_uses_no_ask_of_the_cap_and_says_why() -> None:
    study = _study()
    ledger = Ledger(study, trials=1, failure_budget=2)
    dying = _run(ledger, "a")
    other = _run(ledger, "b")
    ledger.fail(dying, "worker_died", "ActorDiedError")  # a retry is queued (WAITING)
    ledger.complete(other, [0.5])
    assert ledger.asks == 2
    assert ledger.close_waiting() == 1
    assert ledger.asks == 2  # the close asked Optuna once, but drew nothing for the study
    closed = study.get_trials()[-1]
    assert closed.state == optuna.trial.TrialState.FAIL
    assert closed.user_attrs["failure_reason"] == "not_run"
    assert closed.user_attrs["error"] == "left waiting when the study's budget filled"


def test_each_duplicate_answered_is_counted_once() -> None:
    ledger = Ledger(_study(), trials=1, failure_budget=1)
    ledger.complete(_run(ledger, "a"), [0.5])
    for _ in range(2):
        dup = ledger.ask()
        dup.trial.suggest_categorical("plan", ["a", "b", "c"])
        assert ledger.route(dup, "a") == "duplicate"
    assert ledger.counts["duplicates"] == 2 and ledger.counts["complete"] == 3


def test_each_retry_queued_is_counted_and_the_last_failure_queues_none() -> None:
    study = _study()
    ledger = Ledger(study, trials=1, failure_budget=3)
    params = []
    for attempt in range(3):
        entry = _run(ledger, "a")  # the second and third asks take the WAITING retry
        params.append(entry.trial.params)
        ledger.fail(entry, "worker_died", f"lost {attempt}")
    assert params[1] == params[2] == params[0]
    assert ledger.counts["retries"] == 2 and ledger.failures == {"a": 3}
    assert "a" in ledger.settled
    assert not study.get_trials(states=(optuna.trial.TrialState.WAITING,))


def test_an_old_retry_record_owns_only_the_attributes_that_differ_from_its_parents() -> None:
    # Records from before `failure_reason` and `dispatched_trial`: a copy inherits its
    # parent's error and worker; only a value that differs from the trial it copies (its
    # last `retry_history` entry, else `failed_trial`) is its own.
    study = _study()
    ran_on_w1 = {"plan_fingerprint": "a", "worker": "w1", "error": "ValueError: w1 broke"}
    for user_attrs, system_attrs in (
        ({"plan_fingerprint": "a", "worker": "w0", "error": "(worker lost w0)"}, {}),
        (ran_on_w1, {"failed_trial": 0, "retry_history": [0]}),  # Optuna's retry of 0
        (ran_on_w1, {"failed_trial": 0, "retry_history": [0, 1]}),  # Optuna's retry of 1
        (ran_on_w1 | {"retry_of": 1}, {"failed_trial": 1}),  # the ledger's retry of 1
    ):
        study.add_trial(
            optuna.trial.create_trial(
                state=optuna.trial.TrialState.FAIL,
                user_attrs=user_attrs,
                system_attrs=system_attrs,
            )
        )
    trials = study.get_trials()
    by_number = {t.number: t for t in trials}
    assert failure_of(trials[0], by_number) == ("worker_died", True)
    assert failure_of(trials[1], by_number) == ("error", True)  # differs from trial 0
    # killed before they ran: every attribute is their parent's (trial 1), none their own
    assert failure_of(trials[2], by_number) == ("driver_died", False)
    assert failure_of(trials[3], by_number) == ("driver_died", False)


def _add(study: optuna.Study, state: str, values=None, system_attrs=None, **user_attrs) -> None:
    study.add_trial(
        optuna.trial.create_trial(
            state=optuna.trial.TrialState[state],
            values=values,
            user_attrs=user_attrs,
            system_attrs=system_attrs or {},
        )
    )


def test_an_old_record_lost_to_its_worker_or_deadline_ran_without_a_worker_of_its_own() -> None:
    # Before `dispatched_trial`: only a trial that ran can lose its worker or its deadline.
    study = _study()
    _add(study, "FAIL", failure_reason="worker_died", plan_fingerprint="a")
    _add(study, "FAIL", failure_reason="timeout", plan_fingerprint="a")
    _add(study, "FAIL", failure_reason="error", plan_fingerprint="a")  # no worker: not run
    trials = study.get_trials()
    by_number = {t.number: t for t in trials}
    assert [failure_of(t, by_number) for t in trials] == [
        ("worker_died", True),
        ("timeout", True),
        ("error", False),
    ]


def test_restore_reads_every_trial_and_skips_copies_and_trials_closed_unrun() -> None:
    study = _study()
    _add(study, "COMPLETE", [0.1], plan_fingerprint="x", **{COPIED_ATTR: "old-study"})
    _add(study, "FAIL", failure_reason="not_run", plan_fingerprint="y")
    _add(study, "FAIL", failure_reason="not_run", plan_fingerprint="y")
    _add(study, "COMPLETE", [0.2], plan_fingerprint="a")
    _add(study, "COMPLETE", [0.3], plan_fingerprint="b")
    for _ in range(3):  # three duplicates of "a", answered from trial 3
        _add(study, "COMPLETE", [0.2], plan_fingerprint="a", duplicate_of=3)
    ledger = Ledger(study, trials=5, failure_budget=1)
    ledger.restore(study.get_trials(deepcopy=False))
    assert ledger.asks == 5  # two plans measured, three duplicates; no copy or closed trial
    assert ledger.counts["not_run"] == 2 and ledger.counts["complete"] == 5
    assert ledger.counts["duplicates"] == 3
    assert ledger.measured == {"a": 3, "b": 4} and ledger.settled == {"a", "b"}
    assert ledger.results[3] == ([0.2], {}, {}) and ledger.failures == {}


def test_restore_counts_each_failure_and_each_retry_and_blames_no_plan_for_a_duplicate() -> None:
    study = _study()
    lost = {"failure_reason": "worker_died", "plan_fingerprint": "a"}
    _add(study, "FAIL", dispatched_trial=0, **lost)
    _add(study, "FAIL", system_attrs={"failed_trial": 0}, dispatched_trial=1, **lost)  # Optuna's
    # an older retry, marked by the ledger's `retry_of` alone, that failed on its own error
    _add(
        study, "FAIL", failure_reason="error", plan_fingerprint="c", retry_of=9, dispatched_trial=2
    )
    _add(study, "FAIL", failure_reason="duplicate", plan_fingerprint="d")
    ledger = Ledger(study, trials=5, failure_budget=3)
    ledger.restore(study.get_trials(deepcopy=False))
    assert ledger.counts["failed"] == 4 and ledger.counts["retries"] == 2
    assert ledger.failures == {"a": 2} and ledger.settled == {"c"}  # "a" has a retry left
    assert ledger.asks == 4


def test_a_duplicate_failure_blames_no_plan_even_for_a_dispatched_trial() -> None:
    # As `restore` reads it: a trial failed as a duplicate never settles or charges its plan.
    ledger = Ledger(_study(), trials=2, failure_budget=1)
    entry = _run(ledger, "a")
    ledger.fail(entry, "duplicate", "the trial measuring the same plan failed")
    assert ledger.failures == {} and ledger.settled == set() and ledger.done == 0
    assert ledger.counts["failed"] == 1 and ledger.counts["retries"] == 0


def test_values_optuna_refuses_on_tell_fail_the_trial_as_the_plans_own_error() -> None:
    ledger = Ledger(_study(), trials=1, failure_budget=3)
    entry = _run(ledger, "a")
    with pytest.warns(UserWarning, match="did not match"):  # Optuna's, on a FAIL it tells
        ledger.complete(entry, [1.0, 2.0])  # two values for one direction
    assert entry.outcome == "failed" and entry.reason == "error"
    assert entry.error == "Optuna failed the trial on tell (values it could not take)"
    assert ledger.settled == {"a"} and ledger.counts["retries"] == 0


def test_a_trial_parked_on_a_plan_that_fails_for_good_is_failed_as_its_duplicate() -> None:
    study = _study()
    ledger = Ledger(study, trials=2, failure_budget=1)
    first = _run(ledger, "a")
    parked = ledger.ask()
    parked.trial.suggest_categorical("plan", ["a", "b", "c"])
    assert ledger.route(parked, "a") == "parked"
    ledger.fail(first, "error", "ValueError: the plan broke")
    assert parked.state == State.TOLD and parked.outcome == "failed"
    assert parked.reason == "duplicate"
    assert parked.error == "the trial measuring the same plan failed"
    assert study.get_trials()[parked.number].user_attrs["failure_reason"] == "duplicate"
    assert ledger.counts["failed"] == 2 and ledger.settled == {"a"} and not ledger.parked


def test_a_plan_failed_for_good_refuses_a_later_trial_and_says_why() -> None:
    ledger = Ledger(_study(), trials=2, failure_budget=1)
    ledger.fail(_run(ledger, "a"), "error", "ValueError: the plan broke")
    later = ledger.ask()
    later.trial.suggest_categorical("plan", ["a", "b", "c"])
    assert ledger.route(later, "a") == "refused"
    assert later.outcome == "failed" and later.reason == "failed_before"
    assert later.error == "this plan failed for good in an earlier trial"


def test_a_failure_is_told_as_fail_without_a_warning_from_optuna() -> None:
    # Told FAIL outright: told with no state, Optuna would fail it too, warning once per trial
    # ("The value None could not be cast to float.") in every study's log.
    study = _study()
    ledger = Ledger(study, trials=1, failure_budget=1)
    entry = _run(ledger, "a")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ledger.fail(entry, "error", "ValueError: the plan broke")
    assert study.get_trials()[0].state == optuna.trial.TrialState.FAIL
