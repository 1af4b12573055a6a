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

    def remote(self, cls):
        fake = self

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
        self.waits.append((num_returns, timeout))
        ready = [r for r in refs if r.done][:num_returns]
        return ready, [r for r in refs if r not in ready]

    def get(self, ref):
        if ref.error is not None:
            raise ref.error
        return ref.value

    def kill(self, actor, no_restart=False):
        assert no_restart  # a replaced or expired actor must not come back by itself
        self.killed.append(actor.name)


@pytest.fixture
def fake_ray(monkeypatch):
    fake = FakeRay()
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setattr(pool_mod.os, "getpid", lambda: 4242)
    return fake


def _pool(count=2, **kwargs) -> WorkerPool:
    spec = WorkersSpec(count=count, kind="cpu", cpus_per_worker=1)
    return WorkerPool(spec, "model-dir", "suite.toml", cache_dir="cache", **kwargs)


def _lost() -> BaseException:
    return ray.exceptions.RayActorError()


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
        "cores": [0],
        "calibration": {"rows": 8},
    }
    assert fake_ray.actors[1].kwargs["cores"] == [1 % (pool_mod.os.cpu_count() or 1)]
    assert fake_ray.options[0]["namespace"] == "tenantq" and fake_ray.options[0]["num_cpus"] == 1
    assert pool.actor(1) is fake_ray.actors[1]
    assert pool.max_replacements == 4  # default: twice the workers
    assert pool.wait_ready(all_=True) == 2 and pool.idle == 2


def test_submission_outcomes_are_told_by_key_and_the_worker_is_idle_again(fake_ray) -> None:
    pool = _pool(count=2)
    pool.wait_ready(all_=True)
    assert pool.submit(("trial", 0), "{plan0}") == "tenantq-worker-4242-0-g1"
    assert pool.submit(("trial", 1), "{plan1}", "confirm.toml", "confirm").endswith("-1-g2")
    assert pool.idle == 0 and pool.in_flight == 2
    assert pool.in_flight_keys() == [("trial", 0), ("trial", 1)]
    with pytest.raises(RuntimeError, match="no idle worker"):
        pool.submit(("trial", 2), "{}")
    first, second = _evaluations(fake_ray)
    assert fake_ray.actors[1].calls[-1][1] == ("{plan1}", "confirm.toml", "confirm")
    assert fake_ray.actors[0].calls[-1][1] == ("{plan0}", None, "search")
    assert pool.wait(0.0) == []  # nothing finished yet
    second.finish(error=_trial_error("plan breaks the engine"))
    first.finish(value="result-0")
    done = {f.key: f for f in pool.wait(0.0)}
    assert done[("trial", 0)].result == "result-0" and done[("trial", 0)].error is None
    assert done[("trial", 0)].reason is None and not done[("trial", 0)].worker_lost
    failed = done[("trial", 1)]
    assert isinstance(failed.error, ValueError) and str(failed.error) == "plan breaks the engine"
    assert failed.reason == "error" and not failed.worker_lost and failed.result is None
    assert failed.worker == "tenantq-worker-4242-1-g2" and failed.elapsed_s >= 0.0
    assert pool.idle == 2 and pool.in_flight == 0 and pool.replacements == 0
    assert fake_ray.killed == []


def test_a_lost_worker_is_replaced_in_its_slot(fake_ray) -> None:
    pool = _pool(count=1)
    pool.wait_ready()
    pool.submit("k", "{}")
    _evaluations(fake_ray)[0].finish(error=_lost())
    (done,) = pool.wait(0.0)
    assert done.worker_lost and done.reason == "worker_died" and done.key == "k"
    assert isinstance(done.error, ray.exceptions.RayActorError)
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
    with pytest.raises(WorkerStartError, match=r"lost 3 times in a row .*\(limit 2\)"):
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
    pool.wait_ready()
    pool.submit("slow", "{}")
    now[0] = 110.0
    assert pool.wait(60.0) == []  # 10 s in: not yet
    assert fake_ray.waits[-1] == (1, 20.0)  # woken in time for the deadline, not after 60 s
    now[0] = 129.9
    assert pool.wait(5.0) == []
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


def test_shutdown_kills_every_worker(fake_ray) -> None:
    pool = _pool(count=2)
    pool.shutdown()
    assert fake_ray.killed == ["tenantq-worker-4242-0-g1", "tenantq-worker-4242-1-g2"]
