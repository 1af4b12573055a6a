"""`InProcessPool`: simulated workers with `WorkerPool`'s surface, for the driver's bench and
the ledger's tests.

`evaluate(plan_json) -> TrialResult` runs in the driver's process when a plan is submitted;
its outcome is handed back by the next `wait`. It may raise (the trial's own error), raise
`WorkerLost` (the worker died: the slot is replaced) or return `HANG` (the trial never
returns: only `trial_timeout_s` ends it). `closed_form_result` is an instant evaluation: a
quality that depends on the plan's formats only, no JAX.
"""

from __future__ import annotations

import time
from typing import Any

from tenantq.workers.host import TrialResult
from tenantq.workers.pool import Finished, WorkerStartError

HANG = object()

# Loss per tensor rule or KV side by format: more bits, less loss (a closed form, no model).
_FORMAT_LOSS = {"bf16": 0.0, "fp16": 0.0, "fp8_e4m3": 0.01, "fp8_e5m2": 0.02, "int8": 0.01}


class WorkerLost(RuntimeError):
    """Raised by an in-process `evaluate` to simulate a worker that died mid-trial."""


def closed_form_result(plan_json: str) -> TrialResult:
    """A TrialResult whose `fidelity.kl_mean` is a sum of per-format losses of the plan."""
    import json

    plan = json.loads(plan_json)
    kl = sum(_FORMAT_LOSS.get(r.get("format"), 0.1) for r in plan.get("rules", []))
    kv = plan.get("kv") or {}
    kl += sum(_FORMAT_LOSS.get(kv.get(k, "bf16"), 0.1) for k in ("key_format", "value_format"))
    summary = {"fidelity.kl_mean": kl, "fidelity.kl_mean.ci_high": kl * 1.1, "verdict": "ok"}
    return TrialResult(summary=summary, gates={}, timings_s={"total": 0.0}, memory_report={})


class InProcessPool:
    def __init__(
        self,
        evaluate=closed_form_result,
        *,
        count: int = 1,
        trial_timeout_s: float | None = None,
        max_replacements: int | None = None,
    ) -> None:
        self.evaluate = evaluate
        self.size = count
        self.trial_timeout_s = trial_timeout_s
        self.max_replacements = max_replacements if max_replacements is not None else 2 * count
        self.replacements = 0
        self.losses_in_a_row = 0
        self._idle = list(range(count))
        self._inflight: dict[int, tuple[Any, int, float, Any]] = {}  # slot -> key, ..., outcome
        self.submitted: list[Any] = []  # keys, in order (tests read it)

    @property
    def idle(self) -> int:
        return len(self._idle)

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    def submit(self, key: Any, plan_json: str, suite: str | None = None, split: str = "search"):
        slot = self._idle.pop(0)
        self.submitted.append(key)
        try:
            outcome: Any = self.evaluate(plan_json)
        except BaseException as err:  # handed back by wait, as a Ray worker's error would be
            outcome = err
        self._inflight[slot] = (key, slot, time.perf_counter(), outcome)
        return f"inprocess-{slot}"

    def wait(self, timeout_s: float) -> list[Finished]:
        out = []
        now = time.perf_counter()
        for slot, (key, _, start, outcome) in list(self._inflight.items()):
            done = Finished(key=key, worker=f"inprocess-{slot}", elapsed_s=now - start)
            if outcome is HANG:
                if self.trial_timeout_s is None or now - start < self.trial_timeout_s:
                    continue
                done.error, done.reason = TimeoutError("past the deadline"), "timeout"
            elif isinstance(outcome, WorkerLost):
                done.error, done.reason, done.worker_lost = outcome, "worker_died", True
                if self.losses_in_a_row >= self.max_replacements:
                    raise WorkerStartError(f"workers lost {self.losses_in_a_row + 1} times")
                self.replacements += 1
                self.losses_in_a_row += 1
            elif isinstance(outcome, BaseException):
                done.error, done.reason = outcome, "error"
            else:
                done.result = outcome
                self.losses_in_a_row = 0
            del self._inflight[slot]
            self._idle.append(slot)
            out.append(done)
        if not out and self._inflight:
            time.sleep(min(timeout_s, 0.01))
        return out

    def shutdown(self) -> None:
        self._inflight.clear()
