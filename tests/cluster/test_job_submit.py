"""`ray job submit` for real against `cluster/local.sh`: token auth, loopback, study metrics,
and `cluster/submit.sh` running the submitted tree's tenantq (not the installed one).

One cluster per module (`local_cluster` in conftest.py; helpers in _cluster.py):
`cluster/local.sh start` with token authentication, free ports and its own state dir, and
`cluster/local.sh stop` at the end.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import psutil
import pytest
from _cluster import client_env
from _study_metrics import documented_study_metrics

from tenantq.testing import TINY_SUITE, tiny_study_spec

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

RAY = str(Path(sys.executable).parent / "ray")
REPO = Path(__file__).resolve().parents[2]
LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1"}

# The job exports the study's metrics the way the driver will (ray.util.metrics, from the
# driver process), then waits until the test has scraped them.
PROBE = """
import json, sys, time
from pathlib import Path
import ray
from ray.util.metrics import Counter, Gauge, Histogram

contract = json.loads(sys.argv[1])
sentinel = Path(sys.argv[2])
ray.init()
print("PROBE node", ray.util.get_node_ip_address(), "cpus", ray.cluster_resources()["CPU"])
kinds = {"Counter": Counter, "Gauge": Gauge, "Histogram": Histogram}
tag_values = {"study": "probe", "state": "complete", "reason": "error"}
for name, (kind, tag_keys, boundaries) in contract.items():
    extra = {"boundaries": boundaries} if kind == "Histogram" else {}
    metric = kinds[kind](name, description=name, tag_keys=tuple(tag_keys), **extra)
    tags = {k: tag_values[k] for k in tag_keys}
    if kind == "Counter":
        metric.inc(1.0, tags=tags)
    elif kind == "Gauge":
        metric.set(2.0, tags=tags)
    else:
        metric.observe(3.0, tags=tags)
deadline = time.monotonic() + 180
while not sentinel.exists() and time.monotonic() < deadline:
    time.sleep(0.5)
print("PROBE done", sentinel.exists())
"""


def _submit(cluster, working_dir: Path, *entrypoint: str, env_overrides=None) -> str:
    submission_id = f"tq-test-{uuid.uuid4().hex[:8]}"
    env = client_env(cluster.env)
    env.update(env_overrides or {})
    cmd = [RAY, "job", "submit", "--no-wait", "--submission-id", submission_id]
    cmd += ["--working-dir", str(working_dir), "--", *entrypoint]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return submission_id


def test_job_api_demands_the_token(local_cluster) -> None:
    # Ray's HTTP token middleware: no credentials -> 401, a wrong token -> 403
    # (ray/_private/authentication/http_token_authentication.py); the right one -> 200.
    assert local_cluster.get_json("/api/jobs/", token=None)[0] == 401
    assert local_cluster.get_json("/api/jobs/", token="0" * 64)[0] == 403
    assert local_cluster.get_json("/api/jobs/")[0] == 200


def test_cli_without_auth_mode_is_refused(local_cluster) -> None:
    # DESIGN.md "Traps": the CLI sends the token only when RAY_AUTH_MODE=token is set.
    env = client_env(local_cluster.env)
    env.pop("RAY_AUTH_MODE")
    done = subprocess.run(
        [RAY, "job", "list"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert "Unauthorized" in done.stdout + done.stderr


def test_every_cluster_socket_listens_on_loopback_only(local_cluster) -> None:
    head_pid = int((local_cluster.state_dir / "head.pid").read_text())
    members = [p for p in psutil.process_iter() if _sid(p) == head_pid]
    assert len(members) >= 3  # at least the `ray start` process, gcs_server and raylet
    listening = []
    for process in members:
        try:
            sockets = process.net_connections(kind="inet")
        except psutil.Error:
            continue
        listening += [(process.name(), c.laddr) for c in sockets if c.status == psutil.CONN_LISTEN]
    assert len(listening) >= 5  # GCS, dashboard, client server, agent, metrics at least
    assert [(n, a) for n, a in listening if a.ip not in LOOPBACK] == []


def test_submitted_job_runs_and_exports_the_study_metrics(local_cluster, tmp_path) -> None:
    import json

    # Same buckets as the driver: Ray keeps one definition per metric name per cluster.
    contract = {
        n: (m.kind, m.tag_keys, m.boundaries) for n, m in documented_study_metrics().items()
    }
    working_dir = tmp_path / "job"
    working_dir.mkdir()
    (working_dir / "probe.py").write_text(PROBE)
    sentinel = tmp_path / "scraped"
    submission_id = _submit(
        local_cluster, working_dir, "python", "probe.py", json.dumps(contract), str(sentinel)
    )
    expected = {s for m in documented_study_metrics().values() for s in m.prometheus_series}
    found: set[str] = set()
    deadline = time.monotonic() + 150
    try:
        while time.monotonic() < deadline and not expected <= found:
            with urllib.request.urlopen(local_cluster.metrics_url, timeout=10) as response:
                text = response.read().decode()
            found = {line.split("{", 1)[0] for line in text.splitlines() if "tenantq" in line}
            found = {name for name in found if not name.startswith("#")}
            time.sleep(2)
    finally:
        sentinel.touch()
    record = local_cluster.wait_for_job(submission_id, timeout_s=180)
    logs = local_cluster.job_logs(submission_id)
    assert record["status"] == "SUCCEEDED", logs
    assert "PROBE node 127.0.0.1 cpus 2.0" in logs
    assert "PROBE done True" in logs
    # The Prometheus names the Grafana dashboard queries are the ones Ray really exports.
    assert expected <= found, f"missing {sorted(expected - found)}; saw {sorted(found)}"


# Appended to the submitted copy's tenantq/__init__.py: every process that imports it leaves
# a file named by its pid with the package path it imported and its command line.
MARKER = """
import os as _os
if _os.path.isdir({folder!r}):
    with open(_os.path.join({folder!r}, str(_os.getpid())), "w") as _f:
        _f.write(__file__ + "\\n" + open("/proc/self/cmdline").read().replace("\\0", " "))
