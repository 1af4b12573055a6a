"""A real single-machine Ray cluster from `cluster/local.sh`, on free ports in its own dir.

The cluster's state (token, Ray temp dir, logs) lives in a short directory under /tmp (Ray's
socket paths must fit in 107 bytes), its ports are picked free, and `cluster/local.sh stop`
always runs, so the tests never touch another Ray instance on the machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from _cluster import LOCAL_SH, LocalCluster, free_port


@pytest.fixture(scope="module")
def local_cluster() -> Iterator[LocalCluster]:
    state_dir = Path(tempfile.mkdtemp(prefix="tq-", dir="/tmp"))
    dashboard_port, metrics_port = free_port(), free_port()
    script_env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("RAY_")},
        "TENANTQ_RAY_DIR": str(state_dir),
        "TENANTQ_RAY_PORT": str(free_port()),
        "TENANTQ_RAY_DASHBOARD_PORT": str(dashboard_port),
        "TENANTQ_RAY_CLIENT_PORT": str(free_port()),
        "TENANTQ_RAY_AGENT_PORT": str(free_port()),
        "TENANTQ_RAY_METRICS_PORT": str(metrics_port),
        "TENANTQ_RAY_NUM_CPUS": "2",
    }
    try:
        started = subprocess.run(
            [str(LOCAL_SH), "start"], env=script_env, capture_output=True, text=True, timeout=300
        )
        assert started.returncode == 0, started.stdout + started.stderr
        printed_env = subprocess.run(
            [str(LOCAL_SH), "env"], env=script_env, capture_output=True, text=True, check=True
        ).stdout
        env = dict(line.removeprefix("export ").split("=", 1) for line in printed_env.splitlines())
        yield LocalCluster(
            state_dir=state_dir,
            dashboard_url=f"http://127.0.0.1:{dashboard_port}",
            metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
            token_path=Path(env["RAY_AUTH_TOKEN_PATH"]),
            env=env,
        )
    finally:
        subprocess.run([str(LOCAL_SH), "stop"], env=script_env, capture_output=True, timeout=120)
        shutil.rmtree(state_dir, ignore_errors=True)
