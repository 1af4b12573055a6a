"""The study driver: Optuna ask/tell on RDB storage, one plan per idle Ray worker, MLflow logs.

The driver owns all state. It asks Optuna for a trial, turns the parameters into a plan
(`space.plan_from_params`), computes the tenants exactly (`capacity.budget`), answers a plan
already measured from the study, and otherwise sends it to an idle `HostWorker`; never more
trials in flight than workers. Reliability is Optuna's and Ray's: trials carry RDB heartbeats,
so after a killed driver `--resume` fails the stale ones (`fail_stale_trials`) and
`RetryHeartbeatStaleTrialCallback` re-queues them; Ray restarts a dead actor and retries its
trial; a worker Ray gives up on is replaced and its trial re-queued the same bounded way.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic_core import to_jsonable_python

from tenantq.search.checks import check_study
from tenantq.search.metrics import StudyMetrics
from tenantq.search.objectives import capacity_metrics, constraint_values, objective_values
from tenantq.search.pareto import FrontRow, front_rows, quality_with_ci, render_front, verdict_text
from tenantq.search.space import (
    SensitivityProfile,
    baseline_params,
    parameter_choices,
    plan_from_params,
    suggest,
)
from tenantq.search.spec import CAPACITY_METRIC, Spec, wants_baselines

HEARTBEAT_INTERVAL_S = 5  # Optuna RDB heartbeat of every trial this driver has in flight
GRACE_PERIOD_S = 15  # a trial whose heartbeat is older than this belongs to a dead driver
POLL_S = 0.5  # how long one wait for worker results blocks
SPEC_ATTR = "tenantq.spec"
PARENT_RUN_ATTR = "tenantq.mlflow_parent_run_id"
CONFIRMED_ATTR = "tenantq.confirmed"  # study user attr: trial number -> confirmed figures
# Spec keys a resumed study may change: how many trials, and how many workers run them.
RESUMABLE_CHANGES = {("study", "trials"), ("workers", "count")}


@dataclass
class StudyOutcome:
    study_name: str
    storage: str
    counts: dict[str, int]
    front: list[FrontRow]
    table: str
    exported: list[Path] = field(default_factory=list)
    mlflow_parent_run_id: str = ""


@dataclass
class _Prepared:
    """Everything derived from the spec before anything is written anywhere."""

    spec: Spec
    spec_text: str
    model_path: Path
    config: Any
    capacity_config: Any
    deployment: Any
    profile: SensitivityProfile | None
    baselines: list[dict[str, Any]]


def prepare(spec: Spec, spec_text: str) -> _Prepared:
    """Check the spec against the model and the space; raises ValueError, writes nothing."""
    from tenantq.capacity import get_model_config
    from tenantq.model.config import ModelConfig

    model_path = spec.model_path()
    if not (model_path / "config.json").is_file():
        hint = "; this spec needs a local checkpoint" if spec.requires else ""
        raise ValueError(f"model: {model_path} has no config.json{hint}")
    config = ModelConfig.from_file(model_path / "config.json")
    data = spec.calibration.data
    if data is not None and not Path(data).is_file():
        raise ValueError(
            f"calibration.data: {data} is not a file; give a .txt, .jsonl or .parquet file "
            "of calibration text, or leave it out for the reference model's train split"
        )
    capacity_config = get_model_config(spec.deployment.model) if spec.deployment.model else config
    deployment = spec.deployment.build()
    capacity_config.check_tensor_parallel(deployment.chips, valid_name="deployment.chips values")
    profile = (
        SensitivityProfile.load(spec.space.profile, config)
        if spec.space.kind == "sensitivity"
        else None
    )
    parameter_choices(spec.space, config, profile)  # raises on choices the model cannot take
    check_metrics(spec)
    check_stores(spec)
    check_study(spec, config, profile)  # tenantq.search.checks: the model-aware checks
    baselines = baseline_params(spec.space, config, profile) if wants_baselines(spec) else []
    return _Prepared(
        spec, spec_text, model_path, config, capacity_config, deployment, profile, baselines
    )


def check_metrics(spec: Spec) -> None:
    """Objectives and constraints name metrics the spec's suites report (`suite_metrics`):
    a misspelt one is an error now, not a failure of every trial. The confirmation suite
    must report the objectives too (the front is re-measured on it)."""
    import difflib

    from tenantq.evals.suite import load_suite, suite_metrics

    where = [("eval.suite", spec.eval.suite)]
    if spec.eval.confirm_suite:
        where.append(("eval.confirm_suite", spec.eval.confirm_suite))
    for key_name, name in where:
        try:
            suite = load_suite(name)
        except ValueError as err:
            raise ValueError(f"{key_name}: {err}") from None
        metrics = suite_metrics(suite)
        named = [
            (f"objectives.{i}.metric", o.metric)
            for i, o in enumerate(spec.objectives)
            if o.metric != CAPACITY_METRIC
        ]
        if key_name == "eval.suite":  # constraints are checked on the search suite's results
            named += [
                (f"constraints.{i}", c.metric if c.bound == "value" else f"{c.metric}.{c.bound}")
                for i, c in enumerate(spec.constraints or [])
            ]
        for key, metric in named:
            if metric in metrics:
                continue
            close = difflib.get_close_matches(metric, [*metrics, CAPACITY_METRIC], n=3)
            hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
            # the headline deltas (each also has .ci_low/.ci_high), not all of them
            deltas = [
                m
                for m in metrics
                if m in ("fidelity.kl_mean", "fidelity.top1_agree_delta", "fidelity.ppl_ratio")
                or (".acc_delta" in m and not m.endswith(("ci_low", "ci_high", "noise_floor")))
            ]
            raise ValueError(
                f"{key}: suite {suite.name!r} ({key_name}) does not report {metric!r}; {hint}"
                f"its deltas are {', '.join(deltas)} ({len(metrics)} metrics in all, with "
                f"their .ci_low/.ci_high), and the capacity objective is {CAPACITY_METRIC!r}"
            )


# MLflow URIs that are SQLAlchemy database URLs (the rest: files, servers, Databricks).
_MLFLOW_DB_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


def _check_database_url(url: str, key: str, what: str) -> None:
    """A SQLAlchemy URL whose dialect and driver load here, and for a sqlite file, whose
    folder exists; checked without connecting or creating anything."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    forms = "sqlite:///FILE.db, postgresql://USER@HOST/DB or mysql://USER@HOST/DB"
    try:
        parsed = make_url(url)
        dialect = parsed.get_dialect()
    except (ArgumentError, NoSuchModuleError, ValueError):
        raise ValueError(
            f"{key}: {url!r} is not a database URL {what} can use; write {forms}"
        ) from None
    try:
        dialect.import_dbapi()
    except ImportError as err:
        raise ValueError(
            f"{key}: {url!r} needs the {parsed.get_backend_name()} driver, which is not "
            f"installed ({err}); install it, or use {forms}"
        ) from None
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        folder = Path(parsed.database).expanduser().absolute().parent
        if what == "Optuna" and not folder.is_dir():  # sqlite creates the file, not folders
            raise ValueError(
                f"{key}: the folder of {parsed.database!r} ({folder}) does not exist; create "
                "it, or give a sqlite:/// path in an existing folder"
            )


