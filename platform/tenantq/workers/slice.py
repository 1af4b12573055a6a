"""`SliceWorker`: one trial across every host of a slice, as one worker of the pool.

A slice (a multi-host TPU topology such as v6e 4x4 = 4 hosts x 4 chips) runs one SPMD
program: one JAX process per host joined by `jax.distributed`, the engine's tensor
parallelism over every chip. The pool sees one worker per slice: a small `SliceWorker` actor
that reserves the hosts together (Ray's TPU slice placement group, `ray.util.tpu`; on CPU a
placement group of N bundles), starts one `SliceHost` per bundle, gives each the coordinator
address of the first, and sends every plan to all of them. A lost host loses the whole
program: the gang's actors are killed, its placement group removed, and the trial retried on
a fresh gang (retries keyed on Ray's ActorDiedError / NodeDiedError, as marin's fray does).
Killing the SliceWorker (the pool's deadline, a replacement) kills its hosts, whose owner it
is; its placement group is scoped to the job, so the pool removes it (`release_slice`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from tenantq.workers.host import HostWorker, TrialResult, cpu_worker_env

SLICE_KINDS = ("tpu_slice", "cpu_slice")
# How long a gang may take to be placed (all its hosts free at once) and to load the model.
GANG_START_TIMEOUT_S = 900.0
# Retries of one trial on a fresh gang after a host was lost; past them the SliceWorker exits
# and the pool replaces it (counted against its max_replacements).
MAX_GANG_RETRIES = 2
# After one host raised the trial's own error, how long the others may take to raise theirs
# (they run the same program) before the gang is presumed stuck in a collective and replaced.
STRAGGLER_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class SliceShape:
    """What one slice is: hosts, devices per host, and the Ray resources of one host."""

    kind: str
    hosts: int
    devices_per_host: int
    topology: str | None = None
    accelerator: str | None = None  # Ray's version name, e.g. "v6e"
    cpus_per_host: int = 1

    @property
    def devices(self) -> int:
        return self.hosts * self.devices_per_host


def slice_shape(spec: Any) -> SliceShape:
    """The slice of a `[workers]` table (tenantq.search.spec.WorkersSpec) of a slice kind;
    hosts and chips per host of a TPU topology come from `ray.util.tpu`."""
    if spec.kind == "cpu_slice":
        return SliceShape(
            "cpu_slice", spec.cpu_slice_hosts, spec.cpu_devices_per_host,
            cpus_per_host=spec.cpus_per_worker,
        )  # fmt: skip
    from ray.util.tpu import get_tpu_version_from_type, get_tpu_worker_resources

    per_host = getattr(spec, "tpu_chips_per_host", None)
    hosts, resources = get_tpu_worker_resources(
        spec.tpu_topology, spec.tpu_accelerator_type, chips_per_vm=per_host
    )
    version = get_tpu_version_from_type(spec.tpu_accelerator_type)
    return SliceShape(
        "tpu_slice", hosts, int(resources["TPU"]), spec.tpu_topology, version,
        cpus_per_host=int(resources.get("CPU", 1)),
    )  # fmt: skip


def slice_args(spec: Any) -> dict[str, Any]:
    """Constructor keywords the pool adds for a worker of `spec`: the slice, for slice kinds."""
    if getattr(spec, "kind", None) not in SLICE_KINDS:
        return {}
    return {"slice_shape": slice_shape(spec).__dict__}


def host_options(shape: SliceShape) -> dict[str, Any]:
    """`ActorClass.options(...)` for one host of the slice (placement strategy added later)."""
    if shape.kind == "tpu_slice":
        return {
            "num_cpus": shape.cpus_per_host,
            "resources": {"TPU": shape.devices_per_host},
            "runtime_env": {"env_vars": {"JAX_PLATFORMS": "tpu"}},
            "max_concurrency": 2,
        }
    env = cpu_worker_env(shape.cpus_per_host)
    env["XLA_FLAGS"] += f" --xla_force_host_platform_device_count={shape.devices_per_host}"
    return {
        "num_cpus": shape.cpus_per_host,
        "runtime_env": {"env_vars": env},
        "max_concurrency": 2,
    }


class SliceHost(HostWorker):
    """One host of a slice. Created light; `join` starts its JAX process in the slice's
    program, then loads the model and suite as a HostWorker does, with tp = every device of
    the slice. Its evaluators' caches live in `<cache_dir>/host-<i>`: every host must take
    the same path through them (a baseline one host loads from disk and another computes
    would leave the other waiting in a collective), and hosts start and stay in step."""

    def __init__(self, name: str, model_path: str, suite: str, **kwargs: Any) -> None:
        self._args = (name, model_path, suite)
        self._kwargs = kwargs

    def coordinator_address(self) -> str:
        """`ip:port` of a free port on this host, for `jax.distributed.initialize`."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def join(self, coordinator: str, num_processes: int, process_id: int) -> dict[str, Any]:
        import jax

        if os.environ.get("JAX_PLATFORMS") == "cpu":  # CPU collectives across processes
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator, num_processes, process_id)
        self.engine_options = {"tp": jax.device_count()}
        kwargs = dict(self._kwargs)
        kwargs["cache_dir"] = os.path.join(kwargs["cache_dir"], f"host-{process_id}")
        super().__init__(*self._args, **kwargs)
        return self.ping() | {
            "process_index": jax.process_index(),
            "devices": jax.device_count(),
            "local_devices": jax.local_device_count(),
        }


