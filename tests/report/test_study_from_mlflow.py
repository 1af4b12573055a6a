"""A study read back from a real MLflow store (sqlite), laid out as the tracking package writes
it: which parent run is the study, which runs are its trials, in which order, what each trial's
artifacts hold, and the one-line errors for a store, experiment or study that is not there.

The store is built once per process (`_store`: an MLflow sqlite store runs its migrations,
~7 s of CPU) and only read by the tests, each of which calls `load_study` itself. Under mutmut
(imported in its forkserver before the tests are collected) it is built at import, by a child
process, so every mutant's forked run reads it in well under a second instead of building
its own.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mlflow import MlflowClient

from tenantq.report.study import load_study

# Building the store runs MLflow's migrations: ~7 s of CPU for the module.
pytestmark = pytest.mark.slow


def _run(client, exp, *, kind, parent=None, tags=None, params=None, metrics=None, name=None):
    t = {"tenantq.kind": kind} | (tags or {})
    if parent is not None:
        t["mlflow.parentRunId"] = parent
    run = client.create_run(exp, tags=t, run_name=name)
    for k, v in (params or {}).items():
        client.log_param(run.info.run_id, k, v)
    for k, v in (metrics or {}).items():
        client.log_metric(run.info.run_id, k, v)
    return run.info.run_id


def _build(tmp: Path) -> tuple[str, str, str]:
    """Write the store into `tmp`: (uri, the latest study's parent run id, the unnamed
    study's parent run id)."""
    uri = f"sqlite:///{tmp}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("quickstart", artifact_location=(tmp / "a1").as_uri())
    other = client.create_experiment("other", artifact_location=(tmp / "a2").as_uri())
    unnamed_exp = client.create_experiment("unnamed", artifact_location=(tmp / "a3").as_uri())
    old = _run(client, exp, kind="study", params={"study.name": "old"})
    _run(client, exp, kind="trial", parent=old, tags={"tenantq.trial": "0"})
    new = _run(client, exp, kind="study", name="run-name",
               params={"study.name": "new", "objectives": "maximize tenants,minimize kl"},
               metrics={"study.trials": 3.0})  # fmt: skip
    two = _run(client, exp, kind="trial", parent=new, tags={"tenantq.trial": "2"},
               params={"kv.key_format": "int4"}, metrics={"capacity.tenants": 40.0})  # fmt: skip
    one = _run(client, exp, kind="trial", parent=new, tags={"tenantq.trial": "1"},
               metrics={"capacity.tenants": 30.0, "kl": 0.1})  # fmt: skip
    client.set_terminated(one)
    _run(client, exp, kind="fidelity-probe", parent=new, tags={"tenantq.trial": "7"})
    # closed unrun when the budget filled: measured nothing, so it is no trial of the report
    _run(client, exp, kind="trial", parent=new,
         tags={"tenantq.trial": "3", "tenantq.failure_reason": "not_run"})  # fmt: skip
    client.set_terminated(two, status="FAILED")
    (tmp / "budget.json").write_text(json.dumps({"tenants": 40}))
    pq.write_table(pa.table({"correct": [True, False]}), tmp / "examples.parquet")
    client.log_artifact(two, str(tmp / "budget.json"))
    client.log_artifact(two, str(tmp / "examples.parquet"))
    (tmp / "spec.toml").write_text('[study]\nname = "new"\n')
    client.log_artifact(new, str(tmp / "spec.toml"))
    # a study run without its `study.name` param (and no trials), and a trial run of a
    # study in another experiment (trials are found by their parent, not by experiment)
    unnamed = _run(client, unnamed_exp, kind="study", name="run-x",
                   params={"objectives": "maximize tenants_at_slo"})  # fmt: skip
    _run(client, other, kind="trial", parent=unnamed, tags={"tenantq.trial": "0"})
    (tmp / "ids.json").write_text(json.dumps([uri, new, unnamed]))
    return uri, new, unnamed


def _new_folder() -> Path:
    tmp = Path(tempfile.mkdtemp(prefix="tenantq-report-store-"))
    owner = os.getpid()  # forked test processes must not remove the store they share
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(tmp, ignore_errors=True))
    return tmp


@functools.cache
def _store() -> tuple[str, str, str]:
    return _build(_new_folder())


if "mutmut" in sys.modules and __name__ != "__main__":
    # In mutmut's forkserver (see the docstring): the store is written by a child process,
    # so that no MLflow client, engine or thread lives in the process every mutant forks
    # from; the modules a read needs are imported here once.
    import mlflow.store.tracking.sqlalchemy_store  # noqa: F401

    _folder = _new_folder()
    subprocess.run([sys.executable, __file__, str(_folder)], check=True, capture_output=True)
    _ids = tuple(json.loads((_folder / "ids.json").read_text()))
    _store = functools.cache(lambda: _ids)  # noqa: F811

if __name__ == "__main__":
    _build(Path(sys.argv[1]))


