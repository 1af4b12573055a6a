"""`WorkerPool`'s own bookkeeping, with Ray's four calls (remote, wait, get, kill) replaced
by a scripted stand-in: which submission finished, which worker is idle again, when a lost
worker is replaced and when the pool gives up, and what a trial past its deadline does.

Unit tests (no cluster): the pool's behaviour with real Ray actors is covered by the search
end-to-end tests; here each outcome is chosen by the test, so each rule can fail alone.
"""

from __future__ import annotations

import sys
import types

import pytest
import ray.exceptions

from tenantq.search.spec import WorkersSpec
from tenantq.workers import pool as pool_mod
from tenantq.workers.pool import WorkerPool, WorkerStartError


class Ref:
    """An object ref whose outcome the test sets: a value, or an exception to raise."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.done = False
        self.value = None
        self.error: BaseException | None = None

    def finish(self, value=None, error: BaseException | None = None) -> None:
        self.done, self.value, self.error = True, value, error


class Method:
    def __init__(self, actor: FakeActor, name: str) -> None:
        self.actor, self.name = actor, name

    def remote(self, *args):
        ref = Ref(self.name)
        self.actor.calls.append((self.name, args, ref))
        if self.name == "ping" and self.actor.ray.auto_ping:
            ref.finish(True)
        return ref


class FakeActor:
    def __init__(self, ray, name, args, kwargs) -> None:
        self.ray, self.name, self.args, self.kwargs = ray, name, args, kwargs
        self.calls: list = []
        self.ping = Method(self, "ping")
        self.evaluate = Method(self, "evaluate")


class FakeRay(types.SimpleNamespace):
    """The part of the `ray` module the pool calls."""

    def __init__(self) -> None:
        super().__init__(exceptions=ray.exceptions)
        self.auto_ping = True
        self.actors: list[FakeActor] = []
        self.killed: list[str] = []
        self.options: list[dict] = []
        self.waits: list[tuple[int, float]] = []
        self.waited = 0.0  # seconds ray.wait spent waiting for refs that were not ready
        self.clock = [0.0]  # time.monotonic as the pool sees it: advanced by those waits
        self.classes: list[type] = []
        self.kill_error: BaseException | None = None
        self.zero_polls = 0  # unready ray.wait(timeout=0) calls in a row, the clock frozen

    def remote(self, cls):
        fake = self
        self.classes.append(cls)

        class ActorClass:
            def options(self, **opts):
                fake.options.append(opts)
                return self

            def remote(self, name, *args, **kwargs):
                actor = FakeActor(fake, name, args, kwargs)
                fake.actors.append(actor)
                return actor

        return ActorClass()

    def wait(self, refs, num_returns=1, timeout=None):
        """ray.wait's contract: at most `num_returns` ready refs; it blocks until that many
        are ready or `timeout` passes (None: for ever, which a test cannot survive)."""
        if not isinstance(num_returns, int) or not 1 <= num_returns <= len(refs):
            raise ValueError(f"num_returns={num_returns!r} for {len(refs)} refs")
        self.waits.append((num_returns, timeout))
        ready = [r for r in refs if r.done][:num_returns]
        if len(ready) < num_returns:
            if timeout is None:
                raise AssertionError("ray.wait would block for ever")
            # ray.wait(timeout=0) returns at once: a loop of them with nothing changing spins
            # a core for ever (on this frozen clock it never ends). 100 is far above any
            # test's count of legitimate polls in a row.
            self.zero_polls = self.zero_polls + 1 if timeout == 0 else 0
            if self.zero_polls > 100:
                raise AssertionError("ray.wait polled 100 times with timeout 0: a busy loop")
            self.clock[0] += timeout
            self.waited += timeout
        return ready, [r for r in refs if r not in ready]

    def get(self, ref):
        if ref.error is not None:
            raise ref.error
        return ref.value

    def kill(self, actor, no_restart=False):
        assert no_restart  # a replaced or expired actor must not come back by itself
        self.killed.append(actor.name)
        if self.kill_error is not None:
            raise self.kill_error


@pytest.fixture
def fake_ray(monkeypatch):
    fake = FakeRay()
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setattr(pool_mod.os, "getpid", lambda: 4242)
    monkeypatch.setattr(pool_mod.time, "monotonic", lambda: fake.clock[0])
    return fake


def _pool(count=2, **kwargs) -> WorkerPool:
    spec = WorkersSpec(count=count, kind="cpu", cpus_per_worker=1)
    return WorkerPool(spec, "model-dir", "suite.toml", cache_dir="cache", **kwargs)


class HostLost(ray.exceptions.RayError):
    """Ray gave up on the worker (its node died): the pool, not the plan, must act."""


def _lost() -> BaseException:
    return HostLost("node 10.0.0.7 died")


def _trial_error(message: str) -> BaseException:
    return ray.exceptions.RayTaskError(
        "evaluate", "tb", ValueError(message), proctitle="w", ip="127.0.0.1"
    )


def _evaluations(fake: FakeRay) -> list[Ref]:
    return [ref for a in fake.actors for name, _, ref in a.calls if name == "evaluate"]


def test_workers_start_one_per_slot_with_unique_names_and_their_arguments(fake_ray) -> None:
    pool = _pool(count=2, calibration={"rows": 8})
    assert pool.size == 2
    assert [a.name for a in fake_ray.actors] == [
        "tenantq-worker-4242-0-g1",
        "tenantq-worker-4242-1-g2",
    ]
    assert pool.names() == {0: "tenantq-worker-4242-0-g1", 1: "tenantq-worker-4242-1-g2"}
    first = fake_ray.actors[0]
    assert first.args == ("model-dir", "suite.toml")
    assert first.kwargs == {
        "cache_dir": "cache",
        "kind": "cpu",
        "cpus": 1,  # the worker claims its cores on its own node (workers.host.claim_cores)
        "calibration": {"rows": 8},
    }
    assert fake_ray.actors[1].kwargs["cpus"] == 1
    assert fake_ray.options[0]["namespace"] == "tenantq" and fake_ray.options[0]["num_cpus"] == 1
    assert pool.actor(1) is fake_ray.actors[1]
    assert pool.max_replacements == 4  # default: twice the workers
    assert pool.wait_ready(all_=True) == 2 and pool.idle == 2


def test_submission_outcomes_are_told_by_key_and_the_worker_is_idle_again(
    fake_ray, monkeypatch
) -> None:
    now = [50.0]
    monkeypatch.setattr(pool_mod.time, "perf_counter", lambda: now[0])
    pool = _pool(count=2)
    pool.wait_ready(all_=True)
    assert pool.submit(("trial", 0), "{plan0}") == "tenantq-worker-4242-0-g1"
    assert pool.submit(("trial", 1), "{plan1}", "confirm.toml", "confirm").endswith("-1-g2")
    assert pool.idle == 0 and pool.in_flight == 2
    assert pool.in_flight_keys() == [("trial", 0), ("trial", 1)]
    with pytest.raises(
        RuntimeError, match="^no idle worker: never submit more plans than workers$"
    ):
        pool.submit(("trial", 2), "{}")
    first, second = _evaluations(fake_ray)
    assert fake_ray.actors[1].calls[-1][1] == ("{plan1}", "confirm.toml", "confirm")
    assert fake_ray.actors[0].calls[-1][1] == ("{plan0}", None, "search")
    assert pool.wait(0.0) == []  # nothing finished yet
    now[0] = 52.5
    second.finish(error=_trial_error("plan breaks the engine"))
    (only,) = pool.wait(10.0)  # one finished: it comes back at once, the other stays
    assert only.key == ("trial", 1) and only.elapsed_s == 2.5
    assert fake_ray.waited == 0.0 and pool.in_flight == 1
    first.finish(value="result-0")
    done = {f.key: f for f in [only, *pool.wait(0.0)]}
    assert done[("trial", 0)].result == "result-0" and done[("trial", 0)].error is None
    assert done[("trial", 0)].reason is None and not done[("trial", 0)].worker_lost
    failed = done[("trial", 1)]
    assert isinstance(failed.error, ValueError) and str(failed.error) == "plan breaks the engine"
    assert failed.reason == "error" and not failed.worker_lost and failed.result is None
    assert failed.worker == "tenantq-worker-4242-1-g2"
    assert pool.idle == 2 and pool.in_flight == 0 and pool.replacements == 0
    assert fake_ray.killed == []


def test_a_lost_worker_is_replaced_in_its_slot(fake_ray) -> None:
    pool = _pool(count=1)
    pool.wait_ready()
    pool.submit("k", "{}")
    _evaluations(fake_ray)[0].finish(error=_lost())
    (done,) = pool.wait(0.0)
    assert done.worker_lost and done.reason == "worker_died" and done.key == "k"
    assert isinstance(done.error, HostLost)
    assert fake_ray.killed == ["tenantq-worker-4242-0-g1"]
    assert pool.names() == {0: "tenantq-worker-4242-0-g2"} and pool.actor(0) is fake_ray.actors[1]
    assert pool.replacements == 1 and pool.losses_in_a_row == 1
    assert pool.idle == 1  # the new worker joins once loaded


def test_the_pool_allows_exactly_max_replacements_losses_in_a_row(fake_ray) -> None:
    # Bound from the docstring: replacements are bounded by losses in a row; with a limit of
    # 2, two lost workers are replaced and the third loss stops the study.
    pool = _pool(count=1, max_replacements=2)
    pool.wait_ready()
    for n in range(2):
        assert pool.idle == 1  # the driver asks before it submits; the new worker joins
        pool.submit(n, "{}")
        _evaluations(fake_ray)[-1].finish(error=_lost())
        assert pool.wait(0.0)[0].worker_lost
        assert pool.replacements == n + 1
    assert pool.idle == 1
    pool.submit(2, "{}")
    _evaluations(fake_ray)[-1].finish(error=_lost())
    with pytest.raises(
        WorkerStartError,
        match=r"^workers lost 3 times in a row without a result \(limit 2\); "
        r"last: node 10.0.0.7 died$",
    ):
        pool.wait(0.0)
    assert pool.replacements == 2


def test_a_result_resets_the_losses_in_a_row(fake_ray) -> None:
    pool = _pool(count=1, max_replacements=1)
    pool.wait_ready()
    for outcome in ("lost", "ok", "lost", "ok"):
        assert pool.idle == 1
        pool.submit(outcome, "{}")
        ref = _evaluations(fake_ray)[-1]
        ref.finish(error=_lost()) if outcome == "lost" else ref.finish(value=1)
        pool.wait(0.0)
        assert pool.losses_in_a_row == (1 if outcome == "lost" else 0)
    assert pool.replacements == 2


def test_a_trial_past_its_deadline_is_killed_and_its_slot_restarted(fake_ray, monkeypatch) -> None:
    now = [100.0]
    monkeypatch.setattr(pool_mod.time, "perf_counter", lambda: now[0])
    pool = _pool(count=1, trial_timeout_s=30.0, max_replacements=0)
    assert pool.max_replacements == 0  # 0 is a limit, not "unset"
    pool.wait_ready()
    pool.submit("slow", "{}")
    now[0] = 110.0
    assert pool.wait(60.0) == []  # 10 s in: not yet
    assert fake_ray.waits[-1] == (1, 20.0)  # woken in time for the deadline, not after 60 s
    now[0] = 129.5
    assert pool.wait(5.0) == []
    assert fake_ray.waits[-1] == (1, 0.5)  # less than a second left: no longer a wait
    now[0] = 130.0  # exactly at the deadline
    (done,) = pool.wait(5.0)
    assert done.reason == "timeout" and done.key == "slow" and not done.worker_lost
    assert isinstance(done.error, TimeoutError)
    assert str(done.error) == "trial ran past its deadline of 30 s on tenantq-worker-4242-0-g1"
    assert done.elapsed_s == 30.0 and done.worker == "tenantq-worker-4242-0-g1"
    assert fake_ray.killed == ["tenantq-worker-4242-0-g1"]
    assert pool.names() == {0: "tenantq-worker-4242-0-g2"}
    assert pool.replacements == 0 and pool.in_flight == 0  # the plan's fault, not the pool's
    assert pool.idle == 1


def test_a_worker_that_fails_to_load_stops_the_study_naming_it(fake_ray) -> None:
    fake_ray.auto_ping = False
    pool = _pool(count=2)
    pings = [a.calls[0][2] for a in fake_ray.actors]
    pings[1].finish(True)
    assert pool.wait_ready() == 1  # the first ready worker is enough to start
    err = ray.exceptions.RayTaskError(
        "HostWorker.__init__",
        "tb",
        ValueError("no model.safetensors"),
        proctitle="w",
        ip="127.0.0.1",
    )
    pings[0].finish(error=err)
    with pytest.raises(
        WorkerStartError, match=r"tenantq-worker-4242-0-g1 failed to start: no model"
    ):
        _ = pool.idle


def test_a_worker_that_never_loads_times_out_naming_it(fake_ray) -> None:
    fake_ray.auto_ping = False
    pool = _pool(count=1)
    with pytest.raises(WorkerStartError, match=r"tenantq-worker-4242-0-g1 did not load within 0 s"):
        pool.wait_ready(timeout_s=0.0)
    assert fake_ray.waits == []  # no time left: it does not poll once more


def test_shutdown_kills_every_worker(fake_ray) -> None:
    pool = _pool(count=2)
    pool.shutdown()
    assert fake_ray.killed == ["tenantq-worker-4242-0-g1", "tenantq-worker-4242-1-g2"]


def test_the_default_worker_is_the_host_worker_and_another_class_can_stand_in(fake_ray) -> None:
    _pool(count=1)
    _pool(count=1, worker_class=FakeActor)
    assert fake_ray.classes == [pool_mod.HostWorker, FakeActor]


def test_each_worker_is_given_its_cpus_per_worker_and_ray_reserves_them(fake_ray) -> None:
    # Which cores: the worker's own node decides (claim_cores, tests/workers/test_worker_
    # startup.py), not the driver's os.cpu_count(); the pool passes the count and Ray
    # reserves it.
    spec = WorkersSpec(count=2, kind="cpu", cpus_per_worker=2)
    WorkerPool(spec, "m", "s", cache_dir="c")
    assert [a.kwargs["cpus"] for a in fake_ray.actors] == [2, 2]
    assert [o["num_cpus"] for o in fake_ray.options] == [2, 2]
    assert [o["name"] for o in fake_ray.options] == [a.name for a in fake_ray.actors]


def test_a_spec_without_cpus_per_worker_gives_each_worker_one_core(fake_ray) -> None:
    spec = types.SimpleNamespace(
        count=2, kind="gpu", gpus_per_worker=1, max_restarts=0, max_task_retries=0
    )
    WorkerPool(spec, "m", "s", cache_dir="c")
    assert [a.kwargs["cpus"] for a in fake_ray.actors] == [1, 1]


def test_loaded_workers_are_taken_in_without_waiting(fake_ray) -> None:
    fake_ray.auto_ping = False
    pool = _pool(count=3)
    pings = [a.calls[0][2] for a in fake_ray.actors]
    assert pool.idle == 0 and fake_ray.waited == 0.0  # asking never blocks
    pings[0].finish(True)
    pings[2].finish(True)
    assert pool.idle == 2 and fake_ray.waited == 0.0  # both at once, the third still loading
    pings[1].finish(True)
    assert pool.idle == 3 and pool.idle == 3


def test_wait_ready_waits_its_whole_timeout_for_a_worker(fake_ray) -> None:
    fake_ray.auto_ping = False
    pool = _pool(count=1)
    with pytest.raises(WorkerStartError, match=r"did not load within 2 s$"):
        pool.wait_ready(timeout_s=2.5)
    assert fake_ray.waited == 2.5


def test_waiting_with_nothing_in_flight_naps_briefly(fake_ray, monkeypatch) -> None:
    naps = []
    monkeypatch.setattr(pool_mod.time, "sleep", naps.append)
    pool = _pool(count=1)
    assert pool.wait(10.0) == [] and pool.wait(0.01) == []
    assert naps == [0.05, 0.01]  # a driver loop polling an idle pool does not spin nor stall


def test_only_trials_past_their_deadline_expire(fake_ray, monkeypatch) -> None:
    now = [110.0]
    monkeypatch.setattr(pool_mod.time, "perf_counter", lambda: now[0])
    pool = _pool(count=2, trial_timeout_s=30.0)
    pool.wait_ready(all_=True)
    pool.submit("recent", "{}")  # started at 110
    now[0] = 100.0
    pool.submit("old", "{}")  # started at 100
    now[0] = 130.0
    (done,) = pool.wait(1.0)
    assert done.key == "old" and pool.in_flight_keys() == ["recent"]


@pytest.mark.parametrize(
    "gone", [ValueError("actor handle is stale"), HostLost("actor already dead")]
)
def test_a_worker_already_gone_is_still_replaced(fake_ray, monkeypatch, gone) -> None:
    now = [0.0]
    monkeypatch.setattr(pool_mod.time, "perf_counter", lambda: now[0])
    fake_ray.kill_error = gone
    pool = _pool(count=1, trial_timeout_s=5.0)
    pool.wait_ready()
    pool.submit("lost", "{}")
    _evaluations(fake_ray)[-1].finish(error=_lost())
    assert pool.wait(0.0)[0].worker_lost  # ray.kill raised: replaced all the same
    assert pool.idle == 1
    pool.submit("hung", "{}")
    now[0] = 5.0
    assert pool.wait(0.0)[0].reason == "timeout"
    assert pool.names() == {0: "tenantq-worker-4242-0-g3"}


def test_a_workers_start_error_is_one_line() -> None:
    from tenantq.workers.pool import _start_error

    def task_error(cause):
        return ray.exceptions.RayTaskError("f", "tb", cause, proctitle="w", ip="127.0.0.1")

    assert _start_error(task_error(ValueError("bad\nconfig.json: no vocab_size"))) == (
        "config.json: no vocab_size"
    )
    assert _start_error(task_error(ValueError(""))) == "ValueError('')"
    died = ray.exceptions.RayActorError(
        error_msg="Traceback:\n  File x\n\nOSError: no model.safetensors\n",
        actor_init_failed=True,
    )
    assert _start_error(died) == "OSError: no model.safetensors"
    other = ray.exceptions.RayActorError(error_msg="The actor died.\nsee the raylet log")
    assert _start_error(other) == "The actor died."
    assert _start_error(HostLost("node lost\nmore")) == "node lost"
    assert _start_error(HostLost("")) == "HostLost"


def test_trials_that_finished_together_come_back_from_one_wait(fake_ray) -> None:
    # The driver tells every finished trial in one sitting: after the first ready ref, the
    # pool collects all the others already done (ray.wait with num_returns = all, timeout 0).
    pool = _pool(count=3)
    pool.wait_ready(all_=True)
    for key in ("a", "b", "c"):
        pool.submit(key, "{}")
    first, second, third = _evaluations(fake_ray)
    first.finish(value=1)
    third.finish(value=3)
    assert sorted(f.key for f in pool.wait(0.0)) == ["a", "c"]
    assert pool.in_flight == 1 and pool.in_flight_keys() == ["b"]


def test_a_slice_pool_runs_slice_workers_and_frees_each_killed_gangs_groups(
    fake_ray, monkeypatch
) -> None:
    # Ray scopes a placement group to the job, not to the SliceWorker that made it: after the
    # pool kills one (lost, past its deadline, shut down) it removes that worker's groups.
    monkeypatch.delenv(pool_mod.WORKER_CLASS_ENV, raising=False)
    released: list[str] = []
    monkeypatch.setattr(pool_mod, "release_slice", lambda name: released.append(name) or 1)
    now = [0.0]
    monkeypatch.setattr(pool_mod.time, "perf_counter", lambda: now[0])
    spec = WorkersSpec(count=1, kind="cpu_slice", cpu_slice_hosts=2, cpu_devices_per_host=4)
    pool = WorkerPool(spec, "m", "s", cache_dir="c", trial_timeout_s=10.0)
    assert fake_ray.classes == [pool_mod.SliceWorker]
    shape = fake_ray.actors[0].kwargs["slice_shape"]
    assert (shape["kind"], shape["hosts"], shape["devices_per_host"]) == ("cpu_slice", 2, 4)
    pool.wait_ready()
    pool.submit("lost", "{}")
    _evaluations(fake_ray)[-1].finish(error=_lost())
    assert pool.wait(0.0)[0].worker_lost
    assert released == ["tenantq-worker-4242-0-g1"]  # the lost gang's groups
    pool.wait_ready()
    pool.submit("slow", "{}")
    now[0] = 10.0
    assert pool.wait(1.0)[0].reason == "timeout"
    assert released[-1] == "tenantq-worker-4242-0-g2"  # the expired one's
    assert "slice_shape" in fake_ray.actors[-1].kwargs  # its replacement is a slice worker too
    pool.shutdown()
    assert released == [f"tenantq-worker-4242-0-g{g}" for g in (1, 2, 3)]


def test_a_host_pool_frees_no_placement_groups(fake_ray, monkeypatch) -> None:
    released: list[str] = []
    monkeypatch.setattr(pool_mod, "release_slice", lambda name: released.append(name) or 1)
    pool = _pool(count=1)
    assert "slice_shape" not in fake_ray.actors[0].kwargs
    pool.wait_ready()
    pool.submit("lost", "{}")
    _evaluations(fake_ray)[-1].finish(error=_lost())
    pool.wait(0.0)
    pool.shutdown()
    assert len(fake_ray.killed) == 2 and released == []
