"""The trial ledger: one explicit state machine per trial, and the study's budget.

Every trial moves ASKED -> (DISPATCHED | PARKED) -> TOLD -> LOGGED, and only forward: the
ledger is the one place that tells Optuna, and it refuses to tell a trial twice or to move a
trial backwards (`LedgerError`, a bug in the caller). It also owns the rules that used to live
in loose dicts:

- a plan already measured is answered from the study (a duplicate: told COMPLETE with the
  first measurement's values), never run again, and costs no budget;
- a plan in flight parks its duplicates until the first one is told;
- a failure is retried only when it may not be the plan's fault (the worker died, the trial
  ran past its deadline, the driver died), and a plan fingerprint fails at most
  `failure_budget` times in all; an error of the plan itself settles it at once;
- the budget is counted in distinct settled plans (measured, or failed for good), with a cap
  on asks (`max_asks`) so that a space smaller than the budget, or a sampler that keeps
  proposing measured plans, still ends the study.

Counts are kept as trials move, never by scanning the study (`restore` reads it once, on a
resume).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

ASKS_PER_TRIAL = 10  # the cap on asks, per trial of the budget

# Failure reasons. Retryable ones may not be the plan's fault; the others settle the plan.
RETRYABLE = frozenset({"worker_died", "timeout", "driver_died"})
REASONS = RETRYABLE | {
    "error",
    "nan",
    "plan",
    "failed_before",
    "duplicate",
    "driver_stopped",
    "not_run",  # a trial still waiting when the budget filled: closed, counts nothing
}
REASON_ATTR = "failure_reason"
FINGERPRINT_ATTR = "plan_fingerprint"
# the trial's own number, set when it is dispatched: Optuna's retry callbacks copy user
# attributes (the fingerprint too) onto the WAITING copy, so only this says that the trial
# itself ran its plan (a retry killed right after ask did not)
DISPATCHED_ATTR = "dispatched_trial"
# a trial `--continue-as` copied from the old study (its value: the old study's name): its
# figures are of the old inputs, so it answers no duplicate and counts toward no budget
COPIED_ATTR = "tenantq.copied_from"


class State(enum.Enum):
    ASKED = "asked"
    PARKED = "parked"  # waits for the trial measuring the same plan
    DISPATCHED = "dispatched"
    TOLD = "told"
    LOGGED = "logged"


_NEXT = {
    State.ASKED: {State.PARKED, State.DISPATCHED, State.TOLD},
    State.PARKED: {State.TOLD},
    State.DISPATCHED: {State.TOLD},
    State.TOLD: {State.LOGGED},
    State.LOGGED: set(),
}


class LedgerError(RuntimeError):
    """A transition the state machine does not allow (a bug, never a user's input)."""


@dataclass
class Entry:
    """One trial as the ledger sees it; `plan`, `budget`, `capacity`, `params` are the
    driver's (set once the trial's parameters made a plan)."""

    number: int
    trial: Any
    state: State = State.ASKED
    fingerprint: str | None = None
    plan: Any = None
    plan_json: str | None = None  # the plan's JSON, made once per trial
    budget: Any = None
    service_level: Any = None  # capacity.roofline.ServiceLevel, with [deployment] slo
    capacity: dict[str, float] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    worker: str | None = None
    outcome: str | None = None  # "complete" | "failed" once told
    reason: str | None = None
    error: str | None = None
    values: list[float] | None = None
    duplicate_of: int | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    constraints: dict[str, float] = field(default_factory=dict)
    log: dict[str, Any] = field(default_factory=dict)  # metrics, tags, artifacts to log


class Ledger:
    """The study's trials in flight and its budget; see the module docstring.

    `study`: an Optuna study (ask/tell/enqueue); `trials`: distinct plans to settle;
    `failure_budget`: failed attempts a plan fingerprint may have in all."""

    def __init__(
        self,
        study: Any,
        *,
        trials: int,
        failure_budget: int,
        max_asks: int | None = None,
        on_told: Callable[[Entry], None] | None = None,
    ) -> None:
        self.study = study
        self.trials = trials
        self.failure_budget = max(1, failure_budget)
        self.max_asks = max_asks if max_asks is not None else ASKS_PER_TRIAL * trials
        self.on_told = on_told
        self.live: dict[int, Entry] = {}  # asked, parked, dispatched, told: not yet logged
        self.measured: dict[str, int] = {}  # fingerprint -> the trial that measured it
        # trial that measured a plan -> (values, constraints, summary): a duplicate's answer
        self.results: dict[int, tuple[list[float], dict[str, float], dict[str, Any]]] = {}
        self.failures: dict[str, int] = {}  # fingerprint -> failed attempts
        self.settled: set[str] = set()  # measured, or failed for good
        self.in_flight: dict[str, int] = {}  # fingerprint -> the trial measuring it
        self.parked: dict[str, list[int]] = {}  # fingerprint -> trials waiting on it
        self.asks = 0
        self.deferred: set[int] = set()  # told trials whose run is left to reconciliation
        # `not_run`: trials closed unrun at the end (neither failed nor asked for the budget)
        self.counts = {"complete": 0, "failed": 0, "duplicates": 0, "retries": 0, "not_run": 0}

    # ---------------------------------------------------------------- resume
    def restore(self, trials: Sequence[Any]) -> None:
        """Rebuild the budget from a study's finished trials (FrozenTrials), once."""
        from optuna.trial import TrialState

        by_number = {t.number: t for t in trials}
        for t in trials:
            if t.state == TrialState.WAITING or COPIED_ATTR in t.user_attrs:
                continue
            if t.state == TrialState.FAIL and t.user_attrs.get(REASON_ATTR) == "not_run":
                self.counts["not_run"] += 1  # closed unrun: no ask of the study's, no failure
                continue
            self.asks += 1
            fp = t.user_attrs.get(FINGERPRINT_ATTR)
            if t.state == TrialState.COMPLETE:
                self.counts["complete"] += 1
                if "duplicate_of" in t.user_attrs:
                    self.counts["duplicates"] += 1
                if fp and fp not in self.measured:
                    self.measured[fp] = t.number
                    self.results[t.number] = (
                        list(t.values),
                        _constraints_of(t),
                        t.user_attrs.get("summary", {}),
                    )
                if fp:
                    self.settled.add(fp)
            elif t.state == TrialState.FAIL:
                self.counts["failed"] += 1
                if "failed_trial" in t.system_attrs or "retry_of" in t.user_attrs:
                    self.counts["retries"] += 1
                reason, ran = failure_of(t, by_number)
                # As live: a duplicate, a trial stopped with the driver, one closed unrun, or
                # one with no fingerprint (killed before it had a plan, or its parameters made
                # none) blames no plan.
                if reason in ("duplicate", "driver_stopped", "not_run") or not fp:
                    continue
                if reason in RETRYABLE:
                    if not ran:
                        continue  # killed before its plan ran: the plan is not blamed
                    self.failures[fp] = self.failures.get(fp, 0) + 1
                    if self.failures[fp] >= self.failure_budget:
                        self.settled.add(fp)
                else:
                    self.settled.add(fp)

    # ---------------------------------------------------------------- the budget
    @property
    def done(self) -> int:
        """Distinct plans settled: measured, or failed for good."""
        return len(self.settled)

    def wants_more(self) -> bool:
        """Whether to ask another trial: plans settled or in flight short of the budget, and
        asks left under the cap."""
        return self.done + len(self.in_flight) < self.trials and self.asks < self.max_asks

    def finished(self) -> bool:
        return not self.wants_more() and not self.unfinished()

    def exhausted(self) -> bool:
        """The cap on asks ended the study before the budget (a small space, or a sampler
        that kept proposing measured plans)."""
        return self.asks >= self.max_asks and self.done < self.trials

    def unfinished(self) -> list[Entry]:
        """Trials asked and not yet told (in flight or parked)."""
        return [e for e in self.live.values() if e.state != State.TOLD]

    def untold_logs(self) -> list[Entry]:
        return [e for e in self.live.values() if e.state == State.TOLD]

    # ---------------------------------------------------------------- transitions
    def ask(self) -> Entry:
        trial = self.study.ask()
        self.asks += 1
        entry = Entry(number=trial.number, trial=trial)
        self.live[entry.number] = entry
        return entry

    def route(self, entry: Entry, fingerprint: str) -> str:
        """Where a trial with a plan goes: 'duplicate' (told now from the measurement),
        'refused' (the plan failed for good: told FAIL now), 'parked', or 'run' (the caller
        dispatches it and calls `dispatched`)."""
        self._expect(entry, State.ASKED)
        entry.fingerprint = fingerprint
        entry.trial.set_user_attr(FINGERPRINT_ATTR, fingerprint)
        if fingerprint in self.measured:
            self._answer_duplicate(entry, self.measured[fingerprint])
            return "duplicate"
        if fingerprint in self.settled:
            self.fail(entry, "failed_before", "this plan failed for good in an earlier trial")
            return "refused"
        if fingerprint in self.in_flight:
            self._move(entry, State.PARKED)
            self.parked.setdefault(fingerprint, []).append(entry.number)
            return "parked"
        self.in_flight[fingerprint] = entry.number
        return "run"

    def dispatched(self, entry: Entry, worker: str | None) -> None:
        self._move(entry, State.DISPATCHED)
        entry.trial.set_user_attr(DISPATCHED_ATTR, entry.number)
        entry.worker = worker
        if worker:
            entry.trial.set_user_attr("worker", worker)

    def complete(
        self,
        entry: Entry,
        values: list[float],
        constraints: dict[str, float] | None = None,
        summary: dict[str, Any] | None = None,
    ) -> None:
        """Tell COMPLETE; a value that is not finite fails the trial (reason 'nan') instead,
        since Optuna would fail it on tell while the ledger counted it measured."""
        self._check_untold(entry)
        bad = [v for v in values if not (isinstance(v, int | float) and math.isfinite(v))]
        if bad:
            self.fail(entry, "nan", f"objective values {values} are not all finite numbers")
            return
        entry.values = [float(v) for v in values]
        entry.constraints = dict(constraints or {})
        entry.summary = dict(summary or {})
        for key, value in entry.constraints.items():
            entry.trial.set_constraint(key, value)
        if self._tell(entry, "complete", values=entry.values) != "complete":
            # Optuna refused the values (it told FAIL): the plan's own error, settled.
            entry.reason = "error"
            entry.error = "Optuna failed the trial on tell (values it could not take)"
            self._failed(entry, "error", was_running=True)
            return
        fp = entry.fingerprint
        if fp is not None:
            self.measured[fp] = entry.number
            self.results[entry.number] = (entry.values, entry.constraints, entry.summary)
            self.settled.add(fp)
            self._release(fp)

    def fail(self, entry: Entry, reason: str, error: str) -> None:
        """Tell FAIL with `reason` (one of REASONS); a retryable failure of a plan with
        failures left is re-queued (a WAITING copy of the trial's parameters)."""
        if reason not in REASONS:
            raise LedgerError(f"unknown failure reason {reason!r}")
        self._check_untold(entry)
        entry.reason, entry.error = reason, error
        entry.trial.set_user_attr(REASON_ATTR, reason)
        entry.trial.set_user_attr("error", error[:2000])
        was_running = entry.state in (State.ASKED, State.DISPATCHED)
        self._tell(entry, "failed")
        self._failed(entry, reason, was_running)

    def _failed(self, entry: Entry, reason: str, was_running: bool) -> None:
        """The budget after a FAIL was told: a parked trial, a duplicate, a trial stopped
        with the driver or one with no fingerprint (no plan yet) count nothing."""
        fp = entry.fingerprint
        if reason == "duplicate" or not was_running or fp is None:
            return
        if reason in RETRYABLE:
            self.failures[fp] = self.failures.get(fp, 0) + 1
            if self.failures[fp] < self.failure_budget:
                self._retry(entry)
            else:
                self.settled.add(fp)
        elif reason != "driver_stopped":
            self.settled.add(fp)
        if self.in_flight.get(fp) == entry.number:
            self._release(fp)

    def close_waiting(self) -> int:
        """Trials still WAITING once the study is done (retries, copies Optuna's stale-trial
        callback queued, enqueued baselines the budget had no room for): each asked and told
        FAIL (`not_run`, counts nothing), so that the study holds no trial that will never
        run. A baseline closed so is enqueued again on a later start (`store.open_study`).
        Returns how many were closed."""
        from optuna.trial import TrialState

        waiting = self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        for _ in waiting:  # Optuna asks the oldest WAITING trial first, whatever it is
            entry = self.ask()
            self.asks -= 1  # closing it is no ask of the study's (the cap counts draws)
            self.fail(entry, "not_run", "left waiting when the study's budget filled")
        return len(waiting)

    def logged(self, entry: Entry) -> None:
        self._move(entry, State.LOGGED)
        del self.live[entry.number]

    def log_deferred(self, entry: Entry) -> None:
        """Logging failed: the trial stays told (its outcome stands) and leaves the live set;
        the study's reconciliation writes its run from the study's record."""
        self._expect(entry, State.TOLD)
        del self.live[entry.number]
        self.deferred.add(entry.number)

    # ---------------------------------------------------------------- helpers
    def _answer_duplicate(self, entry: Entry, original: int) -> None:
        values, constraints, summary = self.results[original]
        entry.duplicate_of = original
        entry.values, entry.constraints, entry.summary = list(values), dict(constraints), summary
        for key, value in entry.constraints.items():
            entry.trial.set_constraint(key, value)
        entry.trial.set_user_attr("duplicate_of", original)
        entry.trial.set_user_attr("summary", summary)
        if self._tell(entry, "complete", values=entry.values) == "complete":
            self.counts["duplicates"] += 1

    def _release(self, fp: str) -> None:
        """The trial measuring `fp` was told: answer or fail the trials parked on it."""
        self.in_flight.pop(fp, None)
        for number in self.parked.pop(fp, []):
            waiting = self.live[number]
            if fp in self.measured:
                self._answer_duplicate(waiting, self.measured[fp])
            else:
                self.fail(waiting, "duplicate", "the trial measuring the same plan failed")

    def _retry(self, entry: Entry) -> None:
        """A WAITING copy of the trial's parameters, as Optuna's RetryFailedTrialCallback
        makes one (`failed_trial` names the original; `retry_of` for the report)."""
        import optuna

        trial = entry.trial
        attrs = {
            k: v
            for k, v in trial.user_attrs.items()
            if k not in ("error", "worker", REASON_ATTR, "worker_pid")
        }
        self.study.add_trial(
            optuna.trial.create_trial(
                state=optuna.trial.TrialState.WAITING,
                params=trial.params,
                distributions=trial.distributions,
                user_attrs=attrs | {"retry_of": entry.number},
                system_attrs={"failed_trial": entry.number},
            )
        )
        self.counts["retries"] += 1

    def _tell(self, entry: Entry, outcome: str, values: list[float] | None = None) -> str:
        """Tell Optuna once; returns the outcome Optuna recorded ("complete" | "failed")."""
        import optuna

        if entry.outcome is not None:
            raise LedgerError(f"trial {entry.number} was told already ({entry.outcome})")
        self._move(entry, State.TOLD)
        entry.outcome = outcome
        if outcome == "complete":
            told = self.study.tell(entry.trial, values)
            # Optuna fails a trial whose values it cannot take (a count that does not match
            # the directions, a value it cannot convert) and returns it FAIL, not raising.
            if getattr(told, "state", optuna.trial.TrialState.COMPLETE) != (
                optuna.trial.TrialState.COMPLETE
            ):
                entry.outcome = outcome = "failed"
        else:
            self.study.tell(entry.trial, state=optuna.trial.TrialState.FAIL)
        self.counts["not_run" if entry.reason == "not_run" else outcome] += 1
        if self.on_told is not None:
            self.on_told(entry)
        return outcome

    def _check_untold(self, entry: Entry) -> None:
        if entry.outcome is not None or State.TOLD not in _NEXT[entry.state]:
            raise LedgerError(f"trial {entry.number} was told already ({entry.outcome})")

    def _move(self, entry: Entry, new: State) -> None:
        if new not in _NEXT[entry.state]:
            raise LedgerError(
                f"trial {entry.number}: {entry.state.value} -> {new.value} is not allowed"
            )
        entry.state = new

    def _expect(self, entry: Entry, state: State) -> None:
        if entry.state != state:
            raise LedgerError(f"trial {entry.number} is {entry.state.value}, not {state.value}")


# What the driver wrote as a trial's error before `failure_reason` existed -> the reason.
_OLD_ERRORS = (
    ("plan:", "plan"),
    ("the driver stopped before", "driver_stopped"),
    ("the trial measuring the same plan", "duplicate"),
)


def _own(t: Any, key: str, by_number: dict[int, Any]) -> Any:
    """The user attribute `key` of `t` unless a retry copy inherited it unchanged from the
    trial it copies (Optuna's retry callback copies every user attribute)."""
    value = t.user_attrs.get(key)
    history = t.system_attrs.get("retry_history") or [t.system_attrs.get("failed_trial")]
    parent = by_number.get(history[-1]) if history[-1] is not None else None
    if value is not None and parent is not None and parent.user_attrs.get(key) == value:
        return None
    return value


def failure_of(t: Any, by_number: dict[int, Any]) -> tuple[str, bool]:
    """(reason, whether the trial itself ran its plan) of a FAIL trial, from what its record
    holds. Since `dispatched_trial` exists it says whether the trial ran. Older records: a
    `worker_died` or `timeout` reason only comes from a trial that ran, and one that ran has
    a `worker` of its own; records from before `failure_reason` existed have their reason
    read from their own error text (a lost worker, the plan, a stop, a failed duplicate, or
    else the evaluation's own error), and a trial killed with the driver has no error of its
    own (`driver_died`)."""
    attrs = t.user_attrs
    reason = attrs.get(REASON_ATTR)
    if reason is None:
        error = _own(t, "error", by_number)
        if error is None:
            reason = "driver_died"
        elif "(worker lost" in error:
            reason = "worker_died"
        else:
            reason = next((r for prefix, r in _OLD_ERRORS if error.startswith(prefix)), "error")
    if DISPATCHED_ATTR in attrs:
        return reason, attrs[DISPATCHED_ATTR] == t.number
    ran = reason in ("worker_died", "timeout") or _own(t, "worker", by_number) is not None
    return reason, ran


def _constraints_of(frozen: Any) -> dict[str, float]:
    return dict(getattr(frozen, "constraints", None) or {})
