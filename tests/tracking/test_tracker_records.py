"""What StudyTracker asks MLflow to record, checked call by call against a recording client.

A unit test of the tracker's own bookkeeping (run names and tags, parent links, batching under
MLflow's limits, which metrics are dropped, artifacts by type, statuses, resume), so each
check costs milliseconds; test_tracking.py runs the same tracker on a real sqlite store.
The stand-in holds MLflow 3's contract, not a looser one: each call is bound to the real
`MlflowClient` method's signature (a wrong argument name or count is a TypeError, as there),
and log_batch, set_tag, create_run, set_terminated/update_run and search_runs run MLflow's own
checks (names, lengths, statuses, max_results, a param's value never changed). The tracker's
batches of 100 params / 1000 metrics are the tracking server's per-request limits; MLflow 3's
client splits larger batches itself, so they are the tracker's choice, pinned here.
"""

from __future__ import annotations

import inspect
import json
import time
from pathlib import Path
from types import SimpleNamespace

import mlflow
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mlflow.entities import RunStatus
from mlflow.exceptions import MlflowException
from mlflow.store.tracking import SEARCH_MAX_RESULTS_THRESHOLD
from mlflow.utils import validation

from tenantq.tracking import runs
from tenantq.tracking.runs import StudyTracker

REAL_CLIENT = mlflow.MlflowClient  # taken before any test replaces it


def _as_real(method):
    """The call bound to the real `MlflowClient` method's signature first (a name it has not,
    or one argument too many, is a TypeError as there), then the stand-in's body run with
    the arguments under the real names (a value passed in another's place lands where the
    real client would put it)."""
    real = inspect.signature(getattr(REAL_CLIENT, method.__name__))

    def call(self, *args, **kwargs):
        bound = real.bind(self, *args, **kwargs)
        bound.apply_defaults()
        return method(**bound.arguments)

    call.__name__ = method.__name__
    return call


class RecordingClient:
    """MlflowClient's methods the tracker calls, each call recorded as (name, args, kwargs)."""

    experiments: dict = {}  # name -> SimpleNamespace(experiment_id, tags), set per test

    def __init__(self, uri):
        self.uri = uri
        self.calls: list = []
        self.statuses: dict[str, str] = {}
        self.found_runs: list = []
        self.artifact_bytes: dict[str, bytes] = {}
        self.params: dict[str, dict[str, str]] = {}

    def _rec(self, name, *args, **kwargs):
        self.calls.append((name, args, kwargs))

    def named(self, name):
        return [(a, k) for n, a, k in self.calls if n == name]

    @_as_real
    def get_experiment_by_name(self, name):
        self._rec("get_experiment_by_name", name)
        return self.experiments.get(name)

    @_as_real
    def create_experiment(self, name, artifact_location, tags):
        self._rec("create_experiment", name, artifact_location=artifact_location, tags=tags)
        validation._validate_experiment_name(name)
        for key, value in (tags or {}).items():
            validation._validate_experiment_tag(key, value)
        return "exp-new"

    @_as_real
    def set_experiment_tag(self, experiment_id, key, value):
        self._rec("set_experiment_tag", experiment_id, key, value)
        validation._validate_experiment_tag(key, value)

    @_as_real
    def create_run(self, experiment_id, start_time, tags, run_name):
        self._rec("create_run", experiment_id, run_name=run_name, tags=tags)
        assert start_time is None, f"the tracker leaves start_time to MLflow, got {start_time!r}"
        for key, value in (tags or {}).items():
            validation._validate_tag(key, value)
        run_id = f"run{len(self.named('create_run'))}"
        self.statuses[run_id] = "RUNNING"
        return SimpleNamespace(info=SimpleNamespace(run_id=run_id))

    @_as_real
    def log_batch(self, run_id, metrics, params, tags, synchronous):
        self._rec("log_batch", run_id, metrics=list(metrics), params=list(params))
        assert not tags and synchronous is None
        # what MLflow's store checks: names, lengths, numbers, per-request limits, and a param
        # logged again must keep its value
        validation._validate_batch_log_data(metrics, params, [])
        validation._validate_batch_log_limits(metrics, params, [])
        logged = self.params.setdefault(run_id, {})
        for p in params:
            if logged.setdefault(p.key, p.value) != p.value:
                raise MlflowException(f"Changing param values is not allowed ({p.key})")

    @_as_real
    def log_text(self, run_id, text, artifact_file):
        self._rec("log_text", run_id, text, artifact_file)

    @_as_real
    def log_artifact(self, run_id, local_path, artifact_path):
        self._rec("log_artifact", run_id, local_path, artifact_path=artifact_path)
        self.artifact_bytes[local_path] = Path(local_path).read_bytes()

    @_as_real
    def get_run(self, run_id):
        self._rec("get_run", run_id)
        return SimpleNamespace(info=SimpleNamespace(run_id=run_id, status=self.statuses[run_id]))

    @_as_real
    def update_run(self, run_id, status, name):
        self._rec("update_run", run_id, status=status)
        RunStatus.from_string(status)  # refuses a status MLflow has not
        self.statuses[run_id] = status

    @_as_real
    def set_terminated(self, run_id, status, end_time):
        self._rec("set_terminated", run_id, status)
        RunStatus.from_string(status)
        self.statuses[run_id] = status

    @_as_real
    def set_tag(self, run_id, key, value, synchronous):
        self._rec("set_tag", run_id, key, value)
        validation._validate_tag(key, value)

    @_as_real
    def delete_run(self, run_id):
        self._rec("delete_run", run_id)

    @_as_real
    def search_runs(
        self, experiment_ids, filter_string, run_view_type, max_results, order_by, page_token
    ):
        self._rec(
            "search_runs",
            experiment_ids,
            filter_string=filter_string,
            max_results=max_results,
            order_by=order_by,
        )
        if max_results > SEARCH_MAX_RESULTS_THRESHOLD:
            raise MlflowException(f"max_results {max_results} > {SEARCH_MAX_RESULTS_THRESHOLD}")
        return self.found_runs