def test_the_latest_study_run_is_read_with_its_trials_in_order() -> None:
    uri, parent, _ = _store()
    study = load_study(uri, "quickstart")
    assert (study.name, study.parent_run_id, study.experiment) == ("new", parent, "quickstart")
    assert study.tracking_uri == uri
    assert study.params["objectives"] == "maximize tenants,minimize kl"
    assert study.metrics == {"study.trials": 3.0}
    # trials only (not the probe), by number, without the one closed unrun
    assert [t.number for t in study.trials] == [1, 2]
    one, two = study.trials
    assert one.status == "FINISHED" and two.status == "FAILED" and two.failed
    assert one.run_id != two.run_id and two.run_id != parent
    assert two.params == {"kv.key_format": "int4"} and one.metrics["kl"] == 0.1
    assert two.tags["tenantq.kind"] == "trial" and two.logged_ms > 0
    assert one.client is study.client and study.client is not None
    assert study.spec_text == '[study]\nname = "new"\n'


def test_a_study_without_its_name_param_is_named_by_its_run_and_has_no_trials() -> None:
    uri, _, unnamed = _store()
    study = load_study(uri, "unnamed")
    assert (study.name, study.parent_run_id) == ("run-x", unnamed)
    assert study.trials == []
    # its capacity objective is the SLO's: every trial would read that metric
    assert study.capacity_key == "capacity.tenants_at_slo"


def test_a_named_study_and_the_artifacts_of_a_trial() -> None:
    uri, _, _ = _store()
    old = load_study(uri, "quickstart", "old")
    assert old.name == "old" and [t.number for t in old.trials] == [0]
    assert old.spec_text == ""  # an older study without its spec artifact
    assert load_study(uri, "quickstart", "new").name == "new"
    two = load_study(uri, "quickstart").trials[1]
    assert two.artifact_names() == {"budget.json", "examples.parquet"}
    assert two.artifact_json("budget.json") == {"tenants": 40}
    assert set(two._downloaded) == {"budget.json"}  # read once, then kept
    assert two.artifact_json("budget.json") == {"tenants": 40}
    assert two.artifact_table("examples.parquet").column("correct").to_pylist() == [True, False]
    assert two.artifact_json("missing.json") is None
    assert two.artifact_table("missing.parquet") is None
    assert set(two._downloaded) == {"budget.json", "examples.parquet"}


def test_a_missing_study_names_the_studies_there() -> None:
    uri, _, _ = _store()
    with pytest.raises(ValueError, match=r"^experiment 'quickstart' has no study 'nope'; "
                                         r"studies there: new, old$"):  # fmt: skip
        load_study(uri, "quickstart", "nope")
    with pytest.raises(
        ValueError,
        match=r"^no experiment 'qs' in sqlite:///.*; experiments there: Default, other, "
        r"quickstart, unnamed$",
    ):
        load_study(uri, "qs")
    # a study run without its `study.name` param is listed as `?`
    with pytest.raises(ValueError) as err:
        load_study(uri, "unnamed", "nope")
    assert str(err.value) == "experiment 'unnamed' has no study 'nope'; studies there: ?"


def test_an_experiment_without_a_study_run_says_which_tag_it_looked_for() -> None:
    uri, _, _ = _store()
    message = (
        "experiment 'other' has no study run (tags.tenantq.kind = 'study'); studies there: none"
    )
    with pytest.raises(ValueError) as err:
        load_study(uri, "other")
    assert str(err.value) == message


def test_a_sqlite_store_that_does_not_exist_is_named_and_not_created(tmp_path) -> None:
    uri = f"sqlite:///{tmp_path}/nope.db"
    with pytest.raises(ValueError) as err:
        load_study(uri, "quickstart")
    assert str(err.value) == (
        f"--tracking-uri: no MLflow store at {uri} ({tmp_path}/nope.db does not exist); give "
        "the tracking.uri the study ran with (default sqlite:///mlflow.db, in the folder the "
        "study ran in)"
    )
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match=r"^--tracking-uri: MLflow cannot track to 'ftp://h/x'"):
        load_study("ftp://h/x", "quickstart")


def test_reading_an_artifact_leaves_no_download_behind(tmp_path, monkeypatch) -> None:
    # MLflow downloads into a fresh temporary folder of its own unless given one; the report
    # reads each artifact through a folder it removes, so a long-lived UI leaks nothing.
    uri, _, _ = _store()
    two = load_study(uri, "quickstart").trials[1]
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    assert two.artifact_json("budget.json") == {"tenants": 40}
    assert list(scratch.iterdir()) == []


class _Opened(Exception):
    """Raised by the stand-in client: load_study got as far as opening the store."""


def test_an_in_memory_sqlite_store_is_opened_not_refused_as_a_missing_file(monkeypatch) -> None:
    import mlflow

    opened: list[str] = []

    def client(uri: str):
        opened.append(uri)
        raise _Opened

    monkeypatch.setattr(mlflow, "MlflowClient", client)
    with pytest.raises(_Opened):
        load_study("sqlite:///:memory:", "quickstart")
    assert opened == ["sqlite:///:memory:"]


