"""The fault-injecting workers a study can be told to run on from the environment, and the
ticket gate the cluster tests hold trials with (tenantq.workers.faults)."""

from __future__ import annotations

import threading
import time

import pytest

from tenantq.search.spec import WorkersSpec
from tenantq.workers.faults import GatedTrials, take_ticket
from tenantq.workers.host import HostWorker
from tenantq.workers.pool import WORKER_CLASS_ENV, default_worker_class
from tenantq.workers.slice import SliceWorker


def test_the_environment_names_a_fault_worker_for_a_study_started_from_the_command_line(
    monkeypatch,
) -> None:
    spec = WorkersSpec(count=1, kind="cpu")
    monkeypatch.setenv(WORKER_CLASS_ENV, "GatedTrials")
    assert default_worker_class(spec) is GatedTrials
    monkeypatch.setenv(WORKER_CLASS_ENV, "")
    assert default_worker_class(spec) is HostWorker
    monkeypatch.setenv(WORKER_CLASS_ENV, " GatedTrials\n")  # as a shell or a job file writes it
    assert default_worker_class(spec) is GatedTrials
    assert default_worker_class(object()) is GatedTrials  # a spec without a kind: one host


def test_without_the_environment_a_slice_runs_slice_workers_and_a_host_host_workers(
    monkeypatch,
) -> None:
    monkeypatch.delenv(WORKER_CLASS_ENV, raising=False)
    host = WorkersSpec(count=1, kind="cpu")
    gang = WorkersSpec(kind="cpu_slice", cpu_slice_hosts=2, cpu_devices_per_host=2)
    assert default_worker_class(host) is HostWorker
    assert default_worker_class(gang) is SliceWorker
    assert default_worker_class(object()) is HostWorker  # a spec without a kind: one host


@pytest.mark.parametrize("named", ["HostWorker", "os.system", "tenantq.workers.faults.GatedTrials"])
def test_a_worker_name_outside_the_faults_module_is_refused_with_the_names_it_could_be(
    monkeypatch, named
) -> None:
    monkeypatch.setenv(WORKER_CLASS_ENV, named)
    with pytest.raises(ValueError, match=r"not a worker of tenantq.workers.faults; one of \[") as e:
        default_worker_class(WorkersSpec(count=1, kind="cpu"))
    assert "GatedTrials" in str(e.value) and repr(named) in str(e.value)


def test_a_fault_worker_is_refused_for_a_slice(monkeypatch) -> None:
    monkeypatch.setenv(WORKER_CLASS_ENV, "GatedTrials")
    spec = WorkersSpec(kind="cpu_slice", cpu_slice_hosts=2, cpu_devices_per_host=2)
    with pytest.raises(ValueError) as err:
        default_worker_class(spec)
    assert str(err.value) == (
        "TENANTQ_WORKER_CLASS='GatedTrials' is a single-host worker; [workers] kind = "
        "'cpu_slice' runs slice workers: unset TENANTQ_WORKER_CLASS"
    )


def test_a_missing_gate_folder_is_an_open_gate(tmp_path) -> None:
    take_ticket(tmp_path / "absent")  # returns at once; a hang here fails on the suite timeout


