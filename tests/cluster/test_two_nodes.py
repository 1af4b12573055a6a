"""Two Ray nodes on one machine: a study starts on the head's worker, a second node joins and
takes trials, then dies mid-trial; its trial is re-queued on the head and the study completes.

Ray 2.60 binds its servers to every interface once a node's address is not 127.0.0.1, and a
second node needs that (cluster/local.sh, `join`). So the whole cluster runs in a network
namespace of its own whose only interface is loopback (`unshare -n`, as root): no Ray socket
of this test is reachable from outside the namespace. The stores are sqlite files.

The workers are `GatedTrials` (tenantq.workers.faults, named in the nodes' environment): every
trial waits at a closed gate until the test opens it, so the head cannot finish the study
before the joined node has a trial running, however fast trials are on the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from _cluster import LOCAL_SH, free_port

from tenantq.testing import TINY_SUITE, tiny_study_spec

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")
TRIALS = 4  # two held at the gate (one per node), two more after it opens


@pytest.fixture(scope="module")
def netns():
    """A process holding a fresh network namespace with only `lo`, up."""
    if os.getuid() != 0 or not shutil.which("unshare") or not shutil.which("nsenter"):
        pytest.skip("needs root, unshare and nsenter for a loopback-only network namespace")
    holder = subprocess.Popen(["unshare", "-n", "sh", "-c", "ip link set lo up && exec sleep 3600"])
    deadline = time.monotonic() + 30
    while holder.poll() is None and time.monotonic() < deadline:  # `sleep`: `lo` is up
        with contextlib.suppress(OSError):
            if Path(f"/proc/{holder.pid}/comm").read_text().strip() == "sleep":
                break
        time.sleep(0.05)
    else:
        holder.kill()
        holder.wait()
        pytest.skip("no loopback-only network namespace here (unshare -n or `ip` failed)")
    try:
        yield holder.pid
    finally:
        holder.kill()
        holder.wait()


@pytest.fixture(scope="module")
def cluster(netns):
    state_dir = Path(tempfile.mkdtemp(prefix="tq2-", dir="/tmp"))
    (state_dir / "gate").mkdir()  # closed: no tickets; the test removes it to open
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "TENANTQ_"))}
    env.update(
        TENANTQ_RAY_DIR=str(state_dir),
        TENANTQ_RAY_HEAD_IP="127.0.0.2",
        TENANTQ_RAY_PORT=str(free_port()),
        TENANTQ_RAY_DASHBOARD_PORT=str(free_port()),
        TENANTQ_RAY_CLIENT_PORT=str(free_port()),
        TENANTQ_RAY_AGENT_PORT=str(free_port()),
        TENANTQ_RAY_METRICS_PORT=str(free_port()),
        TENANTQ_RAY_NUM_CPUS="1",  # one HostWorker on the head; the second waits for a node
        TENANTQ_RAY_JOIN_CPUS="1",
        RAY_BIN=RAY,
        JAX_PLATFORMS="cpu",
        # Ray's processes on both nodes inherit these: the job's driver picks the worker class,
        # the workers wait at the gate.
        TENANTQ_WORKER_CLASS="GatedTrials",
        TENANTQ_TRIAL_GATE=str(state_dir / "gate"),
    )
    ns = ["nsenter", "-t", str(netns), "-n"]

    def sh(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [*ns, *args], env=env, capture_output=True, text=True, timeout=timeout
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done

    try:
        sh(str(LOCAL_SH), "start")
        printed = sh(str(LOCAL_SH), "env").stdout
        env.update(line.removeprefix("export ").split("=", 1) for line in printed.splitlines())
        yield sh, env, state_dir
    finally:
        subprocess.run([*ns, str(LOCAL_SH), "stop"], env=env, capture_output=True, timeout=180)
        shutil.rmtree(state_dir, ignore_errors=True)


# The dashboard is reachable from inside the namespace only: a GET there by this Python (no
# curl needed on the CI image).
GET = (
    "import sys, urllib.request as u; r = u.Request(sys.argv[1], headers={'Authorization': "
    "'Bearer ' + open(sys.argv[2]).read().strip()}); "
    "print(u.urlopen(r, timeout=10).read().decode())"
)


def _get(sh, env, path: str):
    out = sh(sys.executable, "-I", "-c", GET, env["RAY_ADDRESS"] + path, env["RAY_AUTH_TOKEN_PATH"])
    return json.loads(out.stdout)


def _actors_by_node(sh, env) -> dict[str, str]:
    """Worker actor name -> the `tenantq.node` label of its node ('' for the head)."""
    nodes = _get(sh, env, "/api/v0/nodes?detail=1&limit=100")["data"]["result"]["result"]
    label = {n["node_id"]: n.get("labels", {}).get("tenantq.node", "") for n in nodes}
    actors = _get(sh, env, "/api/v0/actors?detail=1&limit=1000")["data"]["result"]["result"]
    return {
        a["name"]: label.get(a["node_id"], "?")
        for a in actors
        if a["class_name"] == "GatedTrials" and a.get("name")
    }


def test_study_grows_onto_a_joining_node_and_survives_losing_it(cluster, netns, tmp_path) -> None:
    import optuna
    from mlflow import MlflowClient

    sh, env, state_dir = cluster
    job = tmp_path / "job"
    job.mkdir()
    (job / "spec.toml").write_text(
        tiny_study_spec(
            tmp_path,
            name="twonodes",
            trials=TRIALS,
            suite="tiny_suite.toml",
            sampler="random",
            seed=3,
            workers=2,
        )
    )
    (job / "tiny_suite.toml").write_text(TINY_SUITE)
    submission_id = f"tq-test-{uuid.uuid4().hex[:8]}"
    sh(
        "sh",
        "-c",
        f"cd {job} && {REPO}/cluster/submit.sh --no-wait --submission-id {submission_id} "
        f"-- tenantq search spec.toml --no-progress --out {tmp_path / 'out'}",
    )
    storage = f"sqlite:///{tmp_path}/optuna.db"
    S = optuna.trial.TrialState

    def trials():
        try:
            return optuna.load_study(study_name="twonodes", storage=storage).trials
        except (KeyError, Exception):
            return []

    def wait_for(what, check, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = check()
            if found:
                return found
            time.sleep(0.5)
        record = _get(sh, env, f"/api/jobs/{submission_id}")
        pytest.fail(f"{what} not seen in {timeout_s:.0f} s; job {record.get('status')}")

    # Elastic start: the study runs on the head's worker while the second one cannot be placed
    # (a trial held at the gate on the head alone; the node then joins while it waits).
    wait_for(
        "a trial running on the head alone",
        lambda: any(t.state == S.RUNNING for t in trials()),
        400,
    )
    sh(str(LOCAL_SH), "join", "second")

    def running_on_second():
        on = _actors_by_node(sh, env)
        for t in trials():
            if t.state == S.RUNNING and on.get(t.user_attrs.get("worker", "")) == "second":
                return t.number, on
        return None

    lost, placement = wait_for("a trial running on the joined node", running_on_second, 300)
    sh(str(LOCAL_SH), "leave", "second", "--now")  # the node dies mid-trial
    (state_dir / "gate").rmdir()  # the gate opens: the rest of the study runs on the head

    deadline = time.monotonic() + 500
    while (record := _get(sh, env, f"/api/jobs/{submission_id}"))["status"] not in {
        "SUCCEEDED",
        "FAILED",
        "STOPPED",
    }:
        assert time.monotonic() < deadline, record
        time.sleep(1)
    logs = _get(sh, env, f"/api/jobs/{submission_id}/logs")["logs"]
    assert record["status"] == "SUCCEEDED", logs[-4000:]
    # The job's driver inherited TENANTQ_WORKER_CLASS from the head and said so.
    assert "WARNING: the workers are GatedTrials" in logs

    done = trials()
    finished = [t for t in done if t.state in (S.COMPLETE, S.FAIL)]
    retries = [t for t in done if "failed_trial" in t.system_attrs]
    assert len(finished) - len(retries) == TRIALS  # every trial accounted for, none lost
    assert not [t.number for t in done if t.state == S.RUNNING]
    assert done[lost].state == S.FAIL  # its worker's node died under it...
    (retry,) = [t for t in retries if t.system_attrs["failed_trial"] == lost]
    assert retry.state == S.COMPLETE  # ...and Optuna's re-queued copy completed
    assert placement.get(retry.user_attrs["worker"], "") == ""  # on the surviving head
    # Trials ran on both nodes' workers.
    workers = {placement.get(t.user_attrs.get("worker"), "?") for t in done}
    assert {"", "second"} <= workers

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("twonodes").experiment_id])
    assert [r.info.run_name for r in runs if r.info.status == "RUNNING"] == []

    # Every Ray process of this cluster lives in the loopback-only namespace.
    head_pid = (state_dir / "head.pid").read_text().strip()
    assert os.readlink(f"/proc/{head_pid}/ns/net") == os.readlink(f"/proc/{netns}/ns/net")
    assert os.readlink(f"/proc/{head_pid}/ns/net") != os.readlink("/proc/self/ns/net")
    interfaces = sh("cat", "/proc/net/dev").stdout.splitlines()[2:]
    assert [line.split(":")[0].strip() for line in interfaces] == ["lo"]