def test_a_store_with_no_experiment_left_says_none(monkeypatch) -> None:
    # Every store starts with `Default`, but it can be deleted: the list is then empty.
    import mlflow

    class Empty:
        def __init__(self, uri: str) -> None:
            self.uri = uri

        def get_experiment_by_name(self, name: str):
            return None

        def search_experiments(self):
            return []

    monkeypatch.setattr(mlflow, "MlflowClient", Empty)
    with pytest.raises(ValueError) as err:
        load_study("http://127.0.0.1:1", "qs")
    assert str(err.value) == "no experiment 'qs' in http://127.0.0.1:1; experiments there: none"


def test_a_study_of_more_trials_than_mlflows_default_page_is_read_whole(monkeypatch) -> None:
    # MLflow's `search_runs` returns 1,000 runs unless asked for more; a study of 1,501
    # trials must come back whole. The stand-in keeps that contract without writing 1,500
    # runs to a store.
    import types

    import mlflow

    def run(run_id: str, tags: dict, params: dict | None = None):
        info = types.SimpleNamespace(run_id=run_id, status="FINISHED", start_time=1, run_name="")
        data = types.SimpleNamespace(tags=tags, params=params or {}, metrics={})
        return types.SimpleNamespace(info=info, data=data)

    parent = run("p", {"tenantq.kind": "study"}, {"study.name": "big"})
    trials = [
        run(f"t{n}", {"tenantq.kind": "trial", "tenantq.trial": str(n), "mlflow.parentRunId": "p"})
        for n in range(1500)
    ]
    # a trial run without its number tag (written by hand, or half-written) sorts first as -1
    trials.append(run("t-", {"tenantq.kind": "trial", "mlflow.parentRunId": "p"}))

    class Paged:
        def __init__(self, uri: str) -> None:
            pass

        def get_experiment_by_name(self, name: str):
            return types.SimpleNamespace(experiment_id="1")

        def search_runs(self, ids, filter_string="", order_by=None, max_results=1000):
            found = [parent] if "'study'" in filter_string else trials
            return found[:max_results]

    monkeypatch.setattr(mlflow, "MlflowClient", Paged)
    study = load_study("http://127.0.0.1:1", "big")
    assert len(study.trials) == 1501 and study.trials[-1].number == 1499
    assert (study.trials[0].number, study.trials[0].run_id) == (-1, "t-")


def _stand_in_run(run_id: str, tags: dict, start_time=1, params=None, run_name=""):
    import types

    info = types.SimpleNamespace(
        run_id=run_id, status="FINISHED", start_time=start_time, run_name=run_name
    )
    data = types.SimpleNamespace(tags=tags, params=params or {}, metrics={})
    return types.SimpleNamespace(info=info, data=data)


def _stand_in_store(monkeypatch, parent, trials) -> None:
    """MLflow's client replaced by one holding `parent` (the study run) and `trials`."""
    import types

    import mlflow

    class Stored:
        def __init__(self, uri: str) -> None:
            pass

        def get_experiment_by_name(self, name: str):
            return types.SimpleNamespace(experiment_id="1")

        def search_runs(self, ids, filter_string="", order_by=None, max_results=1000):
            return [parent] if "'study'" in filter_string else trials

    monkeypatch.setattr(mlflow, "MlflowClient", Stored)


def test_a_trial_run_without_a_start_time_is_left_off_the_timeline(monkeypatch) -> None:
    # The timeline places each trial at `logged_ms` (the run's start time). A run whose store
    # gave no start time (MLflow's RunInfo allows None) has no time: placed at the epoch
    # (0 ms) it would stretch the axis over 56 years and squash every other bar into a line.
    from tenantq.report.figures import timeline_figure

    trial = {"tenantq.kind": "trial", "mlflow.parentRunId": "p"}
    trials = [
        _stand_in_run("t0", trial | {"tenantq.trial": "0"}, start_time=None),
        _stand_in_run("t1", trial | {"tenantq.trial": "1"}, start_time=1_700_000_000_123),
        _stand_in_run("t2", trial | {"tenantq.trial": "2"}, start_time=1_700_000_060_123),
    ]
    parent = _stand_in_run("p", {"tenantq.kind": "study"}, params={"study.name": "s"})
    _stand_in_store(monkeypatch, parent, trials)
    study = load_study("http://127.0.0.1:1", "e")
    assert [t.logged_ms for t in study.trials] == [None, 1_700_000_000_123, 1_700_000_060_123]
    fig = timeline_figure(study)
    labels = [label for bar in fig.data for label in bar.text]
    starts = [start for bar in fig.data for start in bar.base]
    assert sorted(labels) == ["1", "2"]  # trial 0 is not drawn
    assert min(starts) == 0 and max(starts) == 60.0  # seconds since the first timed trial


def test_a_study_run_with_neither_a_name_param_nor_a_run_name_is_named_by_its_run_id(
    monkeypatch,
) -> None:
    # The name falls back to the run's name, and to its run id when MLflow has neither: a
    # report titled "tenantq study " would name nothing the reader can look up.
    parent = _stand_in_run("p", {"tenantq.kind": "study"}, run_name=None)
    _stand_in_store(monkeypatch, parent, [])
    study = load_study("http://127.0.0.1:1", "e")
    assert (study.name, study.parent_run_id, study.trials) == ("p", "p", [])
