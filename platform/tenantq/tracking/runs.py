"""MLflow runs for a study: the parent run, one nested run per trial, and their artifacts.

Written with `MlflowClient` and explicit run ids (no fluent active-run state), so the driver can
log a trial whenever its result arrives and a resumed driver can reopen the same parent run.
Metric names are passed through as the evaluator gives them (already MLflow-valid); strings
(verdicts) become tags, since MLflow metrics are numbers.
"""

from __future__ import annotations

import json
import math
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PARENT_TAG = "mlflow.parentRunId"
# MLflow 3 opens an experiment without this tag on its GenAI traces overview, not the runs table.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
RUN_NAME_TAG = "mlflow.runName"
MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value


# A tree shipped without its .git (a Ray job's upload, an image) carries what the submitter
# knew: `cluster/submit.sh` sets these from `git` in the runtime_env of the job it submits.
SOURCE_COMMIT_ENV = "TENANTQ_SOURCE_COMMIT"
SOURCE_DIRTY_ENV = "TENANTQ_SOURCE_DIRTY"  # "true" / "false"


def source_version(root: str | Path | None = None) -> dict[str, str]:
    """Where the running tenantq came from: `commit` (a sha, or "" when unknown), `dirty`
    ("true", "false" or "unknown") and `origin` ("git": read from the tree's .git;
    "submitted": the submitter's environment; "unknown: ..." saying why neither)."""
    import os

    import tenantq

    commit = os.environ.get(SOURCE_COMMIT_ENV, "").strip()
    if commit:
        dirty = os.environ.get(SOURCE_DIRTY_ENV, "unknown").strip().lower() or "unknown"
        return {"commit": commit, "dirty": dirty, "origin": "submitted"}
    where = Path(root) if root else Path(tenantq.__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "."], cwd=where, capture_output=True, text=True
        ).stdout.strip()
        return {"commit": sha, "dirty": "true" if dirty else "false", "origin": "git"}
    except (OSError, subprocess.CalledProcessError):
        why = f"no .git above {where} and no {SOURCE_COMMIT_ENV} (submit with cluster/submit.sh)"
        return {"commit": "", "dirty": "unknown", "origin": f"unknown: {why}"}


def code_version(root: str | Path | None = None) -> str:
    """`git describe`-style commit of the tenantq source tree, '+dirty' if it has edits
    (`tenantq-VERSION` when the commit is unknown)."""
    import tenantq

    found = source_version(root)
    if not found["commit"]:
        return f"tenantq-{getattr(tenantq, '__version__', 'unknown')}"
    return found["commit"] + ("+dirty" if found["dirty"] == "true" else "")


def source_tags(root: str | Path | None = None) -> dict[str, str]:
    """MLflow tags of the code a run ran: MLflow's own `mlflow.source.git.commit` (shown in
    its UI) when the commit is known, plus tenantq's dirty flag and where the two came from."""
    found = source_version(root)
    tags = {"tenantq.source.dirty": found["dirty"], "tenantq.source.origin": found["origin"]}
    if found["commit"]:
        tags["mlflow.source.git.commit"] = found["commit"]
    return tags


