"""MLflow tracking: flattened plan params share keys across plans; runs nest under the study.

Real MLflow on a sqlite store in a tmp dir (MLflow 3's default backend).
"""

from __future__ import annotations

import pyarrow as pa
import pytest
from mlflow import MlflowClient

from tenantq.capacity import get_model_config
from tenantq.quant.plan import KVPlan, QuantPlan, Rule
from tenantq.tracking import StudyTracker, flatten_plan

CONFIG = get_model_config("tenantq-ref")


def test_flattened_params_have_the_same_keys_for_any_plan() -> None:
    plans = [
        QuantPlan(),
        QuantPlan.uniform("int4", "fp8_e4m3", group_size=64),
        QuantPlan(
            rules=(Rule("layers/0/.*", "bf16"), Rule(r"layers/\d+/mlp/down_proj", "int8")),
            kv=KVPlan(key_format="int4", sink_tokens=4, bf16_layers=(0, -1)),
        ),
    ]
    flat = [flatten_plan(p, CONFIG) for p in plans]
    assert len({frozenset(f) for f in flat}) == 1
    assert flat[0]["weights.mlp_down"] == "bf16" and flat[0]["kv.bf16_layers"] == "none"
    assert flat[1]["weights.attn_qkv"] == "int4/g64" and flat[1]["kv.value_format"] == "fp8_e4m3"
    # 4 layers, layer 0 kept bf16 by the first rule: 3 int8 down projections and one bf16.
    assert flat[2]["weights.mlp_down"] == "bf16 x1, int8 x3"
    assert flat[2]["kv.bf16_layers"] == "0,-1" and flat[2]["kv.sink_tokens"] == "4"
    assert flat[2]["plan.fingerprint"] == plans[2].fingerprint()


def test_algorithm_and_w8a8_show_in_the_flattened_params() -> None:
    # Same formats, different algorithm or activations: the MLflow params must differ.
    rtn = QuantPlan(rules=(Rule(r"layers/\d+/mlp/.*", "int8"),))
    gptq = QuantPlan(rules=(Rule(r"layers/\d+/mlp/.*", "int8", algorithm="gptq"),))
    w8a8 = QuantPlan(rules=(Rule(r"layers/\d+/mlp/.*", "int8", activations="int8"),))
    static = QuantPlan(
        rules=(Rule(r"layers/\d+/mlp/.*", "int8", activations="int8", activation_scale="static"),)
    )
    labels = [flatten_plan(p, CONFIG)["weights.mlp_down"] for p in (rtn, gptq, w8a8, static)]
    assert labels == ["int8", "int8+gptq", "int8+W8A8 int8", "int8+W8A8 int8, static"]


@pytest.mark.slow
def test_study_and_trial_runs(tmp_path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = StudyTracker(uri, "exp")
    parent = tracker.start_study(
        "s", {"model.identity": "abc"}, {"tenantq.code_version": "x"}, "a=1"
    )
    table = pa.table({"example": [0, 1], "kl": [0.1, 0.2]})
    ok = tracker.log_trial(
        0,
        params={"kv.key_format": "int8"},
        metrics={"fidelity.kl_mean": 0.15, "capacity.tenants": 7, "nan": float("nan")},
        tags={"tenantq.shippable": "true"},
        artifacts={"plan.json": "{}", "examples.parquet": table, "memory.json": {"a": 1}},
    )
    bad = tracker.log_trial(1, params={"kv.key_format": "int4"}, metrics={}, error="boom: it broke")
    assert tracker.trial_runs() == {0: ok, 1: bad}
    tracker.end_study("FINISHED", {"study.complete": 1})
    client = MlflowClient(uri)
    run = client.get_run(ok)
    assert run.data.tags["mlflow.parentRunId"] == parent and run.info.status == "FINISHED"
    assert run.data.metrics == {"fidelity.kl_mean": 0.15, "capacity.tenants": 7.0}  # NaN dropped
    assert {a.path for a in client.list_artifacts(ok)} == {
        "plan.json",
        "examples.parquet",
        "memory.json",
    }
    failed = client.get_run(bad)
    assert failed.info.status == "FAILED" and failed.data.tags["tenantq.error"] == "boom: it broke"
    assert client.get_run(parent).info.status == "FINISHED"
    # A resumed study reopens the same parent run.
    again = StudyTracker(uri, "exp")
    again.resume_study(parent)
    assert client.get_run(parent).info.status == "RUNNING" and again.trial_runs() == {0: ok, 1: bad}
    # MLflow 3.17's UI opens an experiment without mlflow.experimentKind on the GenAI traces
    # overview; ours is tagged for the runs table, and an experiment made before is tagged
    # when a study opens it.
    exp = client.get_experiment_by_name("exp")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    old = client.create_experiment("untagged", artifact_location=(tmp_path / "art").as_uri())
    StudyTracker(uri, "untagged")
    assert client.get_experiment(old).tags["mlflow.experimentKind"] == "custom_model_development"


def test_a_sqlite_store_keeps_its_artifacts_beside_the_database(tmp_path, monkeypatch) -> None:
    # MLflow's default artifact root is ./mlruns of whatever folder the process runs in: one
    # database would scatter its artifacts over every folder a study was started from.
    (tmp_path / "db").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    tracker = StudyTracker(f"sqlite:///{tmp_path / 'db' / 'mlflow.db'}", "beside")
    location = tracker.client.get_experiment(tracker.experiment_id).artifact_location
    assert location.startswith((tmp_path / "db" / "mlruns").as_uri() + "/")
    assert not any((tmp_path / "elsewhere").iterdir())
