"""The study store: the Optuna study opened, created or resumed, with what it measured.

A study records its identity (`StudyContext.identity`: the spec, the model folder's content,
the suites' content, the code version). `--resume` refuses a study whose spec, model or
suites changed, in one line naming what changed; `continue_from` copies the old study under a
new name instead (the user's explicit choice to go on with a changed setup). A change of code
version is reported, not refused (every commit would otherwise strand a study).

Trials a killed driver left RUNNING are failed once their heartbeat is stale and re-queued by
Optuna's `RetryHeartbeatStaleTrialCallback`; one killed inside `ask()`, before its first
heartbeat, has no heartbeat row and Optuna never finds it stale, so a heartbeat is written for
every RUNNING trial first: a live driver keeps refreshing its own, a dead one's goes stale.
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic_core import to_jsonable_python

from tenantq.search.ledger import COPIED_ATTR
from tenantq.search.spec import ExperimentSpec, resumed_sampler

HEARTBEAT_INTERVAL_S = 5  # Optuna RDB heartbeat of every trial this driver has in flight
GRACE_PERIOD_S = 15  # a trial whose heartbeat is older than this belongs to a dead driver
SPEC_ATTR = "tenantq.spec"
IDENTITY_ATTR = "tenantq.identity"
PARENT_RUN_ATTR = "tenantq.mlflow_parent_run_id"
CONTINUED_ATTR = "tenantq.continued_from"
# Spec keys a resumed study may change: how many trials, how many workers run them, and
# Ray's restarts and retries of them (none changes a measurement; the default of
# max_task_retries went from 2 to 0, and a study begun before must still resume).
RESUMABLE_CHANGES = {
    ("study", "trials"),
    ("workers", "count"),
    ("workers", "max_restarts"),
    ("workers", "max_task_retries"),
}
_IDENTITY_WORDS = {
    "model": "the model folder's content (config.json or safetensors)",
    "eval.suite": "the content of eval.suite",
    "eval.confirm_suite": "the content of eval.confirm_suite",
    "spec": "the spec",
}


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


def open_study(
    context, *, resume: bool, sampler_for, continue_from: str | None = None, storage=None
) -> tuple[Any, Any]:
    """(storage, study) for the context's spec; `sampler_for(trials_so_far)` builds the
    sampler. Raises a one-line ValueError for a missing or present study, or a changed one."""
    import optuna
    from sqlalchemy.exc import SQLAlchemyError

    spec: ExperimentSpec = context.spec
    name = spec.study.name
    try:
        if storage is None:
            storage = make_storage(spec.study.storage, spec.study.max_trial_retries)
    except SQLAlchemyError as err:  # OperationalError and kin: the server or the file
        first = str(err).strip().splitlines()[0]
        raise ValueError(f"study.storage: cannot open {spec.study.storage!r}: {first}") from None
    names = optuna.study.get_all_study_names(storage)
    identity = context.identity()
    if continue_from is not None:
        if continue_from not in names:
            raise ValueError(f"--continue-as: no study {continue_from!r} in {spec.study.storage}")
        if name in names:
            raise ValueError(
                f"--continue-as: study {name!r} already exists in {spec.study.storage}; "
                "choose a new name"
            )
        study = _copy_marked(storage, continue_from, name)
        study.set_user_attr(PARENT_RUN_ATTR, "")  # a new MLflow parent run for the new name
        study.set_user_attr(CONTINUED_ATTR, continue_from)
        _record(study, spec, identity)
        resume = True
    exists = name in optuna.study.get_all_study_names(storage)
    if resume and not exists:
        raise ValueError(
            f"--resume: no study {name!r} in {spec.study.storage}; "
            f"studies there: {', '.join(names) or 'none'}"
        )
    if not resume and exists:
        raise ValueError(
            f"study {name!r} already exists in {spec.study.storage}; "
            "pass --resume to continue it, or change study.name"
        )
    if exists:
        study = optuna.load_study(study_name=name, storage=storage)
        if continue_from is None:
            keep_stored_sampler(spec, study.user_attrs.get(SPEC_ATTR), name)
            stored_identity = study.user_attrs.get(IDENTITY_ATTR) or {}
            # with per-file digests the model is compared by content: a copy elsewhere is
            # the same model
            by_content = isinstance(stored_identity.get("files"), dict)
            check_same_spec(study.user_attrs.get(SPEC_ATTR), spec, ignore=("model",) * by_content)
            check_identity(stored_identity, identity, name)
        held = len(study.get_trials(deepcopy=False))
        study.sampler = sampler_for(held)
    else:
        study = optuna.create_study(
            study_name=name,
            storage=storage,
            sampler=sampler_for(0),
            directions=[o.direction for o in spec.objectives],
        )
        _record(study, spec, identity)
    with warnings.catch_warnings():  # experimental since Optuna 3.2, still in 5.0
        warnings.simplefilter("ignore")
        study.set_metric_names([o.metric for o in spec.objectives])
    return storage, study


def enqueue_baselines(
    study, baselines: list[dict[str, Any]], settled: Callable[[dict[str, Any]], bool]
) -> None:
    """Enqueue each baseline the study does not hold, on every start (a study begun without
    them gets them), after a dead driver's trials were re-queued (those go first). A baseline
    is held by a trial that measured it, runs it or waits to, by a trial whose plan failed to
    build (`plan`, the same on every start), or by `settled(params)` (its plan settled for
    good in the ledger). A trial that failed without settling the plan holds nothing: a
    baseline closed unrun (`not_run`), or one killed with the driver or stopped whose copy was
    closed unrun, is enqueued again, as Optuna's `skip_if_exists` would not."""
    from optuna.trial import TrialState

    from tenantq.search.ledger import REASON_ATTR

    holding = (TrialState.COMPLETE, TrialState.RUNNING, TrialState.WAITING)
    held = [
        t.system_attrs.get("fixed_params", t.params)
        for t in study.get_trials(deepcopy=False)
        if t.state in holding or t.user_attrs.get(REASON_ATTR) == "plan"
    ]
    for params in baselines:
        if not any(h == params for h in held) and not settled(params):
            study.enqueue_trial(params, user_attrs={"baseline": True})


