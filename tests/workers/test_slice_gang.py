"""The gang of a slice worker with real Ray actors and placement groups, without a model:
hosts whose trial sleeps (tenantq.workers.faults.QuickSliceHost), so what is under test is
the gang's bookkeeping alone. One host killed mid-trial: the trial ends on a fresh gang,
the old gang's actors are gone and its placement group removed; the slice worker killed (as
the pool does at a trial's deadline): its host actors die with their owner, and its group,
which Ray scopes to the job, is removed by `release_slice`, as the pool calls it.
"""

from __future__ import annotations

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


def test_a_host_killed_mid_trial_retries_it_on_a_fresh_gang_and_frees_the_old(tmp_path):
    import ray
    from ray.util import placement_group_table

    from tenantq.workers.faults import QuickSlice
    from tenantq.workers.slice import SliceShape, release_slice

    ray.init(num_cpus=2, include_dashboard=False, namespace="tenantq", log_to_driver=False)
    try:
        shape = SliceShape("cpu_slice", hosts=2, devices_per_host=1)
        actor = ray.remote(QuickSlice).options(num_cpus=0, max_concurrency=2)
        worker = actor.remote(
            "gang", "no-model", "no-suite", cache_dir=str(tmp_path), slice_shape=vars(shape)
        )
        assert len(ray.get(worker.ping.remote(), timeout=120)["hosts"]) == 2
        first = ray.get(worker.host_names.remote())
        trial = worker.evaluate.remote("{}")
        time.sleep(1.0)  # within the hosts' 3 s trial
        ray.kill(ray.get_actor(first[1]))
        record = ray.get(trial, timeout=120).extra["slice"]
        assert record["generation"] == 2
        assert record["gangs_lost"] == ["gang g1: ActorDiedError"]
        assert record["placement_groups"] == ["REMOVED", "CREATED"]
        assert all(_gone(ray, name) for name in first)  # host 0 too: no half gang left
        second = ray.get(worker.host_names.remote())
        assert second != first and not any(_gone(ray, name) for name in second)

        ray.kill(worker)  # as the pool does at a trial's deadline, then:
        assert release_slice("gang") == 1  # the live gang's group (the old one is removed)
        deadline = time.monotonic() + STATE_WAIT_S
        while time.monotonic() < deadline:
            states = {g["state"] for g in placement_group_table().values()}
            if states == {"REMOVED"} and all(_gone(ray, n) for n in second):
                break
            time.sleep(0.5)
        assert {g["state"] for g in placement_group_table().values()} == {"REMOVED"}
        assert all(_gone(ray, name) for name in second)
    finally:
        ray.shutdown()