def test_each_ticket_lets_exactly_one_trial_through(tmp_path) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    (gate / "1").write_text("")
    (gate / "2").write_text("")
    through: list[int] = []

    def trial(i: int) -> None:
        take_ticket(gate, poll_s=0.01)
        through.append(i)

    threads = [threading.Thread(target=trial, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while len(through) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # 20 polls: a third trial through without a ticket would show by now
    assert len(through) == 2 and list(gate.iterdir()) == []
    gate.rmdir()  # the gate opens for good
    for t in threads:
        t.join(timeout=10)
    assert sorted(through) == [0, 1, 2]


def test_a_gated_worker_without_its_folder_in_the_environment_says_what_to_set(
    monkeypatch,
) -> None:
    monkeypatch.delenv("TENANTQ_TRIAL_GATE", raising=False)
    worker = GatedTrials.__new__(GatedTrials)  # no model: the check comes before any work
    with pytest.raises(RuntimeError, match="TENANTQ_TRIAL_GATE = a folder of tickets"):
        worker.evaluate("{}")


def test_a_gate_removed_while_a_worker_is_listing_it_is_an_open_gate(tmp_path, monkeypatch) -> None:
    """The test opens the gate (rmdir) at any moment: between a worker's `is_dir` and its
    listing the folder may be gone; that is the gate opening, not the trial's error."""
    from pathlib import Path

    gate = tmp_path / "gate"
    gate.mkdir()
    listing = Path.iterdir

    def removed_first(self):
        if self == gate and gate.is_dir():
            gate.rmdir()  # opened just after the worker saw a folder
        return listing(self)

    monkeypatch.setattr(Path, "iterdir", removed_first)
    take_ticket(gate, poll_s=0.01)  # returns: the gate is open


def _driver_starting_its_pool(tmp_path, monkeypatch):
    """A SearchDriver whose `_start_pool` runs with Ray and the pool stubbed: what class it
    hands the pool, which tags it sets on its parent run."""
    import tomllib
    from types import SimpleNamespace

    import ray

    import tenantq.workers as workers
    from tenantq.search.driver import SearchDriver
    from tenantq.search.spec import parse_spec
    from tenantq.testing import TINY_SUITE, tiny_study_spec

    (tmp_path / "tiny_suite.toml").write_text(TINY_SUITE)
    suite = tmp_path / "tiny_suite.toml"
    text = tiny_study_spec(tmp_path, name="f", trials=1, suite=suite, sampler="random", workers=1)
    driver = SearchDriver(parse_spec(tomllib.loads(text)), text, progress=False)
    seen: dict = {"tags": {}}

    def tag(run_id, key, value):
        seen["tags"][(run_id, key)] = value

    driver.tracker = SimpleNamespace(parent_run_id="parent", tag=tag)

    class Pool:
        def __init__(self, *args, worker_class=None, **kwargs):
            seen["class"] = worker_class or default_worker_class(args[0])

        def wait_ready(self):
            pass

    monkeypatch.setattr(workers, "WorkerPool", Pool)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    return driver, seen


def test_a_study_on_a_fault_worker_says_so_on_stderr_and_in_its_parent_run(
    tmp_path, monkeypatch, capsys
) -> None:
    driver, seen = _driver_starting_its_pool(tmp_path, monkeypatch)
    monkeypatch.setenv(WORKER_CLASS_ENV, "GatedTrials")
    driver._start_pool()
    assert seen["class"] is GatedTrials
    assert seen["tags"] == {("parent", "tenantq.fault_worker"): "GatedTrials"}
    err = capsys.readouterr().err
    assert "GatedTrials" in err and WORKER_CLASS_ENV in err and "not the real" in err


def test_a_study_on_the_real_workers_has_no_fault_worker_tag(tmp_path, monkeypatch, capsys) -> None:
    driver, seen = _driver_starting_its_pool(tmp_path, monkeypatch)
    monkeypatch.delenv(WORKER_CLASS_ENV, raising=False)
    driver._start_pool()
    assert seen["class"] is HostWorker and seen["tags"] == {}
    assert "fault" not in capsys.readouterr().err


def test_a_bad_worker_class_in_the_environment_stops_the_study_before_the_stores_are_touched(
    tmp_path, monkeypatch
) -> None:
    import tomllib

    from tenantq.search.driver import SearchDriver
    from tenantq.search.spec import parse_spec
    from tenantq.testing import TINY_SUITE, tiny_study_spec

    (tmp_path / "tiny_suite.toml").write_text(TINY_SUITE)
    suite = tmp_path / "tiny_suite.toml"
    text = tiny_study_spec(tmp_path, name="f", trials=1, suite=suite, sampler="random", workers=1)
    driver = SearchDriver(parse_spec(tomllib.loads(text)), text, progress=False)
    monkeypatch.setenv(WORKER_CLASS_ENV, "GatedTrial")  # a typo
    with pytest.raises(ValueError, match="TENANTQ_WORKER_CLASS='GatedTrial' is not a worker"):
        driver.run()
    # Nothing half-written: no Optuna study, no MLflow experiment or parent run.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny_suite.toml"]
