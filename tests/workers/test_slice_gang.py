"""The gang of a slice worker with real Ray actors and placement groups, without a model:
hosts whose trial sleeps (tenantq.workers.faults.QuickSliceHost and its faulty kin), so what
is under test is the gang's bookkeeping alone. One Ray instance serves every test here.

One host killed mid-trial: the trial ends on a fresh gang, the old gang's actors are gone and
its placement group removed; the slice worker killed (as the pool does at a trial's deadline):
its host actors die with their owner, and its group, which Ray scopes to the job, is removed
by `release_slice`, as the pool calls it. A host raising the trial's error while another
hangs: the error reaches the caller after the straggler timeout and the gang is replaced.
Past its gang retries the slice worker exits for good; a gang that cannot start leaves no
group behind.
"""

from __future__ import annotations

import contextlib
import time

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STATE_WAIT_S = 60.0  # Ray frees a dead owner's actors and groups asynchronously


def _gone(ray, name: str) -> bool:
    try:
        ray.get_actor(name)
    except ValueError:
        return True
    return False


def _group_states(prefix: str) -> set[str]:
    from ray.util import placement_group_table

    return {g["state"] for g in placement_group_table().values() if g["name"].startswith(prefix)}


def _wait_removed(prefix: str) -> set[str]:
    deadline = time.monotonic() + STATE_WAIT_S
    while time.monotonic() < deadline and _group_states(prefix) - {"REMOVED"}:
        time.sleep(0.5)
    return _group_states(prefix)


@pytest.fixture(scope="module")
def ray_up():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, namespace="tenantq", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture
def made(ray_up):
    """Slice workers a test starts: killed and their groups released after it, as the pool
    does, so that one test's gang never holds the CPUs the next one needs."""
    from tenantq.workers.slice import release_slice

    workers: dict[str, object] = {}
    yield workers
    for name, worker in workers.items():
        with contextlib.suppress(ValueError, ray_up.exceptions.RayError):  # already dead
            ray_up.kill(worker)
        release_slice(name)


def _slice(ray, cls, name: str, tmp_path, made: dict):
    from tenantq.search.spec import WorkersSpec
    from tenantq.workers.host import worker_options
    from tenantq.workers.slice import slice_args

    spec = WorkersSpec(kind="cpu_slice", cpu_slice_hosts=2, cpu_devices_per_host=1)
    options = worker_options(spec)
    made[name] = (
        ray.remote(cls)
        .options(name=name, **options)
        .remote(name, "no-model", "no-suite", cache_dir=str(tmp_path), **slice_args(spec))
    )
    return made[name]


def test_a_host_killed_mid_trial_retries_it_on_a_fresh_gang_and_frees_the_old(
    ray_up, tmp_path, made
):
    from tenantq.workers.faults import QuickSlice
    from tenantq.workers.slice import release_slice

    ray = ray_up
    worker = _slice(ray, QuickSlice, "gang", tmp_path, made)
    assert len(ray.get(worker.ping.remote(), timeout=300)["hosts"]) == 2
    first = ray.get(worker.host_names.remote())
    trial = worker.evaluate.remote("{}")
    time.sleep(1.0)  # within the hosts' 3 s trial
    ray.kill(ray.get_actor(first[1]))
    record = ray.get(trial, timeout=300).extra["slice"]
    assert record["generation"] == 2
    assert record["gangs_lost"] == ["gang g1: ActorDiedError"]
    assert record["placement_groups"] == ["REMOVED", "CREATED"]
    assert all(_gone(ray, name) for name in first)  # host 0 too: no half gang left
    second = ray.get(worker.host_names.remote())
    assert second != first and not any(_gone(ray, name) for name in second)

    ray.kill(worker)  # as the pool does at a trial's deadline, then:
    assert release_slice("gang") == 1  # the live gang's group (the old one is removed)
    assert _wait_removed("gang-g") == {"REMOVED"}
    deadline = time.monotonic() + STATE_WAIT_S
    while time.monotonic() < deadline and not all(_gone(ray, n) for n in second):
        time.sleep(0.5)
    assert all(_gone(ray, name) for name in second)


def test_a_host_error_beside_a_stuck_host_fails_the_trial_and_replaces_the_gang(
    ray_up, tmp_path, made
):
    from tenantq.workers.faults import StuckSlice

    ray = ray_up
    worker = _slice(ray, StuckSlice, "stuck", tmp_path, made)
    first = ray.get(worker.host_names.remote(), timeout=300)
    began = time.monotonic()
    with pytest.raises(ValueError, match="injected failure"):  # the plan's error, not Ray's
        ray.get(worker.evaluate.remote("fail"), timeout=300)
    # bound: StuckSlice waits 2 s for the stuck host, then gives up on the gang
    assert time.monotonic() - began >= 2.0
    assert ray.get(worker.group_states.remote()) == ["REMOVED"]
    assert all(_gone(ray, name) for name in first)
    record = ray.get(worker.evaluate.remote("{}"), timeout=300).extra["slice"]
    assert record["generation"] == 2 and record["placement_groups"] == ["REMOVED", "CREATED"]


def test_past_its_gang_retries_a_slice_worker_exits_for_good_and_frees_its_groups(
    ray_up, tmp_path, made
):
    from tenantq.workers.faults import AlwaysLosingSlice
    from tenantq.workers.slice import MAX_GANG_RETRIES

    ray = ray_up
    worker = _slice(ray, AlwaysLosingSlice, "doomed", tmp_path, made)
    ray.get(worker.ping.remote(), timeout=300)
    with pytest.raises(ray.exceptions.RayActorError):  # the pool sees a lost worker
        ray.get(worker.evaluate.remote("{}"), timeout=300)
    # not restarted by Ray (a restart would start a gang the pool then kills)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(worker.ping.remote(), timeout=60)
    states = _wait_removed("doomed-g")
    assert states == {"REMOVED"}
    from ray.util import placement_group_table

    groups = [g for g in placement_group_table().values() if g["name"].startswith("doomed-g")]
    assert len(groups) == MAX_GANG_RETRIES + 1  # one gang per try


def test_a_gang_that_cannot_start_leaves_no_group(ray_up, tmp_path, made):
    from tenantq.workers.faults import FailingJoinSlice

    ray = ray_up
    worker = _slice(ray, FailingJoinSlice, "nojoin", tmp_path, made)
    with pytest.raises(ray.exceptions.RayActorError, match="cannot join"):
        ray.get(worker.ping.remote(), timeout=300)
    assert _wait_removed("nojoin-g") == {"REMOVED"}
