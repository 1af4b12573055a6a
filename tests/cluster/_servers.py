"""Real shared stores for the cluster tests: PostgreSQL and an MLflow tracking server.

PostgreSQL is Debian's (tests/cluster/setup_postgres.sh installs it in CI): `initdb` into a
fresh folder, `pg_ctl start` on 127.0.0.1 and a free port, no Unix socket, a password for the
`tenantq` role; stopped with `pg_ctl stop -m immediate`. `initdb` refuses to run as root, so
as root the server runs as the `postgres` user the package creates. The MLflow server keeps
its runs in that PostgreSQL and serves artifacts itself from a local folder (proxied
artifacts: clients never see the folder), on 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PASSWORD = "tenantq-test"
START_TIMEOUT_S = 120  # an MLflow server migrates a fresh PostgreSQL schema on start (~20 s)


def pg_binary(name: str) -> str:
    found = shutil.which(name) or next(
        iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None
    )
    if found is None:
        raise RuntimeError(f"no {name}: run tests/cluster/setup_postgres.sh (Debian postgresql)")
    return found


@dataclass(frozen=True)
class Postgres:
    port: int
    folder: Path

    def url(self, database: str) -> str:
        return f"postgresql+psycopg2://tenantq:{PASSWORD}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        import psycopg2

        with contextlib.closing(
            psycopg2.connect(
                host="127.0.0.1",
                port=self.port,
                user="tenantq",
                password=PASSWORD,
                dbname="postgres",
            )
        ) as conn:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)


def _as_server_user(cmd: list[str]) -> list[str]:
    if os.getuid() != 0:
        return cmd
    return ["runuser", "-u", "postgres", "--", *cmd]


@contextlib.contextmanager
def postgres(port: int) -> Iterator[Postgres]:
    folder = Path(tempfile.mkdtemp(prefix="tq-pg-", dir="/tmp"))
    data, log = folder / "data", folder / "server.log"
    (folder / "pw").write_text(PASSWORD + "\n")
    if os.getuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(folder, user.pw_uid, user.pw_gid)
        os.chown(folder / "pw", user.pw_uid, user.pw_gid)
    try:
        subprocess.run(
            _as_server_user(
                [pg_binary("initdb"), "-D", str(data), "-U", "tenantq", "-E", "UTF8", "--no-sync"]
                + ["--auth-host=scram-sha-256", "--auth-local=reject", f"--pwfile={folder}/pw"]
            ),
            check=True,
            capture_output=True,
            timeout=120,
        )
        options = f"-c listen_addresses=127.0.0.1 -p {port} -c unix_socket_directories=''"
        options += " -c fsync=off"  # a throwaway test database
        subprocess.run(
            _as_server_user(
                [pg_binary("pg_ctl"), "-D", str(data), "-l", str(log), "-o", options, "-w"]
                + ["-t", str(START_TIMEOUT_S), "start"]
            ),
            check=True,
            capture_output=True,
            timeout=START_TIMEOUT_S + 10,
        )
        yield Postgres(port=port, folder=folder)
    finally:
        if (data / "postmaster.pid").exists():
            subprocess.run(
                _as_server_user([pg_binary("pg_ctl"), "-D", str(data), "-m", "immediate", "stop"]),
                capture_output=True,
                timeout=60,
            )
        shutil.rmtree(folder, ignore_errors=True)


@dataclass(frozen=True)
class MlflowServer:
    url: str
    artifacts: Path
    process: subprocess.Popen


@contextlib.contextmanager
def mlflow_server(backend_store_uri: str, artifacts: Path, port: int) -> Iterator[MlflowServer]:
    mlflow = str(Path(sys.executable).parent / "mlflow")
    log = (artifacts.parent / "mlflow-server.log").open("w")
    process = subprocess.Popen(
        [mlflow, "server", "--backend-store-uri", backend_store_uri]
        + ["--artifacts-destination", str(artifacts), "--serve-artifacts"]
        + ["--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(url + "/health", timeout=5) as response,
            ):
                if response.status == 200:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                log.flush()
                tail = (artifacts.parent / "mlflow-server.log").read_text()[-3000:]
                raise RuntimeError(f"mlflow server did not start:\n{tail}")
            time.sleep(1)
        yield MlflowServer(url=url, artifacts=artifacts, process=process)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 15)  # the server and its uvicorn/gunicorn workers
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait(timeout=30)
        log.close()