def release_slice(worker_name: str) -> int:
    """Remove every placement group the SliceWorker `worker_name` reserved and still holds.

    Ray scopes a placement group to its job, not to the actor that made it: a SliceWorker
    killed from outside (the pool's deadline, a replacement) takes its host actors with it
    (their owner) but not its groups, so the pool calls this after killing one. Returns how
    many groups were removed."""
    from ray.util import get_placement_group, placement_group_table
    from ray.util.placement_group import remove_placement_group

    removed = 0
    for info in placement_group_table().values():
        name = info.get("name") or ""
        if name.startswith(f"{worker_name}-g") and info.get("state") != "REMOVED":
            with contextlib.suppress(ValueError):
                remove_placement_group(get_placement_group(name))
                removed += 1
    return removed


class SliceWorker:
    """Ray actor body for one slice (see the module docstring); `ping` and `evaluate` as a
    HostWorker's. `host_class`: the per-host actor body (tests inject faults here)."""

    host_class: type = SliceHost
    straggler_timeout_s: float = STRAGGLER_TIMEOUT_S  # tests shorten it

    def __init__(
        self,
        name: str,
        model_path: str,
        suite: str,
        *,
        cache_dir: str,
        slice_shape: dict[str, Any],
        calibration: dict[str, Any] | None = None,
        **_pool_kwargs: Any,  # kind, cores, ...: each host takes its own from its bundle
    ) -> None:
        self.name = name
        self.shape = SliceShape(**slice_shape)
        self._host_args = (model_path, suite)
        self._host_kwargs = {
            "cache_dir": cache_dir,
            "calibration": calibration,
            "kind": "tpu" if self.shape.kind == "tpu_slice" else "cpu_slice",
        }
        self.generation = 0
        self.gang_losses = 0  # hosts lost, over this worker's life
        self._hosts: list[Any] = []
        self._group: Any = None  # SlicePlacementGroup or PlacementGroup
        self._joined: list[dict[str, Any]] = []
        self._groups_made: list[Any] = []  # every gang's placement group, for `group_states`
        release_slice(name)  # a previous life of this actor's groups (Ray scopes them to the job)
        self._start_gang()

    # ------------------------------------------------------------ the gang
    def _reserve(self):
        """The slice's placement group: Ray's TPU slice reservation, or N CPU bundles."""
        import ray
        from ray.util.placement_group import placement_group

        name = f"{self.name}-g{self.generation}"  # release_slice finds it by this prefix
        if self.shape.kind == "tpu_slice":
            from ray.util.tpu import slice_placement_group

            shape = self.shape
            group = slice_placement_group(
                shape.topology, shape.accelerator, chips_per_vm=shape.devices_per_host, name=name
            )
            pg = group.placement_group
        else:  # one node cannot STRICT_SPREAD: PACK the N hosts on what there is
            group = pg = placement_group(
                [{"CPU": self.shape.cpus_per_host}] * self.shape.hosts, strategy="PACK", name=name
            )
        self._groups_made.append(pg)
        try:
            ray.get(pg.ready(), timeout=GANG_START_TIMEOUT_S)
            if hasattr(group, "release_head_pgs"):  # the slice is chosen: its head is free
                group.release_head_pgs()
        except BaseException:
            self._release(group)
            raise
        return group, pg

    def _start_gang(self) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.generation += 1
        self._group, pg = self._reserve()
        cls = ray.remote(self.host_class)
        options = host_options(self.shape)
        self._hosts = [
            cls.options(
                name=f"{self.name}-host{i}-g{self.generation}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=i
                ),
                **options,
            ).remote(f"{self.name}-host{i}", *self._host_args, **self._host_kwargs)
            for i in range(self.shape.hosts)
        ]
        try:
            coordinator = ray.get(
                self._hosts[0].coordinator_address.remote(), timeout=GANG_START_TIMEOUT_S
            )
            joins = [
                h.join.remote(coordinator, self.shape.hosts, i) for i, h in enumerate(self._hosts)
            ]
            self._joined = ray.get(joins, timeout=GANG_START_TIMEOUT_S)
        except BaseException:
            self._stop_gang()
            raise

    def _stop_gang(self) -> None:
        """Kill every host of the gang and remove its placement group: no half gang is left
        holding chips."""
        import ray

        for host in self._hosts:
            with contextlib.suppress(ValueError, ray.exceptions.RayError):
                ray.kill(host, no_restart=True)
        self._hosts = []
        if self._group is not None:
            self._release(self._group)
        self._group = None

    @staticmethod
    def _release(group) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        with contextlib.suppress(ValueError, ray.exceptions.RayError):
            if hasattr(group, "shutdown"):
                group.shutdown()  # SlicePlacementGroup: its worker and head groups
            else:
                remove_placement_group(group)

    # ------------------------------------------------------------ the pool's surface
    def ping(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "pid": os.getpid(),
            "generation": self.generation,
            "hosts": list(self._joined),
        }

    def host_names(self) -> list[str]:
        """The live gang's actor names, host 0 first."""
        return [f"{self.name}-host{i}-g{self.generation}" for i in range(len(self._hosts))]

    def group_states(self) -> list[str]:
        """Ray's state of each gang's placement group, oldest first ("REMOVED" for a gang
        that was replaced, "CREATED" for the live one)."""
        from ray.util import placement_group_table

        return [placement_group_table(pg).get("state", "?") for pg in self._groups_made]

    def evaluate(
        self, plan_json: str, suite: str | None = None, split: str = "search"
    ) -> TrialResult:
        """Run the plan on every host; process 0's result, with the slice's memory per host.
        A lost host: the gang is replaced and the trial run again, at most MAX_GANG_RETRIES
        times; then this worker exits, so the pool sees a lost worker."""
        import ray

        lost: list[str] = []
        for _ in range(MAX_GANG_RETRIES + 1):
            if not self._hosts:
                self._start_gang()
            refs = [h.evaluate.remote(plan_json, suite, split) for h in self._hosts]
            try:
                results = self._gather(refs)
            except (ray.exceptions.ActorDiedError, ray.exceptions.NodeDiedError) as err:
                lost.append(f"gang g{self.generation}: {type(err).__name__}")
                self.gang_losses += 1
                self._stop_gang()
                continue
            lead = results[0]
            hosts = [r.memory_report.get("host") for r in results]
            if all(hosts):  # what each host's devices hold, and the slice's sum
                lead.memory_report["hosts"] = hosts
                lead.memory_report["slice_bytes"] = sum(h["bytes"] for h in hosts)
                lead.memory_report.pop("host", None)
            lead.extra["slice"] = {
                "hosts": self.shape.hosts,
                "devices": self.shape.devices,
                "generation": self.generation,
                "gangs_lost": lost,
                "host_pids": [r.pid for r in results],
                "placement_groups": self.group_states(),
                "host_bytes": [h["bytes"] for h in hosts] if all(hosts) else None,
            }
            return lead
        self._stop_gang()
        # Past the retries: leave the pool a lost worker (RayActorError), not a failed plan.
        os._exit(1)

    def _gather(self, refs: list[Any]) -> list[TrialResult]:
        """Every host's result, in order. A host lost raises Ray's error at once; a host's
        own error (the same on every host: one program) is raised once the others end."""
        import ray

        pending, done, first_error = list(refs), {}, None
        deadline = None
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not ready:  # the others are stuck in a collective the failed host left
                self._stop_gang()
                break
            for ref in ready:
                try:
                    done[ref] = ray.get(ref)
                except ray.exceptions.RayTaskError as err:
                    first_error = first_error or err
                    deadline = deadline or time.monotonic() + self.straggler_timeout_s
        if first_error is not None:
            cause = getattr(first_error, "cause", None)
            raise cause if isinstance(cause, BaseException) else first_error
        return [done[r] for r in refs]