def test_the_recording_client_refuses_what_mlflows_client_refuses():
    # each refused by MlflowClient on a sqlite store too (checked side by side with MLflow
    # 3.17): a keyword the method has not, a status MLflow has not, a param's value changed,
    # a name over 250 characters, max_results over 50000. And a run name passed where
    # MlflowClient takes the start time, which the real client takes silently (the run then
    # gets a random name): never what the tracker means
    from mlflow.entities import Metric, Param

    c = RecordingClient("http://h")
    with pytest.raises(TypeError):  # log_text's third argument is artifact_file
        c.log_text("r", "t", name="a.txt")
    with pytest.raises(AssertionError, match="start_time"):  # MlflowClient takes the run's
        c.create_run("1", "trial-1")  # second positional argument as its start time
    with pytest.raises(Exception, match="DONE"):
        c.set_terminated("r", "DONE")
    c.log_batch("r", params=[Param("p", "1")])
    c.log_batch("r", params=[Param("p", "1")])  # the same value again is allowed
    with pytest.raises(MlflowException, match="Changing param values"):
        c.log_batch("r", params=[Param("p", "2")])
    with pytest.raises(MlflowException, match="250"):
        c.log_batch("r", metrics=[Metric("m" * 251, 1.0, 0, 0)])
    with pytest.raises(MlflowException, match="50001"):
        c.search_runs(["1"], max_results=50001)


@pytest.fixture
def tracker(monkeypatch):
    RecordingClient.experiments = {}
    uris = []
    monkeypatch.setattr(mlflow, "MlflowClient", RecordingClient)
    monkeypatch.setattr(mlflow, "set_tracking_uri", uris.append)
    t = StudyTracker("http://tracking:5000", "exp")
    assert uris == ["http://tracking:5000"] and t.client.uri == "http://tracking:5000"
    return t


def test_a_new_experiment_is_created_tagged_for_the_runs_table(tracker):
    # http:// is no sqlite store: the artifact location is the server's default (None)
    assert tracker.experiment_id == "exp-new" and tracker.tracking_uri == "http://tracking:5000"
    kind = {runs.EXPERIMENT_KIND_TAG: "custom_model_development"}
    assert tracker.client.named("create_experiment") == [
        (("exp",), {"artifact_location": None, "tags": kind})
    ]
    assert runs.EXPERIMENT_KIND_TAG == "mlflow.experimentKind"
    assert tracker.parent_run_id is None