def check_tracking_uri(uri: str, key: str = "tracking.uri") -> None:
    """Raise a one-line ValueError naming `key` when MLflow has no tracking store for the
    URI's scheme (MLflow's own table of schemes: nothing is built, opened or connected)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry

    check_sqlite_file(uri, key)
    try:
        _tracking_store_registry.get_store_builder(uri)
    except MlflowException:
        scheme = uri.split(":", 1)[0] if ":" in uri else ""
        raise ValueError(
            f"{key}: MLflow cannot track to {uri!r} (scheme {scheme!r}); write "
            "sqlite:///mlflow.db, a folder, or http://HOST:PORT of an MLflow server"
        ) from None


# The first 16 bytes of every SQLite 3 database file (sqlite.org/fileformat.html, 1.3.1).
SQLITE_MAGIC = b"SQLite format 3\x00"


def sqlite_file(url: str) -> Path | None:
    """The file of a `sqlite:///FILE` URL (None for other URLs and in-memory databases)."""
    if not url.startswith("sqlite:"):
        return None
    from sqlalchemy.engine import make_url

    try:
        database = make_url(url).database
    except Exception:  # a malformed URL is named by the URL checks
        return None
    if database in (None, "", ":memory:"):
        return None
    return Path(database).expanduser()


def check_sqlite_file(url: str, key: str) -> None:
    """A sqlite store's file (Optuna's or MLflow's), when it exists, is a SQLite database or
    empty (sqlite initialises an empty file): another file or a folder there would be a
    traceback from deep in SQLAlchemy. One ValueError line naming `key`."""
    path = sqlite_file(url)
    if path is None or not path.exists():
        return
    if path.is_dir():
        raise ValueError(f"{key}: {path} is a folder; give a sqlite:/// path to a database file")
    try:
        with path.open("rb") as f:
            head = f.read(len(SQLITE_MAGIC))
    except OSError as err:
        raise ValueError(f"{key}: cannot read {path} ({err.strerror or err})") from None
    if head and head != SQLITE_MAGIC:
        raise ValueError(
            f"{key}: {path} is not a SQLite database (it starts with {head[:8]!r}); move it "
            "away, or point the URL at another file"
        )


def _artifacts_beside(tracking_uri: str) -> str | None:
    """Where a new experiment of a sqlite store keeps its artifacts: `mlruns/` beside the
    database file, one folder per experiment. MLflow's own default is `./mlruns` of whatever
    folder the process runs in, so the same database would scatter its artifacts over every
    folder a study was started from. None (the store's default) for servers and other URLs."""
    import uuid

    db = sqlite_file(tracking_uri)
    if db is None:
        return None
    return (db.resolve().parent / "mlruns" / uuid.uuid4().hex).as_uri()


class StudyTracker:
    """The MLflow side of one study: experiment, parent run, nested trial runs."""

    def __init__(self, tracking_uri: str, experiment: str) -> None:
        import mlflow
        from mlflow import MlflowClient

        self.tracking_uri = tracking_uri
        mlflow.set_tracking_uri(tracking_uri)
        self.client = MlflowClient(tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        if found is None:
            self.experiment_id = self.client.create_experiment(
                experiment,
                artifact_location=_artifacts_beside(tracking_uri),
                tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND},
            )
        else:
            self.experiment_id = found.experiment_id
            if EXPERIMENT_KIND_TAG not in found.tags:  # an experiment made before the tag
                self.client.set_experiment_tag(
                    self.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND
                )
        self.parent_run_id: str | None = None

    # ---------------------------------------------------------------- parent run
    def start_study(
        self, study_name: str, params: Mapping[str, Any], tags: Mapping[str, str], spec_text: str
    ) -> str:
        run = self.client.create_run(
            self.experiment_id,
            run_name=f"study-{study_name}",
            tags={**tags, "tenantq.kind": "study"},
        )
        self.parent_run_id = run.info.run_id
        self._log_params(self.parent_run_id, params)
        self._log_text(self.parent_run_id, spec_text, "spec.toml")
        return self.parent_run_id

    def resume_study(self, run_id: str) -> None:
        run = self.client.get_run(run_id)
        if run.info.status != "RUNNING":
            self.client.update_run(run_id, status="RUNNING")
        self.parent_run_id = run_id

    def end_study(self, status: str = "FINISHED", metrics: Mapping[str, float] | None = None):
        assert self.parent_run_id
        if metrics:
            self._log_metrics(self.parent_run_id, metrics)
        self.client.set_terminated(self.parent_run_id, status)

    # ---------------------------------------------------------------- trial runs
    def log_trial(
        self,
        trial_number: int,
        *,
        params: Mapping[str, Any],
        metrics: Mapping[str, float],
        tags: Mapping[str, str] = (),  # type: ignore[assignment]
        artifacts: Mapping[str, Any] | None = None,
        error: str | None = None,
    ) -> str:
        """One nested run; `artifacts` maps file names to str/bytes/JSON-able/pyarrow Table."""
        assert self.parent_run_id, "start_study or resume_study first"
        run = self.client.create_run(
            self.experiment_id,
            run_name=f"trial-{trial_number}",
            tags={
                PARENT_TAG: self.parent_run_id,
                "tenantq.kind": "trial",
                "tenantq.trial": str(trial_number),
                **dict(tags or {}),
            },
        )
        run_id = run.info.run_id
        self._log_params(run_id, params)
        self._log_metrics(run_id, metrics)
        for name, value in (artifacts or {}).items():
            self._log_artifact(run_id, name, value)
        if error is not None:
            self.client.set_tag(run_id, "tenantq.error", error[:5000])
            self._log_text(run_id, error, "error.txt")
        self.client.set_terminated(run_id, "FAILED" if error is not None else "FINISHED")
        return run_id

    def trial_runs(self, *, with_status: bool = False) -> dict[int, Any]:
        """Trial number -> run id of this study's nested runs (for tagging and resume); with
        `with_status`, trial number -> (run id, status) of every run, newest first wins."""
        assert self.parent_run_id
        runs = self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.`{PARENT_TAG}` = '{self.parent_run_id}'",
            max_results=50000,
            order_by=["attributes.start_time ASC"],
        )
        if with_status:
            out: dict[int, Any] = {}
            for r in runs:
                out.setdefault(int(r.data.tags["tenantq.trial"]), []).append(
                    (r.info.run_id, r.info.status)
                )
            return out
        return {int(r.data.tags["tenantq.trial"]): r.info.run_id for r in runs}

    def delete_run(self, run_id: str) -> None:
        self.client.delete_run(run_id)

    def tag(self, run_id: str, key: str, value: str) -> None:
        self.client.set_tag(run_id, key, value)

    def log_metrics(self, run_id: str, metrics: Mapping[str, float]) -> None:
        self._log_metrics(run_id, metrics)

    def log_artifact(self, run_id: str, name: str, value: Any) -> None:
        self._log_artifact(run_id, name, value)

    def log_files(self, run_id: str, paths: list[Path], artifact_path: str) -> None:
        """Files as they are on disk, under `artifact_path/` of the run (through the
        tracking server when it serves artifacts: the job's own folder may be temporary)."""
        for path in paths:
            self.client.log_artifact(run_id, str(path), artifact_path=artifact_path)

    # ---------------------------------------------------------------- helpers
    def _log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow's batch limit is 100 params
            self.client.log_batch(run_id, params=items[i : i + 100])

    def _log_metrics(self, run_id: str, metrics: Mapping[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [
            Metric(k, float(v), now, 0)
            for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        ]
        for i in range(0, len(items), 1000):
            self.client.log_batch(run_id, metrics=items[i : i + 1000])

    def _log_text(self, run_id: str, text: str, name: str) -> None:
        self.client.log_text(run_id, text, name)

    def _log_artifact(self, run_id: str, name: str, value: Any) -> None:
        if isinstance(value, str):
            self.client.log_text(run_id, value, name)
            return
        if isinstance(value, dict | list):
            self.client.log_text(run_id, json.dumps(value, indent=2, default=str), name)
            return
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / name
            if isinstance(value, bytes):
                path.write_bytes(value)
            else:  # a pyarrow Table
                import pyarrow.parquet as pq

                pq.write_table(value, path)
            self.client.log_artifact(run_id, str(path))
