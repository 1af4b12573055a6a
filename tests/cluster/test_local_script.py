"""`cluster/local.sh` refuses bad input with one line, before it starts or writes anything.

No Ray is started here (tests/cluster/test_job_submit.py runs the script for real).
"""

from __future__ import annotations

import os
import subprocess

from _cluster import LOCAL_SH


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "TENANTQ_RAY_"))}
    return subprocess.run(
        [str(LOCAL_SH), *args], env=base | env, capture_output=True, text=True, timeout=60
    )


def test_script_is_valid_bash() -> None:
    assert subprocess.run(["bash", "-n", str(LOCAL_SH)], capture_output=True).returncode == 0


def test_unknown_command_names_the_valid_ones() -> None:
    done = _run("restart")
    assert done.returncode == 1
    assert (
        done.stderr.strip()
        == "cluster/local.sh: usage: cluster/local.sh start|stop|status|env|join NAME|"
        "leave NAME [--now] (got 'restart')"
    )


def test_join_names_what_a_node_name_may_be_and_needs_a_running_head() -> None:
    state = f"/tmp/tq-none-{os.getpid()}"  # short, never created
    bad = _run("join", "Second Node", TENANTQ_RAY_DIR=state)
    assert bad.returncode == 1 and "lowercase letters, digits and '-'" in bad.stderr
    alone = _run("join", "second", TENANTQ_RAY_DIR=state)
    assert alone.returncode == 1 and "no head running" in alone.stderr
    assert _run("leave", "second", TENANTQ_RAY_DIR=state).stdout.strip() == (
        "node 'second' not running"
    )
    assert not os.path.exists(state)


def test_state_dir_too_long_for_rays_socket_paths_is_refused(tmp_path) -> None:
    # Ray appends ~70 bytes (session_<date>_<pid>/sockets/plasma_store) to its temp dir and a
    # Unix socket path holds at most 107 bytes, so the script caps the state dir at 36.
    state = tmp_path / ("d" * 40)
    done = _run("start", TENANTQ_RAY_DIR=str(state))
    assert done.returncode == 1
    assert "at most 36" in done.stderr and str(state) in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not state.exists()  # nothing written


def test_relative_state_dir_is_refused() -> None:
    done = _run("start", TENANTQ_RAY_DIR="tq-rel")
    assert done.returncode == 1
    assert "absolute path" in done.stderr
    assert not os.path.exists("tq-rel")


def test_stop_and_status_without_a_running_head() -> None:
    state = f"/tmp/tq-none-{os.getpid()}"  # short, never created
    assert _run("stop", TENANTQ_RAY_DIR=state).stdout.strip() == "not running"
    status = _run("status", TENANTQ_RAY_DIR=state)
    assert status.returncode == 3 and status.stdout.strip() == "not running"


def test_env_prints_what_the_ray_cli_needs() -> None:
    done = _run("env", TENANTQ_RAY_DIR="/tmp/tq-x", TENANTQ_RAY_DASHBOARD_PORT="8999")
    assert done.stdout.splitlines() == [
        "export RAY_ADDRESS=http://127.0.0.1:8999",
        "export RAY_AUTH_MODE=token",
        "export RAY_AUTH_TOKEN_PATH=/tmp/tq-x/auth_token",
        "export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0",
        "export TENANTQ_RAY_GCS=127.0.0.1:6380",
    ]


def test_env_of_a_joinable_head_leaves_multi_node_mode_on() -> None:
    # A head off 127.0.0.1 runs in multi-node mode (nodes join it); the driver's must match.
    done = _run("env", TENANTQ_RAY_DIR="/tmp/tq-x", TENANTQ_RAY_HEAD_IP="127.0.0.2")
    assert "export TENANTQ_RAY_GCS=127.0.0.2:6380" in done.stdout.splitlines()
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in done.stdout


def test_head_off_127_0_0_1_is_refused_where_other_interfaces_exist() -> None:
    # Ray 2.60 binds every server to all interfaces once the node address is not 127.0.0.1:
    # outside a loopback-only network namespace that would expose the cluster.
    with open("/proc/net/dev") as f:
        interfaces = [line.split(":")[0].strip() for line in f.readlines()[2:]]
    if interfaces == ["lo"]:
        return  # a loopback-only namespace: the head may start there (test_two_nodes.py)
    state = f"/tmp/tq-none-{os.getpid()}"  # short, never created
    done = _run("start", TENANTQ_RAY_DIR=state, TENANTQ_RAY_HEAD_IP="127.0.0.2")
    assert done.returncode == 1
    line = done.stderr.strip()
    assert "\n" not in line and "TENANTQ_RAY_HEAD_IP=127.0.0.2" in line, line
    assert "network namespace" in line and "TENANTQ_RAY_EXPOSE=1" in line, line
    assert not os.path.exists(state)  # refused before anything was written