"""


def _marked_tree(tmp_path: Path) -> tuple[Path, str, Path]:
    """A copy of this tree (cluster/submit.sh and platform/tenantq), committed, then edited to
    leave a marker from every process that imports it; returns (tree, commit, marker dir)."""
    import shutil

    tree = tmp_path / "tree"
    shutil.copytree(
        REPO / "platform" / "tenantq",
        tree / "platform" / "tenantq",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    (tree / "cluster").mkdir()
    shutil.copy2(REPO / "cluster" / "submit.sh", tree / "cluster" / "submit.sh")
    git = ["git", "-C", str(tree), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "submitted"], check=True)
    sha = subprocess.run(
        [*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()
    markers = tmp_path / "markers"
    markers.mkdir()
    with (tree / "platform" / "tenantq" / "__init__.py").open("a") as f:
        f.write(MARKER.format(folder=str(markers)))
    return tree, sha, markers


def _run_study(cluster, tmp_path: Path, name: str, tree: Path) -> tuple[Path, dict, str]:
    """Submit `tenantq search` on a fresh spec with `tree`'s cluster/submit.sh; returns its
    state dir, job record and logs."""
    state = tmp_path / name
    working_dir = state / "job"
    working_dir.mkdir(parents=True)
    spec = tiny_study_spec(
        state,
        name="jobsubmit",
        trials=3,
        suite="tiny_suite.toml",
        sampler="random",
        seed=0,
        workers=1,
        key_formats=("bf16", "fp8_e4m3"),
        bf16_first_layers=(0,),
    )
    (working_dir / "spec.toml").write_text(spec)
    (working_dir / "tiny_suite.toml").write_text(TINY_SUITE)
    submission_id = f"tq-test-{uuid.uuid4().hex[:8]}"
    env = client_env(cluster.env)
    env["RAY_BIN"] = RAY
    done = subprocess.run(
        [str(tree / "cluster" / "submit.sh"), "--no-wait", "--submission-id", submission_id]
        + ["--", "tenantq", "search", "spec.toml", "--no-progress", "--out", str(state / "o")],
        cwd=working_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    record = cluster.wait_for_job(submission_id, timeout_s=480)
    return state, record, cluster.job_logs(submission_id)


def test_study_submitted_as_a_ray_job_is_tracked_in_mlflow(local_cluster, tmp_path) -> None:
    import optuna
    from mlflow import MlflowClient

    # The documented form: `cluster/submit.sh -- tenantq search SPEC` (ray job submit with
    # the tree's tenantq as py_modules), no address; from a copy of this tree whose tenantq
    # differs from the installed one (a marker) and has uncommitted edits.
    tree, sha, markers = _marked_tree(tmp_path)
    state, record, logs = _run_study(local_cluster, tmp_path, "study", tree)
    assert record["status"] == "SUCCEEDED", logs

    # The driver and the worker imported the submitted copy, from Ray's unpacked upload (not
    # from this tree or the venv's install).
    seen = [p.read_text().split("\n", 1) for p in markers.iterdir()]
    drivers = [path for path, cmdline in seen if "-m tenantq search" in cmdline]
    # A Ray worker process renames itself (`ray::HostWorker...`, setproctitle) once started.
    workers = [path for path, cmdline in seen if cmdline.startswith("ray::")]
    assert workers and drivers, seen
    assert all(str(REPO) not in p and str(tree) not in p for p in workers + drivers), seen

    study = optuna.load_study(study_name="jobsubmit", storage=f"sqlite:///{state}/optuna.db")
    trials = study.trials
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 3
    client = MlflowClient(f"sqlite:///{state}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("jobsubmit").experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("tenantq.kind") == "study"]
    nested = {
        int(r.data.tags["tenantq.trial"]): r
        for r in runs
        if r.data.tags.get("tenantq.kind") == "trial"
    }
    assert parent.info.status == "FINISHED"
    # The submitted tree's commit, and that it had uncommitted edits (the marker).
    assert parent.data.tags["mlflow.source.git.commit"] == sha
    assert parent.data.tags["tenantq.source.dirty"] == "true"
    assert parent.data.tags["tenantq.source.origin"] == "submitted"
    # One nested run per trial, under the study's parent run, carrying the trial's figures.
    assert sorted(nested) == [t.number for t in trials]
    for t in trials:
        run = nested[t.number]
        assert run.info.status == "FINISHED"
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert "weights.mlp_down" in run.data.params
        assert run.data.metrics["capacity.tenants"] == t.values[0]
        assert run.data.metrics["fidelity.kl_mean"] == pytest.approx(t.values[1])
    # Trial 0 is the all-bf16 baseline: the same model as the reference, so KL is exactly 0.
    assert nested[0].data.metrics["fidelity.kl_mean"] == 0.0
    # The trials ran on the cluster's HostWorker actor, not on a Ray started inside the job.
    status, actors = local_cluster.get_json("/api/v0/actors?detail=1&limit=1000")
    assert status == 200
    assert "HostWorker" in {a["class_name"] for a in actors["data"]["result"]["result"]}
    # The driver's own metrics (tenantq.search.metrics) reached the cluster's Prometheus
    # endpoint under the contract's names: 3 trials complete, 3 durations observed; and the
    # Grafana dashboard's HostWorker selector matches Ray's actor metric.
    expected = {
        ("ray_tenantq_trials_total", (("state", "complete"), ("study", "jobsubmit"))): 3.0,
        ("ray_tenantq_trial_duration_s_count", (("study", "jobsubmit"),)): 3.0,
        # Ray's own actor count, the utilization panel's denominator: the study's one
        # HostWorker, dead once the study has ended.
        ("ray_actors", (("Name", "HostWorker"), ("Source", "gcs"), ("State", "DEAD"))): 1.0,
    }
    seen = _scrape_study_samples(local_cluster.metrics_url, expected, timeout_s=90)
    assert {k: seen.get(k) for k in expected} == expected


def _scrape_study_samples(url: str, expected: dict, timeout_s: float) -> dict:
    """Poll a Prometheus endpoint until each (name, label subset) sums to its expected value."""
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        seen: dict = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                for key in expected:
                    name, labels = key
                    if sample.name == name and all(sample.labels.get(k) == v for k, v in labels):
                        seen[key] = seen.get(key, 0.0) + sample.value
        if all(seen.get(k) == v for k, v in expected.items()) or time.monotonic() > deadline:
            return seen
        time.sleep(3)


def _sid(process: psutil.Process) -> int | None:
    try:
        return os.getsid(process.pid)
    except (ProcessLookupError, PermissionError):
        return None


def test_a_driver_outside_a_job_joins_the_cluster_by_its_loopback_address(
    local_cluster, tmp_path
) -> None:
    """`tenantq search SPEC --address 127.0.0.1:GCS` from a shell with `local.sh env`'s exports:
    Ray turns a 127.0.0.1 address into the machine's routable one unless multi-node mode is
    off (the head runs with it off), and the driver then waited minutes for a GCS that is not
    there. The exports switch it off for the driver too. Bound: the study finishes inside the
    180 s timeout (a good run takes seconds; the broken one retried past 90 s here)."""
    spec = tiny_study_spec(
        tmp_path,
        name="outside",
        trials=2,
        suite="tiny_suite.toml",
        sampler="random",
        seed=0,
        workers=1,
        key_formats=("bf16", "fp8_e4m3"),
    )
    (tmp_path / "spec.toml").write_text(spec)
    (tmp_path / "tiny_suite.toml").write_text(TINY_SUITE)
    env = client_env(local_cluster.env)
    # No model, no compile: this test is about joining, not measuring (workers.faults).
    env["TENANTQ_WORKER_CLASS"] = "InstantUnlessInt4Weights"
    address = local_cluster.env["TENANTQ_RAY_GCS"]
    assert address.startswith("127.0.0.1:")
    done = subprocess.run(
        [sys.executable, "-m", "tenantq", "search", "spec.toml", "--address", address]
        + ["--no-progress", "--out", str(tmp_path / "o")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "Connected to Ray cluster" in done.stderr
