"""What the cluster tests share besides the `local_cluster` fixture: the script's path, free
ports, the dashboard client and a client's environment. A module of its own, not conftest.py:
`from conftest import ...` finds whichever conftest.py comes first on sys.path, and with every
test folder collected in one process (as pytest-xdist's workers do) that is tests/conftest.py.
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
LOCAL_SH = REPO_ROOT / "cluster" / "local.sh"
# Ray's default worker port range; ports picked for the head must stay outside it.
RAY_WORKER_PORTS = range(10002, 20000)


def free_port() -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in RAY_WORKER_PORTS:
            return port


@dataclass(frozen=True)
class LocalCluster:
    state_dir: Path
    dashboard_url: str
    metrics_url: str
    token_path: Path
    env: dict[str, str]  # what a client needs: RAY_ADDRESS, RAY_AUTH_MODE, RAY_AUTH_TOKEN_PATH

    def token(self) -> str:
        return self.token_path.read_text().strip()

    def get_json(self, path: str, *, token: str | None = "") -> tuple[int, object]:
        """GET a dashboard path; token "" means the cluster's own, None means no header."""
        headers = {}
        if token is not None:
            headers["Authorization"] = f"Bearer {token or self.token()}"
        request = urllib.request.Request(self.dashboard_url + path, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                body = response.read().decode()
                return response.status, json.loads(body) if body.startswith(("{", "[")) else body
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def wait_for_job(self, submission_id: str, timeout_s: float) -> dict:
        """Poll the job API until the job reaches a terminal state; returns its record."""
        deadline = time.monotonic() + timeout_s
        while True:
            status, record = self.get_json(f"/api/jobs/{submission_id}")
            if status == 200 and record["status"] in {"SUCCEEDED", "FAILED", "STOPPED"}:
                return record
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {submission_id} not finished after {timeout_s}s: {record}")
            time.sleep(2)

    def job_logs(self, submission_id: str) -> str:
        status, body = self.get_json(f"/api/jobs/{submission_id}/logs")
        return body["logs"] if status == 200 else f"(no logs: HTTP {status} {body})"


def client_env(cluster_env: dict[str, str]) -> dict[str, str]:
    """The test process's environment with the cluster's client settings, JAX on CPU."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(cluster_env)
    env["JAX_PLATFORMS"] = "cpu"
    return env
