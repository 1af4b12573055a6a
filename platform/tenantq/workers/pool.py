"""`WorkerPool`: one `HostWorker` actor per host, a plan per idle worker, results as they end.

`ray.util.ActorPool` returns results without saying which submission failed when a task
raises, and keeps a dead actor in rotation; a search needs both (a failed trial is told to
Optuna by number; a lost host is replaced). So this pool keeps `ref -> (key, worker)` itself
and leaves the rest to Ray: actor restarts and task retries (`max_restarts`,
`max_task_retries`) re-run a trial whose worker died; only when Ray gives up (a `RayError`
other than the trial's own `RayTaskError`) is the worker replaced here. A trial past its
deadline (`trial_timeout_s`) has its actor killed and replaced. Replacements are bounded by
losses in a row without a result (`max_replacements`): a plan that kills its worker is
stopped by the driver's per-plan failure budget, not by the pool's. Workers join as they
finish loading: the pool starts work with those ready (`wait_ready` waits for the first).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Any

from tenantq.workers.host import HostWorker, TrialResult, worker_options
from tenantq.workers.slice import SLICE_KINDS, SliceWorker, release_slice, slice_args

# How long a new worker may take to load the model, data and baseline before the study stops.
WORKER_START_TIMEOUT_S = 900.0
ACTOR_NAMESPACE = "tenantq"


class WorkerStartError(RuntimeError):
    """A worker could not load its model or suite: every trial would fail the same way."""


@dataclass
class Finished:
    """One submission's outcome: a result, or the error (the trial's own, or a lost worker)."""

    key: Any
    worker: str
    elapsed_s: float
    result: TrialResult | None = None
    error: BaseException | None = None
    worker_lost: bool = False
    reason: str | None = None  # None, "error", "worker_died" or "timeout"


class WorkerPool:
    def __init__(
        self,
        workers_spec: Any,
        model_path: str,
        suite: str,
        *,
        cache_dir: str,
        count: int | None = None,
        max_replacements: int | None = None,
        name_prefix: str = "tenantq-worker",
        calibration: dict[str, Any] | None = None,
        worker_class: type | None = None,
        trial_timeout_s: float | None = None,
    ) -> None:
        import ray

        self._spec = workers_spec
        self._args = (model_path, suite)
        self._cache_dir = cache_dir
        self._calibration = calibration
        self._count = count or workers_spec.count
        self._actor_cls = ray.remote(worker_class or default_worker_class(workers_spec))
        self._prefix = f"{name_prefix}-{os.getpid()}"
        self._actors: dict[int, Any] = {}
        self._names: dict[int, str] = {}
        self._generation = 0
        self._idle: list[int] = []
        self._loading: dict[Any, int] = {}  # ping ref -> slot still loading
        self._inflight: dict[Any, tuple[Any, int, float]] = {}
        self.trial_timeout_s = trial_timeout_s
        self.replacements = 0
        self.losses_in_a_row = 0
        self.max_replacements = (
            max_replacements if max_replacements is not None else 2 * self._count
        )
        for slot in range(self._count):
            self._start(slot)

    # ---------------------------------------------------------------- lifecycle
    def _start(self, slot: int) -> None:
        self._generation += 1
        name = f"{self._prefix}-{slot}-g{self._generation}"
        cpus = getattr(self._spec, "cpus_per_worker", 1)
        self._actors[slot] = self._actor_cls.options(
            name=name, namespace=ACTOR_NAMESPACE, **worker_options(self._spec)
        ).remote(
            name,
            *self._args,
            cache_dir=self._cache_dir,
            kind=self._spec.kind,
            cpus=cpus,  # the worker claims cores on its own node (workers.host.claim_cores)
            calibration=self._calibration,
            **slice_args(self._spec),
        )
        self._names[slot] = name
        self._loading[self._actors[slot].ping.remote()] = slot

    def wait_ready(self, timeout_s: float = WORKER_START_TIMEOUT_S, *, all_: bool = False):
        """Block until the first worker has loaded (every one with `all_`); the others join
        as they finish (`wait` and `idle` take them in). A worker that cannot load is a
        WorkerStartError: every trial would fail the same way."""
        deadline = time.monotonic() + timeout_s
        while self._loading and (all_ or not self._idle):
            left = deadline - time.monotonic()
            if left <= 0:
                slot = next(iter(self._loading.values()))
                raise WorkerStartError(
                    f"worker {self._names[slot]} did not load within {timeout_s:.0f} s"
                )
            self._take_loaded(min(left, 1.0))
        return len(self._idle)

    def _take_loaded(self, timeout_s: float = 0.0) -> None:
        import ray

        if not self._loading:
            return
        ready, _ = ray.wait(list(self._loading), num_returns=1, timeout=timeout_s)
        if ready:
            ready, _ = ray.wait(list(self._loading), num_returns=len(self._loading), timeout=0)
        for ref in ready:
            slot = self._loading.pop(ref)
            try:
                ray.get(ref)
            except ray.exceptions.RayError as err:
                raise WorkerStartError(
                    f"worker {self._names[slot]} failed to start: {_start_error(err)}"
                ) from None
            self._idle.append(slot)

    def actor(self, slot: int):
        return self._actors[slot]

    def names(self) -> dict[int, str]:
        return dict(self._names)

    def shutdown(self) -> None:
        import ray

        for slot, actor in self._actors.items():
            ray.kill(actor, no_restart=True)
            self._release(slot)
        self._actors.clear()

    # ---------------------------------------------------------------- work
    @property
    def size(self) -> int:
        return self._count

    @property
    def idle(self) -> int:
        if self._loading:
            self._take_loaded()
        return len(self._idle)

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    def in_flight_keys(self) -> list[Any]:
        return [key for key, _, _ in self._inflight.values()]

    def submit(
        self, key: Any, plan_json: str, suite: str | None = None, split: str = "search"
    ) -> str:
        """Run `plan_json` on an idle worker; returns the worker's name."""
        if not self._idle:
            raise RuntimeError("no idle worker: never submit more plans than workers")
        slot = self._idle.pop(0)
        ref = self._actors[slot].evaluate.remote(plan_json, suite, split)
        self._inflight[ref] = (key, slot, time.perf_counter())
        return self._names[slot]

    def wait(self, timeout_s: float) -> list[Finished]:
        """Outcomes that arrived within `timeout_s` (possibly none)."""
        import ray

        self._take_loaded()
        if not self._inflight:
            time.sleep(min(timeout_s, 0.05))
            return []
        refs = list(self._inflight)
        if self.trial_timeout_s is not None:  # wake up in time for the next deadline
            first = min(start for _, _, start in self._inflight.values())
            timeout_s = max(0.0, min(timeout_s, first + self.trial_timeout_s - time.perf_counter()))
        ready, _ = ray.wait(refs, num_returns=1, timeout=timeout_s)
        if ready:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        out = []
        for ref in ready:
            key, slot, start = self._inflight.pop(ref)
            done = Finished(key=key, worker=self._names[slot], elapsed_s=0.0)
            try:
                done.result = ray.get(ref)
            except ray.exceptions.RayTaskError as err:
                done.error, done.reason = _cause(err), "error"
            except ray.exceptions.RayError as err:
                # The infrastructure failed, not the plan: the actor or its node died
                # (RayActorError, NodeDiedError), Ray's memory monitor killed it
                # (OutOfMemoryError), or its object was lost. The worker is replaced; the
                # driver retries the trial within its plan's failure budget.
                done.error, done.worker_lost, done.reason = err, True, "worker_died"
            done.elapsed_s = time.perf_counter() - start
            if done.worker_lost:
                self._replace(slot, err=done.error)
            else:
                self.losses_in_a_row = 0
                self._idle.append(slot)
            out.append(done)
        out += self._expire()
        return out

    def _expire(self) -> list[Finished]:
        """Trials past their deadline: the actor is killed (a hung XLA call cannot be
        interrupted from inside) and a new one started in its slot."""
        import ray

        if self.trial_timeout_s is None:
            return []
        now = time.perf_counter()
        out = []
        for ref, (key, slot, start) in list(self._inflight.items()):
            if now - start < self.trial_timeout_s:
                continue
            del self._inflight[ref]
            name = self._names[slot]
            with contextlib.suppress(ValueError, ray.exceptions.RayError):
                ray.kill(self._actors[slot], no_restart=True)
            self._release(slot)
            self._start(slot)  # not counted against max_replacements: the plan's fault
            error = TimeoutError(
                f"trial ran past its deadline of {self.trial_timeout_s:g} s on {name}"
            )
            out.append(Finished(key, name, now - start, error=error, reason="timeout"))
        return out

    def _release(self, slot: int) -> None:
        """After killing a slice worker: the placement groups it reserved (Ray scopes them to
        the job, not to the actor that made them)."""
        if getattr(self._spec, "kind", None) in SLICE_KINDS:
            release_slice(self._names[slot])

    def _replace(self, slot: int, err: BaseException | None) -> None:
        import ray

        if self.losses_in_a_row >= self.max_replacements:
            raise WorkerStartError(
                f"workers lost {self.losses_in_a_row + 1} times in a row without a result "
                f"(limit {self.max_replacements}); last: {err}"
            )
        self.replacements += 1
        self.losses_in_a_row += 1
        with contextlib.suppress(ValueError, ray.exceptions.RayError):  # already gone
            ray.kill(self._actors[slot], no_restart=True)
        self._release(slot)
        self._start(slot)