def test_an_existing_experiment_is_reused_and_tagged_only_when_untagged(monkeypatch):
    monkeypatch.setattr(mlflow, "MlflowClient", RecordingClient)
    monkeypatch.setattr(mlflow, "set_tracking_uri", lambda uri: None)
    RecordingClient.experiments = {
        "old": SimpleNamespace(experiment_id="7", tags={}),
        "tagged": SimpleNamespace(experiment_id="8", tags={runs.EXPERIMENT_KIND_TAG: "x"}),
    }
    old = StudyTracker("http://h", "old")
    assert old.experiment_id == "7" and old.client.named("create_experiment") == []
    assert old.client.named("set_experiment_tag") == [
        (("7", "mlflow.experimentKind", "custom_model_development"), {})
    ]
    tagged = StudyTracker("http://h", "tagged")
    assert tagged.experiment_id == "8" and tagged.client.named("set_experiment_tag") == []


def test_the_study_run_carries_its_name_tags_params_and_spec(tracker):
    run_id = tracker.start_study("s1", {"model.identity": "abc", "n": 3}, {"a": "b"}, "x = 1")
    assert run_id == "run1" == tracker.parent_run_id
    assert tracker.client.named("create_run") == [
        (("exp-new",), {"run_name": "study-s1", "tags": {"a": "b", "tenantq.kind": "study"}})
    ]
    (args, kw), = tracker.client.named("log_batch")  # fmt: skip
    assert args == ("run1",) and kw["metrics"] == []
    assert [(p.key, p.value) for p in kw["params"]] == [("model.identity", "abc"), ("n", "3")]
    assert tracker.client.named("log_text") == [(("run1", "x = 1", "spec.toml"), {})]


def test_params_are_cut_to_mlflows_limit_and_sent_a_hundred_at_a_time(tracker):
    # MLflow keeps at most 6000 characters of a param value, and its server 100 params a
    # request (MLflow 3's client would cut and split too; the tracker does it itself)
    params = {f"p{i:03d}": i for i in range(201)}
    params["long"] = "x" * 7000
    tracker.start_study("s", params, {}, "")
    batches = [kw["params"] for _, kw in tracker.client.named("log_batch")]
    assert [len(b) for b in batches] == [100, 100, 2]
    flat = [p for b in batches for p in b]
    assert [p.key for p in flat] == list(params)
    assert flat[-1].value == "x" * 6000 and runs.MAX_PARAM_CHARS == 6000
    assert flat[0].value == "0" and flat[200].value == "200"


def test_metrics_keep_finite_numbers_only_and_go_a_thousand_at_a_time(tracker):
    # bools, strings, NaN and infinities are not metrics; ints become floats; every metric of
    # one call has the same timestamp (ms since the epoch, taken during the call) and step 0
    tracker.start_study("s", {}, {}, "")
    metrics = {f"m{i}": float(i) for i in range(2001)}
    metrics.update({"flag": True, "word": "ok", "nan": float("nan"), "inf": float("inf"),
                    "ninf": float("-inf"), "int": 7, "zero": 0})  # fmt: skip
    before = int(time.time() * 1000)
    tracker.log_metrics("run1", metrics)
    after = int(time.time() * 1000)
    sent = [(a, kw) for a, kw in tracker.client.named("log_batch") if kw["metrics"]]
    assert {a for a, _ in sent} == {("run1",)}  # to the run named
    batches = [kw["metrics"] for _, kw in sent]
    assert [len(b) for b in batches] == [1000, 1000, 3]
    flat = [m for b in batches for m in b]
    assert [m.key for m in flat] == [*(f"m{i}" for i in range(2001)), "int", "zero"]
    assert [m.value for m in flat[-3:]] == [2000.0, 7.0, 0.0]
    assert isinstance(flat[-2].value, float)
    assert {m.step for m in flat} == {0}
    stamps = {m.timestamp for m in flat}
    assert len(stamps) == 1 and before <= stamps.pop() <= after