def _copy_marked(storage, old_name: str, name: str):
    """The old study's finished trials copied under `name`, each marked `COPIED_ATTR`: their
    figures were measured on the old inputs, so they are history for the sampler and the
    report, never a duplicate's answer or a member of the new front. Trials it left waiting
    or running are not copied (the new study would run them as its own under the mark)."""
    import copy

    import optuna

    old = optuna.load_study(study_name=old_name, storage=storage)
    study = optuna.create_study(study_name=name, storage=storage, directions=old.directions)
    for key, value in old.user_attrs.items():
        study.set_user_attr(key, value)
    for t in old.get_trials(deepcopy=False):
        if not t.state.is_finished():
            continue
        t = copy.deepcopy(t)
        t.set_user_attr(COPIED_ATTR, old_name)
        study.add_trial(t)
    return study


def _record(study, spec: ExperimentSpec, identity: dict[str, str]) -> None:
    study.set_user_attr(SPEC_ATTR, spec.model_dump(mode="json"))
    study.set_user_attr(IDENTITY_ATTR, identity)


def check_identity(stored: dict | None, now: dict[str, str], name: str) -> None:
    """Refuse a resume whose model or suites changed content since the study began; a study
    from before identities were stored is accepted. A new code version is reported only."""
    if not stored:
        return
    if isinstance(stored.get("files"), dict):  # per-file digests: name the file and key
        what = "; ".join(_changed_files(stored, now))
    else:  # a study begun before per-file digests: the folder's digest as then
        changed = [
            k
            for k in now
            if k not in ("code", "spec", "files", "config_keys") and stored.get(k) != now[k]
        ]
        what = "; ".join(
            f"{_IDENTITY_WORDS.get(k, k)} ({str(stored.get(k))[:12]} -> {now[k][:12]}) changed"
            for k in changed
        )
    if what:
        raise ValueError(
            f"--resume: study {name!r} was measured on other inputs: {what}; its trials "
            "would mix with new ones. Restore the inputs, or pass --continue-as NEW_NAME to "
            "copy it and go on under a new name"
        )
    if stored.get("code") and stored.get("code") != now.get("code"):
        print(
            f"tenantq search: resuming {name!r} with code {now.get('code')} (the study began "
            f"with {stored.get('code')})",
            file=sys.stderr,
        )


