"""Workers that fail on purpose, for the tests of what a study does when a trial raises.

A study started from the command line (`tenantq search`, or a Ray job) runs on one of these
when `TENANTQ_WORKER_CLASS` names it (`tenantq.workers.pool.default_worker_class`): that is how
the cluster tests hold a trial mid-flight (`GatedTrials`) while they kill a node or a driver.

`SearchDriver(..., worker_class=FailQuantizedTrials)` runs the study on workers whose
`evaluate` raises for every plan that quantizes something, while the all-bf16 baseline
completes: the failure is the worker's own exception, raised in the Ray actor, exactly as a
real one (an out-of-memory compile, a format a kernel lacks) would be. Lives in the package
so that Ray's workers import it by name.
"""

from __future__ import annotations

import os
from typing import Any

from tenantq.workers.host import HostWorker, TrialResult
from tenantq.workers.slice import SliceHost, SliceWorker

INJECTED_ERROR = "injected failure (tenantq.workers.faults): this worker refuses quantized plans"


class FailQuantizedTrials(HostWorker):
    """A HostWorker whose trials raise `RuntimeError(INJECTED_ERROR)` unless the plan is all
    bf16 (the default `QuantPlan()`)."""

    def evaluate(self, plan_json: str, suite: str | None = None, split: str = "search"):
        from tenantq.quant.plan import QuantPlan

        plan = QuantPlan.from_json(plan_json)
        if plan.fingerprint() != QuantPlan().fingerprint():  # anything but all bf16
            raise RuntimeError(INJECTED_ERROR)
        return super().evaluate(plan_json, suite, split)


HANG_S = 3600.0  # longer than any test's deadline: only the driver's trial_timeout ends it


def _is_int4_weights(plan_json: str) -> bool:
    import json

    return any(r.get("format") == "int4" for r in json.loads(plan_json).get("rules", []))


class HangOnInt4Weights(HostWorker):
    """A HostWorker that never returns for a plan with int4 weights (a hung compile or
    collective); the rest evaluate as usual."""

    def evaluate(self, plan_json: str, suite: str | None = None, split: str = "search"):
        import time

        if _is_int4_weights(plan_json):
            time.sleep(HANG_S)
        return super().evaluate(plan_json, suite, split)


class InstantUnlessInt4Weights(HostWorker):
    """A HostWorker with no model: every plan returns `INSTANT_SUMMARY` at once, except one
    with int4 weights, which never returns. The deadline tests' other trials then take
    milliseconds instead of a compile, so a deadline of seconds is sound on a loaded machine;
    what is under test (the pool kills the actor at the deadline, the trial fails as
    "timeout", the study goes on) is the same."""

    def __init__(self, name: str, model_path: str, suite: str, **_: Any) -> None:
        import pyarrow as pa  # here, before the worker counts as ready: not in a trial's time

        self.name = name
        self._examples = pa.table({"example": pa.array([], pa.int64())})

    def evaluate(self, plan_json: str, suite: str | None = None, split: str = "search"):
        import time

        if _is_int4_weights(plan_json):
            time.sleep(HANG_S)
        return TrialResult(
            summary=dict(INSTANT_SUMMARY), gates={}, timings_s={}, memory_report={},
            examples=self._examples, worker=self.name, pid=os.getpid(),
        )  # fmt: skip


INSTANT_SUMMARY = {"fidelity.kl_mean": 0.0}  # the default objectives' one measured metric

GATE_ENV = "TENANTQ_TRIAL_GATE"
GATE_POLL_S = 0.05


def take_ticket(folder: str | os.PathLike[str], poll_s: float = GATE_POLL_S) -> None:
    """Wait for a ticket: any file in `folder`, taken by deleting it (one trial per ticket,
    whichever worker deletes it first). A missing `folder` is an open gate: return at once,
    also when it goes while being listed (a test opens the gate at any moment)."""
    import time
    from pathlib import Path

    gate = Path(folder)
    while gate.is_dir():
        try:
            tickets = sorted(gate.iterdir())
        except (FileNotFoundError, NotADirectoryError):
            return  # removed between the check and the listing: the gate just opened
        for ticket in tickets:
            try:
                ticket.unlink()
            except (FileNotFoundError, IsADirectoryError, PermissionError):
                continue  # another worker took it first (or it is not a ticket)
            return
        time.sleep(poll_s)


class GatedTrials(HostWorker):
    """A HostWorker whose every trial first waits for a ticket in the folder named by
    `TENANTQ_TRIAL_GATE` (read in the actor, so the variable must reach the node: set it
    where Ray starts). A test hands out tickets (files) to let trials through one by one, and
    removes the folder to open the gate for good; the trial is RUNNING in the study while it
    waits, so a test can kill its node or the driver at a known point instead of racing a
    trial that takes a second on a quiet machine."""

    def evaluate(self, plan_json: str, suite: str | None = None, split: str = "search"):
        folder = os.environ.get(GATE_ENV)
        if not folder:
            raise RuntimeError(
                f"GatedTrials needs {GATE_ENV} = a folder of tickets (files) in the worker's "
                "environment; it is not set on this node"
            )
        take_ticket(folder)
        return super().evaluate(plan_json, suite, split)


