"""The study driver: the loop that asks trials, dispatches plans to workers and tells results.

Every other job lives in its own module: the spec's checks and `plan_and_budget`
(`context`), the sampler (`samplers`), the Optuna study and its identity (`store`), each
trial's state and the budget (`ledger`), MLflow (`trial_runs`), the front (`front`). The loop
asks while the ledger wants more plans and a worker is idle, records what workers return, and
logs every told trial; a background thread keeps the heartbeats of trials in flight.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tenantq.search import front as front_
from tenantq.search.context import (  # noqa: F401  (the names callers imported from here)
    StudyContext,
    check_metrics,
    check_stores,
    study_context,
)
from tenantq.search.front import confirmed_front as _confirmed_front  # noqa: F401
from tenantq.search.ledger import Ledger
from tenantq.search.metrics import StudyMetrics
from tenantq.search.objectives import constraint_values, objective_values
from tenantq.search.pareto import FrontRow, render_front
from tenantq.search.samplers import make_sampler
from tenantq.search.space import suggest
from tenantq.search.spec import ExperimentSpec
from tenantq.search.store import (  # noqa: F401
    GRACE_PERIOD_S,
    HEARTBEAT_INTERVAL_S,
    enqueue_baselines,
    make_storage,
    open_study,
    requeue_dead_driver_trials,
    study_exists,
)
from tenantq.search.store import check_same_spec as _check_same_spec  # noqa: F401
from tenantq.search.trial_runs import log_entry, open_parent, reconcile

POLL_S = 0.5  # how long one wait for worker results blocks


@dataclass
class StudyOutcome:
    study_name: str
    storage: str
    counts: dict[str, int]
    front: list[FrontRow]
    table: str
    exported: list[Path] = field(default_factory=list)
    mlflow_parent_run_id: str = ""


class Heartbeats:
    """Optuna RDB heartbeats of the trials in flight, from a background thread, so that a
    slow upload in the main loop never makes a live trial look stale."""

    def __init__(self, storage, study_name: str) -> None:
        self.storage = storage
        self.enabled = getattr(storage, "get_heartbeat_interval", lambda: None)() is not None
        self.study_id = storage.get_study_id_from_name(study_name) if self.enabled else None
        self.ids: dict[int, int] = {}  # trial number -> trial id
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="tenantq-heartbeat", daemon=True)

    def add(self, number: int) -> None:
        if not self.enabled:
            return
        trial_id = self.storage.get_trial_id_from_study_id_trial_number(self.study_id, number)
        self.storage.record_heartbeat(trial_id)  # at once: a resume must see it alive
        with self.lock:
            self.ids[number] = trial_id

    def remove(self, number: int) -> None:
        with self.lock:
            self.ids.pop(number, None)

    def _beat(self) -> None:
        while not self.stop_event.wait(HEARTBEAT_INTERVAL_S / 2):
            with self.lock:
                ids = list(self.ids.values())
            for trial_id in ids:
                try:
                    self.storage.record_heartbeat(trial_id)
                except Exception as err:  # a busy database: the next beat tries again
                    print(f"tenantq search: heartbeat not written ({err})", file=sys.stderr)

    def __enter__(self) -> Heartbeats:
        if self.enabled:
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5)


class SearchDriver:
    def __init__(
        self,
        spec: ExperimentSpec,
        spec_text: str,
        *,
        resume: bool = False,
        workers: int | None = None,
        address: str | None = None,
        progress: bool = True,
        out_dir: str | Path | None = None,
        worker_class: type | None = None,
        pool_factory=None,
        continue_from: str | None = None,
        storage=None,
    ) -> None:
        """`worker_class`: a `HostWorker` subclass for the Ray pool (tests inject faults with
        `tenantq.workers.faults`); `pool_factory(driver)`: another pool with the `WorkerPool`
        surface (the driver bench's in-process workers); `continue_from`: copy that study to
        `spec.study.name` and go on there (`--continue-as`); `storage`: an Optuna storage
        to use instead of `study.storage`'s (the driver bench's in-memory one)."""
        self.storage_override = storage
        self.prep = self.context = study_context(spec, spec_text)
        self.worker_class = worker_class
        self.pool_factory = pool_factory
        self.spec = spec
        self.resume = resume
        self.continue_from = continue_from
        self.workers = workers or spec.workers.count
        self.address = address
        self.progress = progress
        self.out_dir = Path(out_dir) if out_dir else Path("runs") / spec.study.name
        self._started_ray = False
        self.metrics = StudyMetrics(spec.study.name, enabled=False)

    # ---------------------------------------------------------------- the run
    def run(self) -> StudyOutcome:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
        spec = self.spec
        # A bad TENANTQ_WORKER_CLASS stops the study before any store is touched.
        self._worker_class()
        # MLflow first: its experiment is only looked up or created here, so a tracking URI
        # that cannot be reached stops the study before Optuna's storage holds a new study.
        self.tracker = tracker = self._connect_tracking()
        self.storage, self.study = open_study(
            self.context,
            resume=self.resume,
            continue_from=self.continue_from,
            storage=self.storage_override,
            sampler_for=lambda n: make_sampler(spec, self.context, trials_so_far=n),
        )
        # before the parent run is reopened: a study another driver is running is refused
        # here, and its parent run must stay as that driver has it
        requeue_dead_driver_trials(self.study, self.storage, spec.study.name)
        open_parent(tracker, self.study, self.context, self.workers)
        reconcile(tracker, self.study, self.context.config, self.context.budget_of)
        self.ledger = Ledger(
            self.study,
            trials=spec.study.trials,
            failure_budget=1 + spec.study.max_trial_retries,
        )
        if self.resume or self.continue_from:
            self.ledger.restore(self.study.get_trials(deepcopy=False))
        else:
            front_.clear_export(self.out_dir)
        # after the dead driver's trials were re-queued, and the budget restored: a baseline
        # whose plan settled for good is not asked again
        enqueue_baselines(self.study, self.context.baselines, settled=self._settled)
        # A capacity-only study needs no worker: every figure is arithmetic in the driver.
        needs_workers = bool(spec.quality_objectives() or spec.eval.confirm_suite)
        pool = None
        status = "FAILED"
        try:
            pool = self._start_pool() if needs_workers else None
            ray_pool = pool is not None and self.pool_factory is None
            self.metrics = StudyMetrics(spec.study.name, enabled=ray_pool)
            with Heartbeats(self.storage, spec.study.name) as self.heartbeats:
                self._search(pool)
            outcome = self._finish(pool)
            status = "FINISHED"
            return outcome
        finally:
            self._stop(pool, status)

    def _search(self, pool) -> None:
        """Ask while the ledger wants plans and a worker is idle; record results; log."""
        from tenantq.model.terminal import progress_bar

        ledger = self.ledger
        bar = progress_bar(
            ledger.trials,
            initial=min(ledger.done, ledger.trials),
            desc=f"study {self.spec.study.name}",
            unit="plan",
            enabled=self.progress,
        )
        shown: tuple[int, ...] = ()
        try:
            while True:
                while ledger.wants_more() and (pool is None or pool.idle):
                    self._ask_and_route(pool)
                    self._log_told()
                if not ledger.wants_more() and not ledger.unfinished():
                    break
                for finished in pool.wait(POLL_S) if pool is not None else []:
                    self._record(finished)
                    self.metrics.workers_busy(pool.in_flight)
                self._log_told()
                state = (ledger.done, len(ledger.unfinished()), ledger.counts["failed"])
                if state != shown:  # redraw on change only: quiet logs when not on a terminal
                    shown = state
                    bar.n = min(ledger.done, ledger.trials)
                    bar.set_postfix(running=state[1], failed=state[2], refresh=False)
                    bar.refresh()
        finally:
            bar.close()
        if ledger.close_waiting():  # the budget filled before they ran
            self._log_told()
        if ledger.exhausted():
            print(
                f"tenantq search: {ledger.done} distinct plans in {ledger.asks} asks, fewer "
                f"than study.trials = {ledger.trials}: the space (or what the sampler proposes) "
                "is exhausted",
                file=sys.stderr,
            )

    def _ask_and_route(self, pool) -> None:
        from tenantq.tracking import flatten_plan

        ctx, ledger = self.context, self.ledger
        entry = ledger.ask()
        self.heartbeats.add(entry.number)
        try:
            params = suggest(entry.trial, self.spec.space, ctx.config, ctx.profile)
            plan, b = ctx.plan_and_budget(params)
            entry.capacity, entry.service_level = ctx.capacity.lines(plan, b)
        except ValueError as err:
            ledger.fail(entry, "plan", f"plan: {err}")
            return
        entry.plan, entry.budget = plan, b
        entry.plan_json = plan_json = plan.to_json()
        entry.params = flatten_plan(plan, ctx.config) | {f"space.{k}": v for k, v in params.items()}
        for key, value in (
            ("plan", plan_json),
            ("capacity", entry.capacity),
            ("weights_summary", b.weights_summary),
            ("kv_summary", b.kv_summary),
        ):
            entry.trial.set_user_attr(key, value)
        if ledger.route(entry, plan.fingerprint()) != "run":
            return
        if pool is None:  # capacity only: the exact figures are the whole measurement
            ledger.complete(entry, objective_values(self.spec.objectives, entry.capacity, {}))
            return
        ledger.dispatched(entry, pool.submit(entry.number, plan_json))
        self.metrics.workers_busy(pool.in_flight)

    def _record(self, finished) -> None:
        entry = self.ledger.live.get(finished.key)
        if entry is None:  # a result for a trial already told (a deadline hit first)
            return
        self.metrics.attempt(finished.elapsed_s, finished.reason if finished.error else None)
        if finished.error is not None:
            lost = " (worker lost)" if finished.reason == "worker_died" else ""
            error = f"{type(finished.error).__name__}: {finished.error}{lost}"
            self.ledger.fail(entry, finished.reason or "error", error)
            return
        r = finished.result
        try:
            values = objective_values(self.spec.objectives, entry.capacity, r.summary)
            constraints = constraint_values(self.spec.constraints, r.summary, r.gates)
        except ValueError as err:
            reason = "nan" if "not a finite number" in str(err) else "error"
            self.ledger.fail(entry, reason, str(err))
            return
        timings = dict(r.timings_s) | {"worker_elapsed": finished.elapsed_s}
        entry.trial.set_user_attr("summary", r.summary)
        entry.trial.set_user_attr("timings_s", timings)
        if r.pid:
            entry.trial.set_user_attr("worker_pid", r.pid)
        if r.extra.get("slice"):  # which gang of a slice worker ran it (tenantq.workers.slice)
            entry.trial.set_user_attr("slice", r.extra["slice"])
        numeric = {k: v for k, v in r.summary.items() if isinstance(v, int | float)}
        entry.log = {
            "metrics": numeric | {f"time.{k}_s": v for k, v in timings.items()},
            "tags": {"tenantq.worker": r.worker, **_verdict_tags(r.summary, constraints)},
            "artifacts": {
                "examples.parquet": r.examples,
                "memory_report.json": r.memory_report,
                "gates.json": r.gates,
            },
        }
        self.ledger.complete(entry, values, constraints, r.summary)

    def _log_told(self) -> None:
        """TOLD -> LOGGED for every told trial; a logging error leaves the outcome alone."""
        for entry in self.ledger.untold_logs():
            self.heartbeats.remove(entry.number)
            if entry.outcome == "complete":
                self.metrics.finished("complete")
            else:
                self.metrics.finished("fail")
            log = entry.log
            if entry.duplicate_of is not None:
                numeric = {k: v for k, v in entry.summary.items() if isinstance(v, int | float)}
                log = {"metrics": numeric, "tags": {}, "artifacts": {}}
            elif entry.outcome == "complete" and not log:
                log = {"metrics": {}, "tags": _verdict_tags({}, entry.constraints)}
            try:
                log_entry(
                    self.tracker,
                    entry,
                    self.context.config,
                    metrics=log.get("metrics", {}),
                    tags=log.get("tags", {}),
                    artifacts=log.get("artifacts", {}),
                )
            except Exception as err:  # MLflow, pyarrow: reconciled from the study at the end
                print(
                    f"tenantq search: trial {entry.number} told, its MLflow run not written "
                    f"({type(err).__name__}: {str(err)[:200]}); written at the end",
                    file=sys.stderr,
                )
                self.ledger.log_deferred(entry)
                continue
            self.ledger.logged(entry)

    # ---------------------------------------------------------------- start and stop
    def _connect_tracking(self):
        from mlflow.exceptions import MlflowException

        from tenantq.tracking import StudyTracker

        uri = self.spec.tracking.uri
        try:
            return StudyTracker(uri, self.spec.experiment_name)
        except MlflowException as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(f"tracking.uri: cannot open MLflow at {uri!r}: {first}") from None

    def _worker_class(self) -> type | None:
        """The Ray pool's worker class: `worker_class`, else the spec's or the one
        `TENANTQ_WORKER_CLASS` names (`default_worker_class`, which refuses a bad name);
        None with a `pool_factory`."""
        if self.pool_factory is not None:
            return None
        from tenantq.workers.pool import default_worker_class

        return self.worker_class or default_worker_class(self.spec.workers)

    def _start_pool(self):
        if self.pool_factory is not None:
            return self.pool_factory(self)
        import ray

        from tenantq.workers import WorkerPool, faults
        from tenantq.workers.pool import WORKER_CLASS_ENV

        worker_class = self._worker_class()
        if worker_class.__module__ == faults.__name__:  # never mistaken for a real study
            print(
                f"tenantq search: WARNING: the workers are {worker_class.__name__}, a "
                "fault-injecting test worker (tenantq.workers.faults), not the real one"
                + (f" ({WORKER_CLASS_ENV} is set)" if os.environ.get(WORKER_CLASS_ENV) else "")
                + "; the parent run is tagged tenantq.fault_worker",
                file=sys.stderr,
            )
            self.tracker.tag(
                self.tracker.parent_run_id, "tenantq.fault_worker", worker_class.__name__
            )
        # Under `ray job submit` Ray sets RAY_ADDRESS: join that cluster, do not start one.
        address = self.address or os.environ.get("RAY_ADDRESS")
        if not ray.is_initialized():
            self._started_ray = True
            if address:
                ray.init(address=address, namespace="tenantq", log_to_driver=False)
            else:
                w = self.spec.workers  # a cpu_slice worker holds cores on each of its hosts
                hosts = w.cpu_slice_hosts if w.kind == "cpu_slice" else 1
                cpus = self.workers * w.cpus_per_worker * hosts
                ray.init(
                    num_cpus=max(cpus, os.cpu_count() or 1),
                    include_dashboard=False,
                    namespace="tenantq",
                    log_to_driver=False,
                )
        budget = 1 + self.spec.study.max_trial_retries
        self._pool = pool = WorkerPool(
            self.spec.workers,
            str(self.context.model_path),
            self.spec.eval.suite,
            cache_dir=self.spec.eval.cache_dir,
            count=self.workers,
            calibration=self.spec.calibration.worker_args(),
            worker_class=worker_class,
            trial_timeout_s=self.spec.study.trial_timeout,
            max_replacements=2 * self.workers + budget,
        )
        pool.wait_ready()  # the first worker; the others join as they load
        return pool

    def _stop(self, pool, status: str) -> None:
        """Fail what is still in flight, then shut the pool and Ray down, reconcile and end
        the parent run, each even when an earlier step raised."""
        ledger = getattr(self, "ledger", None)
        try:
            if status != "FINISHED" and ledger is not None:
                for entry in ledger.unfinished():
                    # failing a dispatched trial fails its parked duplicates with it: skip
                    # those already told in this loop
                    if entry.outcome is None:
                        ledger.fail(
                            entry, "driver_stopped", "the driver stopped before this finished"
                        )
                self._log_told()
        finally:
            try:
                if pool is not None:
                    pool.shutdown()
            finally:
                try:
                    if self._started_ray:
                        import ray

                        ray.shutdown()
                finally:
                    try:
                        if ledger is not None and ledger.deferred:
                            reconcile(
                                self.tracker,
                                self.study,
                                self.context.config,
                                self.context.budget_of,
                            )
                    finally:
                        self.tracker.end_study(status, metrics=self._study_metrics())

    def _settled(self, params: dict[str, Any]) -> bool:
        """Whether the plan of trial parameters `params` is settled in the ledger."""
        try:
            plan, _ = self.context.plan_and_budget(params)
        except ValueError:  # no plan: nothing of it can be settled
            return False
        return plan.fingerprint() in self.ledger.settled

    def _finish(self, pool) -> StudyOutcome:
        reconcile(self.tracker, self.study, self.context.config, self.context.budget_of)
        rows = front_.front(self.study, self.spec, pool, self.context.capacity)
        front_.tag_front(self.tracker, rows)
        exported = front_.export(rows, self.out_dir)
        # The plans and front.json reach MLflow too: on a cluster the job's folder is temporary.
        front_files = [*exported, self.out_dir / "front" / "front.json"]
        self.tracker.log_files(self.tracker.parent_run_id, front_files, "front")
        table = render_front(rows, self.spec.objectives)
        self.tracker.log_artifact(self.tracker.parent_run_id, "pareto.txt", table)
        return StudyOutcome(
            study_name=self.spec.study.name,
            storage=self.spec.study.storage,
            counts=self.counts(),
            front=rows,
            table=table,
            exported=exported,
            mlflow_parent_run_id=self.tracker.parent_run_id or "",
        )

    def counts(self) -> dict[str, int]:
        c = self.ledger.counts
        return {
            "complete": c["complete"],
            "failed": c["failed"],
            "retries": c["retries"],
            "duplicates": c["duplicates"],
            "not_run": c["not_run"],  # closed unrun at the end: neither failed nor asked
            "done": self.ledger.done,
            "asks": self.ledger.asks,
        }

    def _study_metrics(self) -> dict[str, float]:
        if getattr(self, "ledger", None) is None:
            return {}
        from tenantq.search.quality_model import prediction_metrics

        c = self.counts()
        out = {"study.complete": c["complete"], "study.failed": c["failed"]}
        out["study.plans"] = c["done"]
        with contextlib.suppress(Exception):  # the study could not be read: nothing to add
            out["study.front_size"] = len(front_.own_best_trials(self.study))
        out.update(prediction_metrics(self.study))  # capacity_aware's predictions vs measured
        return out


def _verdict_tags(summary: dict[str, Any], constraints: dict[str, float]) -> dict[str, str]:
    tags = {f"tenantq.{k}": str(v) for k, v in summary.items() if isinstance(v, str)}
    tags["tenantq.shippable"] = "true" if all(v <= 0 for v in constraints.values()) else "false"
    return tags