def test_a_trial_run_is_nested_named_tagged_and_finished(tracker):
    tracker.start_study("s", {}, {}, "")
    run_id = tracker.log_trial(
        4, params={"kv.key_format": "int8"}, metrics={"kl": 0.5}, tags={"tenantq.shippable": "1"}
    )
    assert run_id == "run2"
    assert tracker.client.named("create_run")[1] == (
        ("exp-new",),
        {"run_name": "trial-4", "tags": {"mlflow.parentRunId": "run1", "tenantq.kind": "trial",
                                         "tenantq.trial": "4", "tenantq.shippable": "1"}},
    )  # fmt: skip
    logged = [kw for a, kw in tracker.client.named("log_batch") if a == ("run2",)]
    assert [(p.key, p.value) for kw in logged for p in kw["params"]] == [("kv.key_format", "int8")]
    assert [(m.key, m.value) for kw in logged for m in kw["metrics"]] == [("kl", 0.5)]
    assert tracker.client.named("set_terminated") == [(("run2", "FINISHED"), {})]
    assert tracker.client.named("set_tag") == []
    assert [a for a, _ in tracker.client.named("log_text")] == [("run1", "", "spec.toml")]


def test_a_trial_tag_overrides_the_defaults_and_no_tags_is_allowed(tracker):
    tracker.start_study("s", {}, {}, "")
    tracker.log_trial(1, params={}, metrics={}, tags={"tenantq.kind": "retry"})
    tracker.log_trial(2, params={}, metrics={})
    tags = [kw["tags"] for _, kw in tracker.client.named("create_run")[1:]]
    assert tags[0]["tenantq.kind"] == "retry"
    assert tags[1] == {"mlflow.parentRunId": "run1", "tenantq.kind": "trial", "tenantq.trial": "2"}


def test_a_failed_trial_keeps_its_error_as_a_tag_and_in_full_as_a_file(tracker):
    # the tag keeps the error's first 5000 characters (MLflow 3 keeps at most 8000 of a tag
    # value, cutting longer ones itself): the whole error goes to error.txt
    tracker.start_study("s", {}, {}, "")
    error = "E" * 4999 + "xyz"
    run_id = tracker.log_trial(0, params={}, metrics={}, error=error)
    assert tracker.client.named("set_tag") == [((run_id, "tenantq.error", error[:5000]), {})]
    assert len(error[:5000]) == 5000
    assert tracker.client.named("log_text")[-1] == ((run_id, error, "error.txt"), {})
    assert tracker.client.named("set_terminated") == [((run_id, "FAILED"), {})]
    empty = tracker.log_trial(1, params={}, metrics={}, error="")  # an empty error still failed
    assert tracker.client.named("set_terminated")[-1] == ((empty, "FAILED"), {})
    assert tracker.client.named("set_tag")[-1] == ((empty, "tenantq.error", ""), {})


def test_a_trial_before_its_study_is_refused(tracker):
    with pytest.raises(AssertionError, match=r"^start_study or resume_study first$"):
        tracker.log_trial(0, params={}, metrics={})
    assert tracker.client.named("create_run") == []


def test_artifacts_are_written_by_their_type(tracker):
    # str as text, dict/list as indented JSON, bytes as they are, a pyarrow Table as Parquet
    tracker.start_study("s", {}, {}, "")
    table = pa.table({"example": [0, 1], "kl": [0.1, 0.2]})
    run_id = tracker.log_trial(
        0,
        params={},
        metrics={},
        artifacts={"plan.json": "{}", "memory.json": {"a": [1, 2]}, "rows.json": [{"b": 1}],
                   "raw.bin": b"\x00\x01", "examples.parquet": table},
    )  # fmt: skip
    texts = {a[2]: a[1] for a, _ in tracker.client.named("log_text") if a[0] == run_id}
    assert texts["plan.json"] == "{}"
    assert texts["memory.json"] == json.dumps({"a": [1, 2]}, indent=2)
    assert texts["rows.json"] == '[\n  {\n    "b": 1\n  }\n]'
    files = {a[1].rsplit("/", 1)[1]: a[1] for a, _ in tracker.client.named("log_artifact")}
    assert sorted(files) == ["examples.parquet", "raw.bin"]
    assert all(a[0] == run_id and kw == {"artifact_path": None}
               for a, kw in tracker.client.named("log_artifact"))  # fmt: skip
    assert tracker.client.artifact_bytes[files["raw.bin"]] == b"\x00\x01"
    parquet = tracker.client.artifact_bytes[files["examples.parquet"]]
    assert pq.read_table(pa.BufferReader(parquet)).equals(table)