def check_stores(spec: Spec) -> None:
    """`study.storage` is an Optuna RDB URL and `tracking.uri` a URI MLflow takes, checked
    before either store is opened, so that a typo in one does not leave the other written."""
    _check_database_url(spec.study.storage, "study.storage", "Optuna")
    uri = spec.tracking.uri
    scheme = uri.split(":", 1)[0] if "://" in uri or uri.startswith("sqlite:") else ""
    if scheme.split("+")[0] in _MLFLOW_DB_SCHEMES:
        _check_database_url(uri, "tracking.uri", "MLflow")
        return
    from tenantq.tracking import check_tracking_uri

    check_tracking_uri(uri, "tracking.uri")


def make_sampler(spec: Spec):
    import optuna

    s = spec.sampler
    if s.kind == "nsga2":
        kwargs = {"population_size": s.population_size} if s.population_size else {}
        return optuna.samplers.NSGAIISampler(seed=s.seed, **kwargs)
    if s.kind == "tpe":
        return optuna.samplers.TPESampler(seed=s.seed, multivariate=True)
    if s.kind == "gp":
        return optuna.samplers.GPSampler(seed=s.seed)
    if s.kind == "grid":
        choices = parameter_choices(spec.space, *_space_inputs(spec))
        grid = {k: list(v) for k, v in choices.items()}
        return optuna.samplers.GridSampler(grid, seed=s.seed)
    if s.kind == "capacity_aware":
        from tenantq.search.capacity_aware import sampler_for_spec

        return sampler_for_spec(spec)
    return optuna.samplers.RandomSampler(seed=s.seed)


