"""A study on the shared stores a cluster uses: Optuna on PostgreSQL, an MLflow tracking server.

One PostgreSQL (Debian's, started by tests/cluster/_servers.py on 127.0.0.1) and one `mlflow
server` (its runs in that PostgreSQL, artifacts proxied from a local folder) per module. The
study's driver is killed with SIGKILL after its first of two trials, resumed with `--resume`, and
completes; the report is drawn from the server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from _cluster import free_port
from _servers import mlflow_server, postgres

from tenantq.testing import TINY_SUITE, tiny_study_spec

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

TRIALS = 2  # one logged before the kill, one left for the resumed driver
LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1"}


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("stores")
    with postgres(free_port()) as pg:
        optuna_url = pg.create_database("optuna")
        mlflow_db = pg.create_database("mlflow")
        (root / "artifacts").mkdir()
        with mlflow_server(mlflow_db, root / "artifacts", free_port()) as server:
            yield pg, optuna_url, server


def _search(cwd: Path, *flags: str, gate: Path | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "TENANTQ_"))}
    env["JAX_PLATFORMS"] = "cpu"
    if gate is not None:  # trials wait for a ticket in `gate` (tenantq.workers.faults)
        env.update(TENANTQ_WORKER_CLASS="GatedTrials", TENANTQ_TRIAL_GATE=str(gate))
    return subprocess.Popen(
        [sys.executable, "-m", "tenantq", "search", "spec.toml", "--no-progress"]
        + ["--out", str(cwd / "out"), *flags],
        cwd=cwd,
        env=env,
        stdout=(cwd / f"search{len(list(cwd.glob('search*.log')))}.log").open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own group: what Ray it started goes with it
    )


def _end_group(process: subprocess.Popen) -> None:
    with __import__("contextlib").suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def test_study_on_postgres_and_mlflow_server_survives_a_killed_driver(stores, tmp_path) -> None:
    import optuna
    from mlflow import MlflowClient

    pg, optuna_url, server = stores
    spec = tiny_study_spec(
        tmp_path,
        name="shared",
        trials=TRIALS,
        suite="tiny_suite.toml",
        sampler="random",
        seed=0,
        workers=1,
        key_formats=("bf16", "fp8_e4m3"),
        bf16_first_layers=(0,),
    )
    spec = spec.replace(f"sqlite:///{tmp_path}/optuna.db", optuna_url)
    spec = spec.replace(f"sqlite:///{tmp_path}/mlflow.db", server.url)
    assert optuna_url in spec and server.url in spec
    (tmp_path / "spec.toml").write_text(spec)
    (tmp_path / "tiny_suite.toml").write_text(TINY_SUITE)

    client = MlflowClient(server.url)
    gate = tmp_path / "gate"
    gate.mkdir()
    (gate / "ticket-0").write_text("")  # one trial through; the second waits for the kill
    first = _search(tmp_path, gate=gate)
    S = optuna.trial.TrialState
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.5)
            experiment = client.get_experiment_by_name("shared")
            if experiment is None:  # not created yet
                continue
            logged = client.search_runs(
                [experiment.experiment_id],
                filter_string="tags.`tenantq.kind` = 'trial' and attributes.status = 'FINISHED'",
            )
            if not logged:
                continue
            held = optuna.load_study(study_name="shared", storage=optuna_url).trials
            if any(t.state == S.RUNNING for t in held):  # one logged, the next at the gate
                break
        else:  # no kill at an unknown point: say which of the two never happened
            assert first.poll() is None, (tmp_path / "search0.log").read_text()[-3000:]
            pytest.fail("300 s without a logged trial and the next one held at the gate")
        os.kill(first.pid, signal.SIGKILL)  # the driver dies mid-study
        first.wait(timeout=30)
    finally:
        _end_group(first)
    before = optuna.load_study(study_name="shared", storage=optuna_url).trials
    assert sum(t.state == S.COMPLETE for t in before) == 1  # killed with one held at the gate
    assert list(gate.iterdir()) == []  # the ticket was taken by the trial that completed

    second = _search(tmp_path, "--resume")
    try:
        assert second.wait(timeout=400) == 0, (tmp_path / "search1.log").read_text()[-3000:]
    finally:
        _end_group(second)

    trials = optuna.load_study(study_name="shared", storage=optuna_url).trials
    assert sum(t.state == S.COMPLETE for t in trials) == TRIALS
    assert not [t.number for t in trials if t.state == S.RUNNING]

    experiment = client.get_experiment_by_name("shared")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_name for r in runs if r.info.status == "RUNNING"] == []
    (parent,) = [r for r in runs if r.data.tags.get("tenantq.kind") == "study"]
    assert parent.info.status == "FINISHED"
    # Begun on a fault worker: said in the log and on the parent run, kept after the resume.
    assert parent.data.tags.get("tenantq.fault_worker") == "GatedTrials"
    assert "WARNING: the workers are GatedTrials" in (tmp_path / "search0.log").read_text()
    complete = [t.number for t in trials if t.state == S.COMPLETE]
    nested = {
        int(r.data.tags["tenantq.trial"]): r
        for r in runs
        if r.data.tags.get("tenantq.kind") == "trial" and r.info.status == "FINISHED"
    }
    assert sorted(nested) == sorted(complete)
    # Through the server (proxied artifacts: mlflow-artifacts:/). A trial the killed driver
    # told Optuna but did not log is logged on resume from Optuna's record: its plan, params,
    # metrics and the plan's budget (recomputed), not the per-example table, which only the
    # worker's result carried.
    live = [n for n in complete if "tenantq.logged_on_resume" not in nested[n].data.tags]
    assert live  # at least the trial logged before the kill
    for number in complete:
        names = {a.path for a in client.list_artifacts(nested[number].info.run_id)}
        expected = (
            {"examples.parquet", "budget.json", "plan.json"}
            if number in live
            else {"budget.json", "plan.json"}
        )
        assert expected <= names, (number, names)
    front = {a.path for a in client.list_artifacts(parent.info.run_id, "front")}
    assert "front/front.json" in front and any(p.startswith("front/trial-") for p in front)
    listing = json.loads(
        Path(
            client.download_artifacts(parent.info.run_id, "front/front.json", str(tmp_path))
        ).read_text()
    )
    assert {f"front/trial-{r['trial']:04d}-{r['fingerprint']}.json" for r in listing} <= front
    # The files sit in the server's --artifacts-destination, not in the client's folders.
    assert list(server.artifacts.rglob("examples.parquet"))
    assert parent.info.artifact_uri.startswith("mlflow-artifacts:")

    report = subprocess.run(
        [sys.executable, "-m", "tenantq", "report", "--experiment", "shared"]
        + ["--tracking-uri", server.url, "--out", str(tmp_path / "report"), "--static", "none"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert report.returncode == 0, report.stdout + report.stderr
    html = next((tmp_path / "report").glob("*.html")).read_text()
    assert f"trial {complete[-1]}" in html or "shared" in html


def test_the_stores_listen_on_loopback_only(stores) -> None:
    pg, _, server = stores
    postmaster = int((pg.folder / "data" / "postmaster.pid").read_text().split()[0])
    processes = [psutil.Process(postmaster), psutil.Process(server.process.pid)]
    processes += psutil.Process(server.process.pid).children(recursive=True)
    listening = []
    for process in processes:
        with __import__("contextlib").suppress(psutil.Error):
            listening += [
                c.laddr
                for c in process.net_connections(kind="inet")
                if c.status == psutil.CONN_LISTEN
            ]
    assert {a.port for a in listening} >= {pg.port, int(server.url.rsplit(":", 1)[1])}
    assert [a for a in listening if a.ip not in LOOPBACK] == []