def test_a_json_artifact_writes_what_json_cannot_encode_as_text(tracker):
    tracker.start_study("s", {}, {}, "")
    tracker.log_artifact("run1", "odd.json", {"when": time.gmtime(0).tm_year, "p": pytest})
    (args, _), = [c for c in tracker.client.named("log_text") if c[0][2] == "odd.json"]  # fmt: skip
    assert json.loads(args[1]) == {"when": 1970, "p": str(pytest)}


def test_log_files_upload_each_file_under_the_given_folder(tracker, tmp_path):
    paths = [tmp_path / "a.txt", tmp_path / "b.txt"]
    for p in paths:
        p.write_text(p.name)
    tracker.log_files("r9", paths, "logs")
    assert tracker.client.named("log_artifact") == [
        (("r9", str(paths[0])), {"artifact_path": "logs"}),
        (("r9", str(paths[1])), {"artifact_path": "logs"}),
    ]


def test_the_study_ends_with_its_metrics_and_status(tracker):
    with pytest.raises(AssertionError):
        tracker.end_study()
    tracker.start_study("s", {}, {}, "")
    tracker.end_study()
    assert tracker.client.named("set_terminated") == [(("run1", "FINISHED"), {})]
    assert tracker.client.named("log_batch") == []  # no params, no metrics: nothing sent
    tracker.end_study("KILLED", {"study.complete": 0})
    assert tracker.client.named("set_terminated")[-1] == (("run1", "KILLED"), {})
    args, kw = tracker.client.named("log_batch")[-1]
    assert args == ("run1",)  # the study's metrics go on the parent run
    (metric,) = kw["metrics"]
    assert (metric.key, metric.value) == ("study.complete", 0.0)


def test_a_resumed_study_reopens_its_parent_run(tracker):
    tracker.client.statuses = {"p": "FINISHED", "q": "RUNNING"}
    tracker.resume_study("p")
    assert tracker.parent_run_id == "p"
    assert tracker.client.named("update_run") == [(("p",), {"status": "RUNNING"})]
    tracker.resume_study("q")  # already running: left as it is
    assert tracker.parent_run_id == "q" and len(tracker.client.named("update_run")) == 1


def _found(trial, run_id, status="FINISHED"):
    return SimpleNamespace(
        info=SimpleNamespace(run_id=run_id, status=status),
        data=SimpleNamespace(tags={"tenantq.trial": str(trial)}),
    )


def test_trial_runs_are_searched_under_the_parent_oldest_first(tracker):
    with pytest.raises(AssertionError):
        tracker.trial_runs()
    tracker.start_study("s", {}, {}, "")
    tracker.client.found_runs = [_found(0, "a", "FAILED"), _found(1, "b"), _found(0, "c")]
    # oldest first, so a later run of the same trial (a retry) is the one kept
    assert tracker.trial_runs() == {0: "c", 1: "b"}
    assert tracker.client.named("search_runs")[-1] == (
        (["exp-new"],),
        {"filter_string": "tags.`mlflow.parentRunId` = 'run1'", "max_results": 50000,
         "order_by": ["attributes.start_time ASC"]},
    )  # fmt: skip
    assert tracker.trial_runs(with_status=True) == {
        0: [("a", "FAILED"), ("c", "FINISHED")],
        1: [("b", "FINISHED")],
    }


def test_tag_and_delete_go_to_the_named_run(tracker):
    tracker.tag("r1", "k", "v")
    tracker.delete_run("r2")
    tracker.log_artifact("r3", "t.txt", "text")
    assert tracker.client.named("set_tag") == [(("r1", "k", "v"), {})]
    assert tracker.client.named("delete_run") == [(("r2",), {})]
    assert tracker.client.named("log_text") == [(("r3", "text", "t.txt"), {})]


def test_a_new_experiment_on_a_sqlite_store_keeps_its_artifacts_beside_it(monkeypatch, tmp_path):
    # (test_tracking.py checks the same on a real store; here the call itself)
    monkeypatch.setattr(mlflow, "MlflowClient", RecordingClient)
    monkeypatch.setattr(mlflow, "set_tracking_uri", lambda uri: None)
    RecordingClient.experiments = {}
    t = StudyTracker(f"sqlite:///{tmp_path}/m.db", "beside")
    ((name,), kw) = t.client.named("create_experiment")[0]
    assert name == "beside"
    assert kw["artifact_location"].startswith((tmp_path / "mlruns").as_uri() + "/")
