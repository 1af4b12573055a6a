"""A study read back from a real MLflow store (sqlite in tmp_path), laid out as the tracking
package writes it: which parent run is the study, which runs are its trials, in which order,
and what each trial's artifacts hold."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mlflow import MlflowClient

from tenantq.report.study import load_study

# Creating an MLflow sqlite store runs its migrations: ~7 s of CPU for the module.
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


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{tmp}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("quickstart", artifact_location=(tmp / "a1").as_uri())
    client.create_experiment("other", artifact_location=(tmp / "a2").as_uri())
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
    client.set_terminated(two, status="FAILED")
    (tmp / "budget.json").write_text(json.dumps({"tenants": 40}))
    pq.write_table(pa.table({"correct": [True, False]}), tmp / "examples.parquet")
    client.log_artifact(two, str(tmp / "budget.json"))
    client.log_artifact(two, str(tmp / "examples.parquet"))
    (tmp / "spec.toml").write_text('[study]\nname = "new"\n')
    client.log_artifact(new, str(tmp / "spec.toml"))
    return uri, new


def test_the_latest_study_run_is_read_with_its_trials_in_order(store) -> None:
    uri, parent = store
    study = load_study(uri, "quickstart")
    assert (study.name, study.parent_run_id, study.experiment) == ("new", parent, "quickstart")
    assert study.tracking_uri == uri
    assert study.params["objectives"] == "maximize tenants,minimize kl"
    assert study.metrics == {"study.trials": 3.0}
    assert [t.number for t in study.trials] == [1, 2]  # trials only, by number
    one, two = study.trials
    assert one.status == "FINISHED" and two.status == "FAILED" and two.failed
    assert two.params == {"kv.key_format": "int4"} and one.metrics["kl"] == 0.1
    assert two.tags["tenantq.kind"] == "trial" and two.logged_ms > 0
    assert study.spec_text == '[study]\nname = "new"\n'


def test_a_named_study_and_the_artifacts_of_a_trial(store) -> None:
    uri, _ = store
    old = load_study(uri, "quickstart", "old")
    assert old.name == "old" and [t.number for t in old.trials] == [0]
    assert old.spec_text == ""  # an older study without its spec artifact
    two = load_study(uri, "quickstart").trials[1]
    assert two.artifact_names() == {"budget.json", "examples.parquet"}
    assert two.artifact_json("budget.json") == {"tenants": 40}
    assert two.artifact_json("budget.json") == {"tenants": 40}  # the second read is cached
    assert two.artifact_table("examples.parquet").column("correct").to_pylist() == [True, False]
    assert two.artifact_json("missing.json") is None
    assert two.artifact_table("missing.parquet") is None


def test_a_missing_study_names_the_studies_there(store) -> None:
    uri, _ = store
    with pytest.raises(ValueError, match=r"^experiment 'quickstart' has no study 'nope'; "
                                         r"studies there: new, old$"):  # fmt: skip
        load_study(uri, "quickstart", "nope")
    with pytest.raises(
        ValueError,
        match=r"^no experiment 'qs' in sqlite:///.*; experiments there: Default, other, "
        r"quickstart$",
    ):
        load_study(uri, "qs")
