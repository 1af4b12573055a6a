"""`WorkerPool`: one `HostWorker` actor per host, a plan per idle worker, results as they end.

`ray.util.ActorPool` returns results without saying which submission failed when a task
raises, and keeps a dead actor in rotation; a search needs both (a failed trial is told to
Optuna by number; a lost host is replaced). So this pool keeps `ref -> (key, worker)` itself
and leaves the rest to Ray: actor restarts and task retries (`max_restarts`,
`max_task_retries`) re-run a trial whose worker died; only when Ray gives up (a `RayError`
other than the trial's own `RayTaskError`) is the worker replaced here, a bounded number of
times.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Any

from tenantq.workers.host import HostWorker, TrialResult, worker_options

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
    ) -> None:
        import ray

        self._spec = workers_spec
        self._args = (model_path, suite)
        self._cache_dir = cache_dir
        self._calibration = calibration
        self._count = count or workers_spec.count
        self._actor_cls = ray.remote(worker_class or HostWorker)
        self._prefix = f"{name_prefix}-{os.getpid()}"
        self._actors: dict[int, Any] = {}
        self._names: dict[int, str] = {}
        self._generation = 0
        self._idle: list[int] = []
        self._inflight: dict[Any, tuple[Any, int, float]] = {}
        self.replacements = 0
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
        ncpu = os.cpu_count() or 1
        cores = [(slot * cpus + c) % ncpu for c in range(cpus)]
        self._actors[slot] = self._actor_cls.options(
            name=name, namespace=ACTOR_NAMESPACE, **worker_options(self._spec)
        ).remote(
            name,
            *self._args,
            cache_dir=self._cache_dir,
            kind=self._spec.kind,
            cores=cores,
            calibration=self._calibration,
        )
        self._names[slot] = name
        self._idle.append(slot)

    def wait_ready(self, timeout_s: float = WORKER_START_TIMEOUT_S) -> list[dict]:
        """Block until every worker has loaded; a worker that cannot is a WorkerStartError."""
        import ray

        refs = {slot: actor.ping.remote() for slot, actor in self._actors.items()}
        out = []
        for slot, ref in refs.items():
            try:
                out.append(ray.get(ref, timeout=timeout_s))
            except ray.exceptions.GetTimeoutError:
                raise WorkerStartError(
                    f"worker {self._names[slot]} did not load within {timeout_s:.0f} s"
                ) from None
            except ray.exceptions.RayError as err:
                raise WorkerStartError(
                    f"worker {self._names[slot]} failed to start: {_start_error(err)}"
                ) from None
        return out

    def actor(self, slot: int):
        return self._actors[slot]

    def names(self) -> dict[int, str]:
        return dict(self._names)

    def shutdown(self) -> None:
        import ray

        for actor in self._actors.values():
            ray.kill(actor, no_restart=True)
        self._actors.clear()

    # ---------------------------------------------------------------- work
    @property
    def size(self) -> int:
        return self._count

    @property
    def idle(self) -> int:
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

        if not self._inflight:
            time.sleep(min(timeout_s, 0.05))
            return []
        refs = list(self._inflight)
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
                done.error = _cause(err)
            except ray.exceptions.RayError as err:
                # The infrastructure failed, not the plan: the actor or its node died
                # (RayActorError, NodeDiedError), Ray's memory monitor killed it
                # (OutOfMemoryError), or its object was lost. The worker is replaced and the
                # trial re-queued, bounded.
                done.error, done.worker_lost = err, True
            done.elapsed_s = time.perf_counter() - start
            if done.worker_lost:
                self._replace(slot, err=done.error)
            else:
                self._idle.append(slot)
            out.append(done)
        return out

    def _replace(self, slot: int, err: BaseException | None) -> None:
        import ray

        if self.replacements >= self.max_replacements:
            raise WorkerStartError(
                f"workers lost {self.replacements + 1} times (limit {self.max_replacements}); "
                f"last: {err}"
            )
        self.replacements += 1
        with contextlib.suppress(ValueError, ray.exceptions.RayError):  # already gone
            ray.kill(self._actors[slot], no_restart=True)
        self._start(slot)


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