def _changed_files(stored: dict, now: dict) -> list[str]:
    """'FILE changed' per input file whose content differs (config.json: which keys)."""
    old, new = stored["files"], now.get("files", {})
    out = []
    for name in sorted(set(old) | set(new)):
        if old.get(name) == new.get(name):
            continue
        if name not in new:
            out.append(f"{name} removed")
        elif name not in old:
            out.append(f"{name} added")
        elif name == "model/config.json":
            ok, nk = stored.get("config_keys", {}), now.get("config_keys", {})
            keys = sorted(k for k in set(ok) | set(nk) if ok.get(k) != nk.get(k))
            out.append(f"{name} changed (keys: {', '.join(keys) or '?'})")
        else:
            out.append(f"{name} changed")
    for key in ("eval.suite", "eval.confirm_suite"):  # a suite's own settings
        if key in stored and stored.get(key) != now.get(key):
            out.append(f"{_IDENTITY_WORDS[key]} changed")
    return out


def keep_stored_sampler(spec: ExperimentSpec, stored: dict | None, name: str) -> None:
    """A spec naming no sampler.kind resumes with the sampler its study began with (a study
    begun under the older default, nsga2, is not refused for the new one): `spec` goes on
    with it, in place, so that every holder of the spec builds that sampler."""
    sampler = resumed_sampler(spec, (stored or {}).get("sampler"))
    if sampler is None:
        return
    print(
        f"tenantq search: resuming {name!r} with its sampler {sampler.kind!r} (the spec "
        f"names no sampler.kind; a new study would use {spec.sampler.kind!r})",
        file=sys.stderr,
    )
    sampler.__pydantic_fields_set__.discard("kind")
    object.__setattr__(spec, "sampler", sampler)  # frozen model: the one change, on resume


def _is_default(field, value) -> bool:
    """True when `value` (JSON form) is the default of the pydantic `field`."""
    if field is None or field.is_required():
        return False
    return value == to_jsonable_python(field.get_default(call_default_factory=True))


def check_same_spec(
    stored: dict | None, spec: ExperimentSpec, ignore: tuple[str, ...] = ()
) -> None:
    """Refuse --resume when the spec changed, except for the resumable fields. A field that
    a later tenantq added (absent from the stored spec) is unchanged while it holds its
    default, so a study begun before an upgrade resumes."""
    if not stored:
        return
    now = spec.model_dump(mode="json")
    changed = []
    for section, value in now.items():
        if section in ignore:
            continue
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
            "only study.trials, workers.count, workers.max_restarts and "
            "workers.max_task_retries may change"
        )


def requeue_dead_driver_trials(study, storage, name: str) -> None:
    """Trials a killed driver left RUNNING: wait until their heartbeats are stale, then let
    Optuna fail them; its retry callback re-queues each as a WAITING trial. A trial with no
    heartbeat at all (killed inside ask) is given one now, so that it can go stale."""
    import optuna
    from optuna.storages import fail_stale_trials

    running = optuna.trial.TrialState.RUNNING
    if not study.get_trials(deepcopy=False, states=(running,)):
        return
    fail_stale_trials(study)
    study_id = storage.get_study_id_from_name(name)
    for t in study.get_trials(deepcopy=False, states=(running,)):
        storage.record_heartbeat(
            storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
        )
    deadline = time.monotonic() + GRACE_PERIOD_S + 2 * HEARTBEAT_INTERVAL_S
    while study.get_trials(deepcopy=False, states=(running,)):
        fail_stale_trials(study)
        if not study.get_trials(deepcopy=False, states=(running,)):
            break
        if time.monotonic() > deadline:
            numbers = [t.number for t in study.get_trials(states=(running,))]
            raise ValueError(
                f"study {name!r} has trials {numbers} still running with fresh heartbeats: "
                "another driver is running it"
            )
        time.sleep(min(1.0, GRACE_PERIOD_S / 4))