# The workers `TENANTQ_WORKER_CLASS` may name: this module's, and no other class.
BY_NAME: dict[str, type] = {
    cls.__name__: cls
    for cls in (FailQuantizedTrials, HangOnInt4Weights, InstantUnlessInt4Weights, GatedTrials)
}


class DieOnInt4Weights(HostWorker):
    """A HostWorker whose process exits on a plan with int4 weights (a segfault, the kernel's
    OOM killer): the worker dies every time that plan is tried."""

    def evaluate(self, plan_json: str, suite: str | None = None, split: str = "search"):
        import os

        if _is_int4_weights(plan_json):
            log = os.environ.get("TENANTQ_FAULT_LOG")  # tests count the deaths here
            if log:
                with open(log, "a") as f:
                    f.write(f"{os.getpid()}\n")
            os._exit(1)
        return super().evaluate(plan_json, suite, split)


class DieOnceOnInt4SliceHost(SliceHost):
    """A slice host whose process 1 exits on the first plan with int4 weights of the run (the
    pid goes to TENANTQ_FAULT_LOG, whose existence marks it done): one host lost mid-trial,
    so its slice must retry the trial on a fresh gang; later attempts succeed. It empties its
    baseline cache first, as a host replaced by a fresh VM finds its disk: the next gang's
    hosts then disagree on what is cached."""

    def join(self, coordinator: str, num_processes: int, process_id: int):
        self._process_id = process_id
        return super().join(coordinator, num_processes, process_id)

    def evaluate(self, plan_json: str, suite: str | None = None, split: str = "search"):
        import os

        log = os.environ.get("TENANTQ_FAULT_LOG")
        first = log and not os.path.exists(log)
        if first and self._process_id == 1 and _is_int4_weights(plan_json):
            with open(log, "a") as f:
                f.write(f"{os.getpid()}\n")
            for cached in self.cache_dir.glob("baseline-*"):
                cached.unlink()
            os._exit(1)
        return super().evaluate(plan_json, suite, split)


class SliceLosingAHostOnce(SliceWorker):
    """A SliceWorker whose gang loses host 1 on the first int4 plan (DieOnceOnInt4SliceHost)."""

    host_class = DieOnceOnInt4SliceHost


QUICK_TRIAL_S = 3.0  # long enough to kill a host while its trial runs


class QuickSliceHost(SliceHost):
    """A slice host with no model and no JAX: `join` returns at once and a trial sleeps
    QUICK_TRIAL_S, for the tests of the gang's own bookkeeping (loss, retry, release)."""

    def join(self, coordinator: str, num_processes: int, process_id: int):
        import os

        self.name, self._process_id = self._args[0], process_id
        return {"name": self.name, "pid": os.getpid(), "process_index": process_id}

    def evaluate(self, plan_json: str, suite: str | None = None, split: str = "search"):
        import os
        import time

        from tenantq.workers.host import TrialResult

        time.sleep(QUICK_TRIAL_S)
        return TrialResult({}, {}, {}, {}, worker=self.name, pid=os.getpid())


class QuickSlice(SliceWorker):
    """A SliceWorker over QuickSliceHosts."""

    host_class = QuickSliceHost


class StuckSliceHost(QuickSliceHost):
    """Plan "fail": host 0 raises the trial's own error at once while host 1 never returns
    (as a host left waiting in a collective would); any other plan: a quick trial."""

    def evaluate(self, plan_json: str, suite: str | None = None, split: str = "search"):
        import time

        if plan_json == "fail":
            if self._process_id == 0:
                raise ValueError(INJECTED_ERROR)
            time.sleep(3600)
        return super().evaluate(plan_json, suite, split)


class StuckSlice(SliceWorker):
    """A SliceWorker over StuckSliceHosts, waiting 2 s for stragglers."""

    host_class = StuckSliceHost
    straggler_timeout_s = 2.0


class AlwaysLosingSliceHost(QuickSliceHost):
    """Host 1 exits on every trial: each gang is lost, past the slice's retries."""

    def evaluate(self, plan_json: str, suite: str | None = None, split: str = "search"):
        import os

        if self._process_id == 1:
            os._exit(1)
        return super().evaluate(plan_json, suite, split)


class AlwaysLosingSlice(SliceWorker):
    host_class = AlwaysLosingSliceHost


class FailingJoinSliceHost(QuickSliceHost):
    """Host 1 cannot join the slice (its JAX process fails to start)."""

    def join(self, coordinator: str, num_processes: int, process_id: int):
        if process_id == 1:
            raise RuntimeError("injected: host 1 cannot join the slice")
        return super().join(coordinator, num_processes, process_id)


class FailingJoinSlice(SliceWorker):
    host_class = FailingJoinSliceHost
