"""`make test` runs on pytest-xdist workers with `--dist loadgroup`; tests that start Ray,
servers or bind ports share the `serial` group (tests/conftest.py) and so one worker. The group
travels as a `@serial` suffix of the node id, which pytest-xdist 3.8 loses under pytest 9.2
without the conftest's fix (every test then lands on any worker, silently)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # two xdist workers collect four files: 10-40 s with the load
def test_the_serial_group_runs_on_one_worker_and_the_rest_on_both() -> None:
    # Four quick tests of tests/cluster (serial) and four of tests/search/test_spec.py (not):
    # xdist hands its first tests to both workers at once, so without the group the cluster
    # tests are split over gw0 and gw1.
    cluster = "tests/cluster/test_configs.py::"
    spec = "tests/search/test_spec.py::"
    ids = [
        *(cluster + n for n in ("test_launcher_tpu_workers_are_single_v6e_8_hosts",
                                "test_mlflow_server_demands_a_login",
                                "test_postgres_holds_separate_databases_for_mlflow_and_optuna",
                                "test_network_policies_admit_only_pods_that_exist")),
        *(spec + n for n in ("test_minimal_spec_defaults",
                             "test_a_storage_that_cannot_be_opened_is_one_line",
                             "test_a_storage_driver_that_is_missing_is_named",
                             "test_unreachable_tracking_server_stops_before_the_study_is_created")),
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v",
         "-p", "no:cacheprovider", *ids],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    # "[gw0] [ 12%] PASSED tests/cluster/test_configs.py::test_x@serial"
    ran = [line.split() for line in proc.stdout.splitlines() if " PASSED " in line]
    workers = {words[-1]: words[0] for words in ran}
    assert len(workers) == len(ids), out[-3000:]
    serial = {w for test, w in workers.items() if test.startswith(cluster)}
    assert all(t.endswith("@serial") for t in workers if t.startswith(cluster)), workers
    assert not any("@" in t for t in workers if t.startswith(spec)), workers
    assert len(serial) == 1, workers  # the whole group on one worker