WORKER_CLASS_ENV = "TENANTQ_WORKER_CLASS"


def default_worker_class(spec: Any) -> type:
    """One HostWorker per host; for a slice kind one SliceWorker per slice (its hosts' gang).

    `TENANTQ_WORKER_CLASS` = the name of a fault-injecting worker of `tenantq.workers.faults`
    (e.g. `GatedTrials`) replaces it, for tests of a cluster from the command line or a Ray
    job, where no `worker_class` can be passed in."""
    named = os.environ.get(WORKER_CLASS_ENV, "").strip()
    if named:
        from tenantq.workers.faults import BY_NAME

        if named not in BY_NAME:
            raise ValueError(
                f"{WORKER_CLASS_ENV}={named!r} is not a worker of tenantq.workers.faults; "
                f"one of {sorted(BY_NAME)}, or unset it for the real workers"
            )
        if getattr(spec, "kind", None) in SLICE_KINDS:
            raise ValueError(
                f"{WORKER_CLASS_ENV}={named!r} is a single-host worker; [workers] kind = "
                f"{spec.kind!r} runs slice workers: unset {WORKER_CLASS_ENV}"
            )
        return BY_NAME[named]
    return SliceWorker if getattr(spec, "kind", None) in SLICE_KINDS else HostWorker


def _start_error(err: BaseException) -> str:
    """One line for a worker that died in `__init__`: Ray's ActorDiedError keeps only the
    text of the creation task's error (its traceback, ending with the exception's
    `Type: message` line), not the exception, so that last line is the one given."""
    cause = _cause(err)
    if cause is not err:
        return str(cause).strip().splitlines()[-1] if str(cause).strip() else repr(cause)
    lines = [line for line in str(err).splitlines() if line.strip()]
    if getattr(err, "actor_init_failed", False) and lines:
        return lines[-1].strip()
    return lines[0].strip() if lines else type(err).__name__


def _cause(err: BaseException) -> BaseException:
    """The user's exception inside a Ray error, when Ray carries one."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, BaseException) else err