def _space_inputs(spec: Spec):
    from tenantq.model.config import ModelConfig

    config = ModelConfig.from_file(spec.model_path() / "config.json")
    profile = (
        SensitivityProfile.load(spec.space.profile, config)
        if spec.space.kind == "sensitivity"
        else None
    )
    return config, profile


def study_exists(storage_url: str, study_name: str) -> bool:
    """Whether the Optuna storage at `storage_url` holds `study_name` (a missing sqlite file:
    no, and no file is created)."""
    import optuna

    if storage_url.startswith("sqlite:///") and not Path(storage_url[10:]).is_file():
        return False
    return study_name in optuna.study.get_all_study_names(storage_url)


def make_storage(url: str, max_retry: int):
    import optuna
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    return RDBStorage(
        url,
        heartbeat_interval=HEARTBEAT_INTERVAL_S,
        grace_period=GRACE_PERIOD_S,
        heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=max_retry),
    )


class SearchDriver:
    def __init__(
        self,
        spec: Spec,
        spec_text: str,
        *,
        resume: bool = False,
        workers: int | None = None,
        address: str | None = None,
        progress: bool = True,
        out_dir: str | Path | None = None,
        worker_class: type | None = None,
    ) -> None:
        """`worker_class`: a `HostWorker` subclass for the pool (tests inject faults with
        `tenantq.workers.faults`); None is `HostWorker`."""
        self.prep = prepare(spec, spec_text)
        self.worker_class = worker_class
        self.spec = spec
        self.resume = resume
        self.workers = workers or spec.workers.count
        self.address = address
        self.progress = progress
        self.out_dir = Path(out_dir) if out_dir else Path("runs") / spec.study.name
        self._retry = None
        self._fingerprints: dict[str, int] = {}  # plan fingerprint -> completed trial number
        self._parked: dict[str, list[Any]] = {}  # fingerprint in flight -> duplicate trials
        self._inflight: dict[int, dict[str, Any]] = {}  # trial number -> context
        self._last_heartbeat = 0.0
        self._started_ray = False
        self.metrics = StudyMetrics(spec.study.name, enabled=False)
        self._confirmations: dict[int, Any] = {}

    # ---------------------------------------------------------------- study and runs
    def _open_study(self):
        import optuna
        from optuna.storages import RetryHeartbeatStaleTrialCallback
        from sqlalchemy.exc import SQLAlchemyError

        spec = self.spec
        try:
            storage = make_storage(spec.study.storage, spec.study.max_trial_retries)
        except SQLAlchemyError as err:  # OperationalError and kin: the server or the file
            first = str(err).strip().splitlines()[0]
            raise ValueError(
                f"study.storage: cannot open {spec.study.storage!r}: {first}"
            ) from None
        self._retry = RetryHeartbeatStaleTrialCallback(max_retry=spec.study.max_trial_retries)
        names = optuna.study.get_all_study_names(storage)
        exists = spec.study.name in names
        directions = [o.direction for o in spec.objectives]
        if self.resume and not exists:
            raise ValueError(
                f"--resume: no study {spec.study.name!r} in {spec.study.storage}; "
                f"studies there: {', '.join(names) or 'none'}"
            )
        if not self.resume and exists:
            raise ValueError(
                f"study {spec.study.name!r} already exists in {spec.study.storage}; "
                "pass --resume to continue it, or change study.name"
            )
        if exists:
            study = optuna.load_study(
                study_name=spec.study.name, storage=storage, sampler=make_sampler(spec)
            )
            _check_same_spec(study.user_attrs.get(SPEC_ATTR), spec)
        else:
            study = optuna.create_study(
                study_name=spec.study.name,
                storage=storage,
                sampler=make_sampler(spec),
                directions=directions,
            )
            study.set_user_attr(SPEC_ATTR, spec.model_dump(mode="json"))
            for params in self.prep.baselines:
                study.enqueue_trial(params, user_attrs={"baseline": True})
        return storage, study

    def _connect_tracking(self):
        from mlflow.exceptions import MlflowException

        from tenantq.tracking import StudyTracker

        uri = self.spec.tracking.uri
        try:
            return StudyTracker(uri, self.spec.experiment_name)
        except MlflowException as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(f"tracking.uri: cannot open MLflow at {uri!r}: {first}") from None

    def _open_tracking(self, study, tracker):
        from tenantq.evals.identity import model_identity
        from tenantq.tracking import code_version

        spec = self.spec
        parent = study.user_attrs.get(PARENT_RUN_ATTR)
        if parent:
            tracker.resume_study(parent)
            return tracker
        dep = spec.deployment
        params = {
            "study.name": spec.study.name,
            "study.trials": spec.study.trials,
            "study.storage": spec.study.storage,
            "model.path": str(self.prep.model_path),
            "model.identity": model_identity(self.prep.model_path),
            "deployment.hardware": dep.hardware,
            "deployment.memory": dep.memory or "",
            "deployment.chips": dep.chips,
            "deployment.context_tokens": dep.context_tokens,
            "deployment.page_tokens": dep.page_tokens,
            "deployment.reserve": dep.reserve if dep.reserve is not None else "10%",
            "space.kind": spec.space.kind,
            "sampler.kind": spec.sampler.kind,
            "sampler.seed": spec.sampler.seed,
            "eval.suite": spec.eval.suite,
            "eval.confirm_suite": spec.eval.confirm_suite or "",
            "objectives": ", ".join(f"{o.direction} {o.metric}" for o in spec.objectives),
            "workers.count": self.workers,
            "workers.kind": spec.workers.kind,
        }
        tags = {"tenantq.code_version": code_version(), "tenantq.study": spec.study.name}
        run_id = tracker.start_study(spec.study.name, params, tags, self.prep.spec_text)
        study.set_user_attr(PARENT_RUN_ATTR, run_id)
        return tracker

    # ---------------------------------------------------------------- the loop
    def run(self) -> StudyOutcome:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
        # MLflow first: its experiment is only looked up or created here, so a tracking URI
        # that cannot be reached stops the study before Optuna's storage holds a new study.
        tracker = self._connect_tracking()
        storage, study = self._open_study()
        self.storage, self.study = storage, study
        tracker = self._open_tracking(study, tracker)
        self.tracker = tracker
        self._requeue_dead_driver_trials()
        self._reconcile_runs()
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
            self._fingerprints.setdefault(t.user_attrs.get("plan_fingerprint", ""), t.number)
        # A capacity-only study needs no worker: every figure is arithmetic in the driver.
        needs_workers = bool(self.spec.quality_objectives() or self.spec.eval.confirm_suite)
        pool = self._start_pool() if needs_workers else None
        self.metrics = StudyMetrics(self.spec.study.name, enabled=pool is not None)
        status = "FAILED"
        try:
            self._search(pool)
            outcome = self._finish(pool)
            status = "FINISHED"
            return outcome
        finally:
            if pool is not None:
                pool.shutdown()
            if self._started_ray:
                import ray

                ray.shutdown()
            if status != "FINISHED":
                for number in list(self._inflight):
                    self._fail(number, "the driver stopped before this trial finished", retry=False)
            tracker.end_study(status, metrics=self._study_metrics())

    def _start_pool(self):
        import ray

        from tenantq.workers import WorkerPool

        # Under `ray job submit` Ray sets RAY_ADDRESS: join that cluster, do not start one.
        address = self.address or os.environ.get("RAY_ADDRESS")
        if not ray.is_initialized():
            self._started_ray = True
            if address:
                ray.init(address=address, namespace="tenantq", log_to_driver=False)
            else:
                cpus = self.workers * self.spec.workers.cpus_per_worker
                ray.init(
                    num_cpus=max(cpus, os.cpu_count() or 1),
                    include_dashboard=False,
                    namespace="tenantq",
                    log_to_driver=False,
                )
        pool = WorkerPool(
            self.spec.workers,
            str(self.prep.model_path),
            self.spec.eval.suite,
            cache_dir=self.spec.eval.cache_dir,
            count=self.workers,
            calibration=self.spec.calibration.worker_args(),
            worker_class=self.worker_class,
        )
        pool.wait_ready()
        return pool

    def _requeue_dead_driver_trials(self) -> None:
        """Trials a killed driver left RUNNING: wait until their heartbeats are stale, then let
        Optuna fail them; its retry callback re-queues each as a WAITING trial."""
        import optuna
        from optuna.storages import fail_stale_trials

        running = optuna.trial.TrialState.RUNNING
        deadline = time.monotonic() + GRACE_PERIOD_S + 2 * HEARTBEAT_INTERVAL_S
        while self.study.get_trials(deepcopy=False, states=(running,)):
            fail_stale_trials(self.study)
            if not self.study.get_trials(deepcopy=False, states=(running,)):
                break
            if time.monotonic() > deadline:
                numbers = [t.number for t in self.study.get_trials(states=(running,))]
                raise ValueError(
                    f"study {self.spec.study.name!r} has trials {numbers} still running with "
                    "fresh heartbeats: another driver is running it"
                )
            time.sleep(1.0)

    def _reconcile_runs(self) -> None:
        """Finished trials without a nested MLflow run (the driver died between telling Optuna
        and logging) get their run now, from what the study recorded."""
        import optuna

        from tenantq.quant.plan import QuantPlan
        from tenantq.tracking import flatten_plan

        S = optuna.trial.TrialState
        runs = self.tracker.trial_runs()
        for t in self.study.get_trials(deepcopy=False, states=(S.COMPLETE, S.FAIL)):
            if t.number in runs:
                continue
            attrs = t.user_attrs
            ctx: dict[str, Any] = {"params": {f"space.{k}": v for k, v in t.params.items()}}
            if "plan" in attrs:
                ctx["plan"] = QuantPlan.from_json(attrs["plan"])
                ctx["params"] |= flatten_plan(ctx["plan"], self.prep.config)
            summary = attrs.get("summary", {})
            metrics = {k: v for k, v in summary.items() if isinstance(v, int | float)}
            error = None
            if t.state == S.FAIL:
                error = attrs.get(
                    "error", "the driver running this trial stopped (stale heartbeat)"
                )
            self._log_trial(
                t.number,
                ctx,
                metrics=metrics | attrs.get("capacity", {}),
                tags={"tenantq.logged_on_resume": "true"},
                artifacts={},
                error=error,
            )

    def _counts(self) -> dict[str, int]:
        import optuna

        S = optuna.trial.TrialState
        trials = self.study.get_trials(deepcopy=False)
        complete = sum(t.state == S.COMPLETE for t in trials)
        failed = sum(t.state == S.FAIL for t in trials)
        retries = sum("failed_trial" in t.system_attrs for t in trials)
        return {
            "complete": complete,
            "failed": failed,
            "retries": retries,
            "done": complete + failed - retries,
            "waiting": sum(t.state == S.WAITING for t in trials),
        }

    def _search(self, pool) -> None:
        from tqdm import tqdm

        total = self.spec.study.trials
        counts = self._counts()
        bar = tqdm(
            total=total,
            initial=min(counts["done"], total),
            desc=f"study {self.spec.study.name}",
            unit="trial",
            disable=not self.progress,
            dynamic_ncols=True,
        )
        shown: tuple[int, ...] = ()
        try:
            while True:
                counts = self._counts()
                busy = len(self._inflight)
                while (pool is None or pool.idle) and counts["done"] + busy < total:
                    self._ask_and_dispatch(pool)
                    counts = self._counts()
                    busy = len(self._inflight)
                if counts["done"] >= total and not self._inflight:
                    break
                self._heartbeat()
                for finished in pool.wait(POLL_S) if pool is not None else []:
                    self._record(finished)
                    self.metrics.workers_busy(pool.in_flight)
                counts = self._counts()
                state = (counts["done"], len(self._inflight), counts["failed"])
                if state != shown:  # redraw on change only: quiet logs when not on a terminal
                    shown = state
                    bar.n = min(counts["done"], total)
                    bar.set_postfix(
                        running=len(self._inflight),
                        failed=counts["failed"],
                        front=len(self.study.best_trials),
                        refresh=False,
                    )
                    bar.refresh()
        finally:
            bar.close()

    def _heartbeat(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_heartbeat >= HEARTBEAT_INTERVAL_S / 2:
            for ctx in self._inflight.values():
                self.storage.record_heartbeat(ctx["trial"]._trial_id)
            self._last_heartbeat = now

    def _ask_and_dispatch(self, pool) -> None:
        from tenantq.capacity import budget
        from tenantq.tracking import flatten_plan

        prep = self.prep
        trial = self.study.ask()
        self.storage.record_heartbeat(trial._trial_id)
        ctx: dict[str, Any] = {"trial": trial, "start": time.time()}
        self._inflight[trial.number] = ctx
        try:
            params = suggest(trial, self.spec.space, prep.config, prep.profile)
            plan = plan_from_params(
                self.spec.space,
                params,
                prep.config,
                algorithm=self.spec.calibration.algorithm,
                profile=prep.profile,
            )
            fp = plan.fingerprint()
            b = budget(
                prep.capacity_config,
                plan,
                prep.deployment,
                self.spec.deployment.context_tokens,
            )
        except ValueError as err:
            self._fail(trial.number, f"plan: {err}", retry=False)
            return
        ctx.update(
            plan=plan,
            fingerprint=fp,
            budget=b,
            capacity=capacity_metrics(b),
            params=flatten_plan(plan, prep.config) | {f"space.{k}": v for k, v in params.items()},
        )
        trial.set_user_attr("plan_fingerprint", fp)
        trial.set_user_attr("plan", plan.to_json())
        trial.set_user_attr("capacity", ctx["capacity"])
        trial.set_user_attr("weights_summary", b.weights_summary)
        trial.set_user_attr("kv_summary", b.kv_summary)
        if fp in self._fingerprints:
            self._answer_duplicate(trial.number, self._fingerprints[fp])
            return
        if fp in self._parked or any(
            c.get("fingerprint") == fp and "worker" in c for c in self._inflight.values()
        ):
            self._parked.setdefault(fp, []).append(trial.number)
            return
        if not self.spec.quality_objectives():
            self._tell(trial.number, summary={}, gates={}, timings={}, artifacts={})
            return
        ctx["worker"] = pool.submit(trial.number, plan.to_json())
        trial.set_user_attr("worker", ctx["worker"])
        self.metrics.workers_busy(pool.in_flight)

    # ---------------------------------------------------------------- outcomes
    def _record(self, finished) -> None:
        number = finished.key
        if isinstance(number, tuple):  # a confirmation run
            self._confirmations[number[1]] = finished
            return
        ctx = self._inflight.get(number)
        if ctx is None:
            return
        failure = None
        if finished.error is not None:
            failure = "worker_died" if finished.worker_lost else "error"
        self.metrics.attempt(finished.elapsed_s, failure)
        if finished.error is not None:
            lost = (
                " (worker lost; Ray's restarts and retries exhausted)"
                if finished.worker_lost
                else ""
            )
            self._fail(
                number,
                f"{type(finished.error).__name__}: {finished.error}{lost}",
                retry=finished.worker_lost,
            )
        else:
            r = finished.result
            timings = dict(r.timings_s) | {"worker_elapsed": finished.elapsed_s}
            artifacts = {
                "examples.parquet": r.examples,
                "memory_report.json": r.memory_report,
                "gates.json": r.gates,
            }
            try:
                self._tell(number, r.summary, r.gates, timings, artifacts, r.worker, r.pid)
            except ValueError as err:
                self._fail(number, str(err), retry=False)
        fp = ctx.get("fingerprint")
        for dup in self._parked.pop(fp, []) if fp else []:
            if fp in self._fingerprints:
                self._answer_duplicate(dup, self._fingerprints[fp])
            else:
                self._fail(dup, f"the trial measuring the same plan ({number}) failed", retry=False)

    def _tell(
        self, number, summary, gates, timings, artifacts, worker: str = "", worker_pid: int = 0
    ) -> None:
        ctx = self._inflight[number]
        trial = ctx["trial"]
        values = objective_values(self.spec.objectives, ctx["budget"].tenants, summary)
        constraints = constraint_values(self.spec.constraints, summary, gates)
        for key, value in constraints.items():
            trial.set_constraint(key, value)
        numeric = {k: v for k, v in summary.items() if isinstance(v, int | float)}
        trial.set_user_attr("summary", summary)
        trial.set_user_attr("timings_s", timings)
        if worker_pid:
            trial.set_user_attr("worker_pid", worker_pid)
        self.study.tell(trial, values)
        self.metrics.finished("complete")
        del self._inflight[number]
        self._fingerprints[ctx["fingerprint"]] = number
        self._log_trial(
            number,
            ctx,
            metrics=numeric | ctx["capacity"] | {f"time.{k}_s": v for k, v in timings.items()},
            tags={"tenantq.worker": worker, **_verdict_tags(summary, constraints)},
            artifacts=artifacts,
        )

    def _answer_duplicate(self, number: int, original: int) -> None:
        """A plan already measured: tell Optuna the same figures, never run it again."""
        ctx = self._inflight.pop(number)
        trial = ctx["trial"]
        source = self.study.trials[original]
        for key, value in source.constraints.items():
            trial.set_constraint(key, value)
        trial.set_user_attr("duplicate_of", original)
        trial.set_user_attr("summary", source.user_attrs.get("summary", {}))
        self.study.tell(trial, list(source.values))
        self.metrics.finished("complete")
        summary = source.user_attrs.get("summary", {})
        numeric = {k: v for k, v in summary.items() if isinstance(v, int | float)}
        self._log_trial(
            number,
            ctx,
            metrics=numeric | ctx["capacity"],
            tags={"tenantq.duplicate_of": str(original)},
            artifacts={},
        )

    def _fail(self, number: int, error: str, *, retry: bool) -> None:
        import optuna

        ctx = self._inflight.pop(number)
        trial = ctx["trial"]
        trial.set_user_attr("error", error[:2000])
        self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
        self.metrics.finished("fail")
        if retry:
            self._retry(self.study, self.study.trials[number])
        self._log_trial(
            number, ctx, metrics=ctx.get("capacity", {}), tags={}, artifacts={}, error=error
        )

    def _log_trial(self, number, ctx, *, metrics, tags, artifacts, error=None) -> None:
        plan = ctx.get("plan")
        arts = dict(artifacts)
        if plan is not None:
            arts["plan.json"] = plan.to_json()
        if "budget" in ctx:
            from tenantq.capacity.table import render_budget

            arts["budget.txt"] = render_budget(ctx["budget"])
            arts["budget.json"] = ctx["budget"].to_dict()
        # Who ran it and whether it is one of the enqueued baselines, for every outcome (the
        # report's timeline and Pareto markers read these tags).
        attrs = getattr(ctx.get("trial"), "user_attrs", None) or {}
        tags = dict(tags)
        if attrs.get("baseline"):
            tags.setdefault("tenantq.baseline", "true")
        if ctx.get("worker") is not None:
            tags.setdefault("tenantq.worker", str(ctx["worker"]))
        run_id = self.tracker.log_trial(
            number,
            params=ctx.get("params", {}),
            metrics=metrics,
            tags={k: v for k, v in tags.items() if v},
            artifacts={k: v for k, v in arts.items() if v is not None},
            error=error,
        )
        ctx["run_id"] = run_id

    # ---------------------------------------------------------------- the end
    def _finish(self, pool) -> StudyOutcome:
        objectives = self.spec.objectives
        rows = front_rows(self.study.best_trials, objectives)
        if self.spec.eval.confirm_suite and rows:
            rows = self._confirm(pool, rows)
        runs = self.tracker.trial_runs()
        for r in rows:
            if r.trial in runs:
                self.tracker.tag(runs[r.trial], "tenantq.pareto", "true")
                if r.confirmed:
                    self.tracker.log_metrics(
                        runs[r.trial],
                        {f"confirmed.{m}": v[0] for m, v in r.confirmed.items()}
                        | {
                            f"confirmed.{m}.ci_high": v[2]
                            for m, v in r.confirmed.items()
                            if v[2] is not None
                        },
                    )
        exported = self._export(rows)
        table = render_front(rows, objectives)
        self.tracker.log_artifact(self.tracker.parent_run_id, "pareto.txt", table)
        return StudyOutcome(
            study_name=self.spec.study.name,
            storage=self.spec.study.storage,
            counts=self._counts(),
            front=rows,
            table=table,
            exported=exported,
            mlflow_parent_run_id=self.tracker.parent_run_id or "",
        )

    def _confirm(self, pool, rows: list[FrontRow]) -> list[FrontRow]:
        """Re-evaluate the front on the held-out confirmation suite (the winner's curse)."""
        done: dict[str, Any] = dict(self.study.user_attrs.get(CONFIRMED_ATTR, {}))
        todo = [r for r in rows if "summary" not in done.get(str(r.trial), {})]
        errors: dict[int, str] = {}
        while todo or pool.in_flight:
            while todo and pool.idle:
                r = todo.pop(0)
                pool.submit(
                    ("confirm", r.trial), r.plan_json, self.spec.eval.confirm_suite, "confirm"
                )
            for finished in pool.wait(POLL_S):
                self._record(finished)
            for number, finished in list(self._confirmations.items()):
                if finished.error is not None:  # shown, not stored: a resume tries again
                    errors[number] = f"{type(finished.error).__name__}: {finished.error}"
                else:
                    res = finished.result
                    done[str(number)] = {
                        "summary": res.summary,
                        "constraints": constraint_values(
                            self.spec.constraints, res.summary, res.gates
                        ),
                    }
                self.study.set_user_attr(CONFIRMED_ATTR, done)
                del self._confirmations[number]
        for r in rows:
            got = done.get(str(r.trial), {})
            if "summary" in got:
                r.confirmed = {m: quality_with_ci(got["summary"], m) for m in r.quality}
                r.confirmed_feasible = all(v <= 0 for v in got["constraints"].values())
                r.confirmed_verdicts = verdict_text(got["summary"])
            r.confirmed_error = errors.get(r.trial, "")
        return _confirmed_front(rows, self.spec.objectives)

    def _export(self, rows: list[FrontRow]) -> list[Path]:
        folder = self.out_dir / "front"
        folder.mkdir(parents=True, exist_ok=True)
        paths = []
        for r in rows:
            path = folder / f"trial-{r.trial:04d}-{r.fingerprint}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(r.plan_json)
            tmp.replace(path)
            paths.append(path)
        (folder / "front.json").write_text(
            json.dumps(
                [
                    {
                        "trial": r.trial,
                        "fingerprint": r.fingerprint,
                        "tenants": r.tenants,
                        "quality": r.quality,
                        "confirmed": r.confirmed,
                        "shippable": r.feasible,
                        "confirmed_shippable": r.confirmed_feasible,
                        "plan": json.loads(r.plan_json),
                    }
                    for r in rows
                ],
                indent=2,
            )
        )
        return paths

    def _study_metrics(self) -> dict[str, float]:
        try:
            c = self._counts()
            return {
                "study.complete": c["complete"],
                "study.failed": c["failed"],
                "study.front_size": len(self.study.best_trials),
            }
        except Exception:  # the study could not be read: nothing to add
            return {}


def _confirmed_front(rows: list[FrontRow], objectives) -> list[FrontRow]:
    """Rows still shippable and non-dominated when judged on their confirmed figures; a row
    whose confirmation could not run stays, judged on its search-time figures."""
    keep = [r for r in rows if r.confirmed_feasible is not False]

    def vector(r: FrontRow) -> list[float]:
        out = []
        for o in objectives:
            figures = r.confirmed or r.quality
            v = float(r.tenants) if o.metric == CAPACITY_METRIC else figures[o.metric][0]
            out.append(-v if o.direction == "maximize" else v)
        return out

    vecs = {r.trial: vector(r) for r in keep}

    def dominated(a: FrontRow) -> bool:
        va = vecs[a.trial]
        return any(
            all(x <= y for x, y in zip(vecs[b.trial], va, strict=True)) and vecs[b.trial] != va
            for b in keep
            if b is not a
        )

    return [r for r in keep if not dominated(r)]


def _is_default(field, value) -> bool:
    """True when `value` (JSON form) is the default of the pydantic `field`."""
    if field is None or field.is_required():
        return False
    return value == to_jsonable_python(field.get_default(call_default_factory=True))


def _verdict_tags(summary: dict[str, Any], constraints: dict[str, float]) -> dict[str, str]:
    tags = {f"tenantq.{k}": str(v) for k, v in summary.items() if isinstance(v, str)}
    tags["tenantq.shippable"] = "true" if all(v <= 0 for v in constraints.values()) else "false"
    return tags


def _check_same_spec(stored: dict | None, spec: Spec) -> None:
    """Refuse --resume when the spec changed, except for the resumable fields. A field that
    a later tenantq added (absent from the stored spec) is unchanged while it holds its
    default, so a study begun before an upgrade resumes."""
    if not stored:
        return
    now = spec.model_dump(mode="json")
    changed = []
    for section, value in now.items():
        old = stored.get(section)
        if isinstance(value, dict) and isinstance(old, dict):
            fields = type(getattr(spec, section)).model_fields
            changed += [
                f"{section}.{k}"
                for k in value
                if (section, k) not in RESUMABLE_CHANGES
                and (value[k] != old[k] if k in old else not _is_default(fields.get(k), value[k]))
            ]
        elif value != old:
            changed.append(section)
    if changed:
        raise ValueError(
            f"--resume: the spec changed since the study began ({', '.join(changed)}); "
            "only study.trials and workers.count may change"
        )
