"""`HostWorker`: one Ray actor per accelerator host, holding one `Evaluator` per suite.

Resources follow the host: `{"TPU": chips_per_host}` from `ray.util.tpu` on a TPU host,
`num_gpus` on a GPU, otherwise CPU cores, with XLA's and BLAS's threads limited to the
worker's share and the process pinned to cores it claims on its own node (a lock file per
core, held for the actor's life), so two CPU workers on two cores run side by side instead of
fighting, whatever node each lands on. Only workers open accelerators; the driver stays on CPU.
A worker checks at start that it can read the model, and names its node and the path if not.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Where workers keep compiled executables: `<cache_dir>/xla` unless this names a folder (the
# test suite shares one across its studies; several studies may share one the same way).
XLA_CACHE_ENV = "TENANTQ_XLA_CACHE_DIR"
# Where CPU workers of one node claim their cores (one lock file per core; the kernel drops a
# dead worker's locks with its process).
CORE_LOCK_DIR_ENV = "TENANTQ_CORE_LOCK_DIR"


class ModelUnreadableError(RuntimeError):
    """The worker's node cannot read the model: every trial there would fail the same way."""


def node_name() -> str:
    """This worker's node as Ray names it (its IP and id), or the host name outside Ray."""
    try:
        import ray

        ctx = ray.get_runtime_context()
        return f"{ray.util.get_node_ip_address()} (node {ctx.get_node_id()[:12]})"
    except Exception:  # not in a Ray worker
        return socket.gethostname()


def check_model_readable(model_path: str) -> None:
    """One line naming the node and the path when this node cannot read the model folder:
    on a cluster the model lives on a shared read-only volume mounted at the same path on
    every node (cluster/README.md, "Shared model volume")."""
    folder = Path(model_path)
    config = folder / "config.json"
    try:
        with config.open("rb") as f:
            f.read(1)
        weights = sorted(folder.glob("*.safetensors"))
        if not weights:
            raise FileNotFoundError(f"no *.safetensors in {folder}")
        with weights[0].open("rb") as f:
            f.read(1)
    except OSError as err:
        reason = err.strerror or str(err)
        raise ModelUnreadableError(
            f"node {node_name()} cannot read the model at {folder} ({reason}); mount the "
            "shared model volume at this path on every worker node"
        ) from None


def claim_cores(cpus: int, lock_dir: Path | None = None) -> tuple[list[int], list[int]]:
    """The first `cpus` cores of this process's affinity that no other worker on this node
    holds, and the lock file descriptors that hold them (kept open for the actor's life).
    ([], []) when every core is taken: the worker then runs unpinned."""
    folder = lock_dir or Path(
        os.environ.get(CORE_LOCK_DIR_ENV) or f"/tmp/tenantq-cores-{os.getuid()}"
    )
    folder.mkdir(parents=True, exist_ok=True)
    got: list[int] = []
    fds: list[int] = []
    for core in sorted(os.sched_getaffinity(0)):
        fd = os.open(folder / f"core-{core}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        got.append(core)
        fds.append(fd)
        if len(got) == cpus:
            return got, fds
    for fd in fds:
        os.close(fd)
    return [], []


@dataclass
class TrialResult:
    """What a worker returns for one plan: plain data and one Arrow table."""

    summary: dict[str, Any]
    gates: dict[str, dict[str, Any]]
    timings_s: dict[str, float]
    memory_report: dict[str, Any]
    examples: Any = None  # pyarrow.Table, one row per example
    worker: str = ""
    pid: int = 0
    evaluator_load_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def cpu_worker_env(cpus: int) -> dict[str, str]:
    """Environment that keeps a CPU worker's XLA and BLAS to `cpus` threads."""
    return {
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads={cpus}",
        "OMP_NUM_THREADS": str(cpus),
        "OPENBLAS_NUM_THREADS": str(cpus),
        "MKL_NUM_THREADS": str(cpus),
    }


def worker_options(spec: Any) -> dict[str, Any]:
    """`ActorClass.options(...)` for one host worker; `spec` has the fields of the study
    spec's `[workers]` table (tenantq.search.spec.WorkersSpec)."""
    opts: dict[str, Any] = {
        "max_restarts": spec.max_restarts,
        "max_task_retries": spec.max_task_retries,
        "max_concurrency": 2,  # a health probe may run beside a trial
    }
    if spec.kind.endswith("_slice"):
        # A SliceWorker only coordinates the actors of its slice's hosts (tenantq.workers.slice),
        # which hold the chips; it holds nothing itself. No Ray restart and no Ray retry: a
        # lost gang is retried by the slice worker itself, and a slice worker that exits has
        # given up; the pool replaces it (a restart would start a gang the pool then kills).
        opts["num_cpus"] = 0
        opts["max_restarts"] = opts["max_task_retries"] = 0
    elif spec.kind == "tpu":
        from ray.util.tpu import get_tpu_worker_resources

        _, resources = get_tpu_worker_resources(spec.tpu_topology, spec.tpu_accelerator_type)
        opts["resources"] = {k: v for k, v in resources.items() if k != "CPU"}
        opts["num_cpus"] = resources.get("CPU", 1)
        # The driver runs with JAX_PLATFORMS=cpu and a local raylet passes its environment on:
        # a device worker names its platform itself.
        opts["runtime_env"] = {"env_vars": {"JAX_PLATFORMS": "tpu"}}
    elif spec.kind == "gpu":
        opts["num_gpus"] = spec.gpus_per_worker
        opts["num_cpus"] = 1
        opts["runtime_env"] = {"env_vars": {"JAX_PLATFORMS": "cuda"}}
    else:
        opts["num_cpus"] = spec.cpus_per_worker
        opts["runtime_env"] = {"env_vars": cpu_worker_env(spec.cpus_per_worker)}
    return opts


class HostWorker:
    """Ray actor body (wrapped with `ray.remote` by the pool). Holds the host's evaluators."""

    # Options for the evaluators' engines (a slice host sets tp to the slice's device count).
    engine_options: dict[str, Any] | None = None

    def __init__(
        self,
        name: str,
        model_path: str,
        suite: str,
        *,
        cache_dir: str,
        kind: str = "cpu",
        cores: list[int] | None = None,
        calibration: dict[str, Any] | None = None,
        cpus: int | None = None,
    ) -> None:
        check_model_readable(model_path)
        self._core_locks: list[int] = []
        if kind == "cpu" and cpus and not cores and hasattr(os, "sched_setaffinity"):
            cores, self._core_locks = claim_cores(cpus)  # this node's cores, not the driver's
        if kind == "cpu" and cores and hasattr(os, "sched_setaffinity"):
            usable = os.sched_getaffinity(0)
            pinned = {c for c in cores if c in usable}
            if pinned:
                os.sched_setaffinity(0, pinned)
        self.name = name
        self.model_path = model_path
        self.cache_dir = Path(cache_dir)
        self.default_suite = suite
        self.calibration = calibration  # CalibrationData fields; None: its defaults
        self._evaluators: dict[tuple[str, str], Any] = {}
        self._load_s: dict[tuple[str, str], float] = {}
        _persistent_compilation_cache(Path(os.environ.get(XLA_CACHE_ENV) or self.cache_dir / "xla"))
        self._evaluator(suite, "search")  # load the model, data and baseline once, at start

    def _evaluator(self, suite: str, split: str):
        key = (suite, split)
        if key not in self._evaluators:
            from tenantq.evals import Evaluator, load_suite
            from tenantq.evals.calibrated import CalibrationData

            start = time.perf_counter()
            self._evaluators[key] = Evaluator(
                self.model_path,
                load_suite(suite).with_split(split),
                cache_dir=self.cache_dir,
                engine_options=self.engine_options,
                calibration=CalibrationData(**self.calibration) if self.calibration else None,
            )
            self._load_s[key] = time.perf_counter() - start
        return self._evaluators[key]

    def ping(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "pid": os.getpid(),
            "cores": sorted(os.sched_getaffinity(0)),
            "node": node_name(),
        }

    def evaluate(
        self, plan_json: str, suite: str | None = None, split: str = "search"
    ) -> TrialResult:
        """Run the suite on `plan_json` (a QuantPlan's JSON); exceptions propagate to Ray.
        `split="confirm"` draws the suite's held-out examples the search never saw."""
        from tenantq.quant.plan import QuantPlan

        plan = QuantPlan.from_json(plan_json)
        key = (suite or self.default_suite, split)
        result = self._evaluator(*key).evaluate(plan)
        return TrialResult(
            summary=dict(result.summary),
            gates={name: gate.as_dict() for name, gate in result.gates.items()},
            timings_s={k: float(v) for k, v in result.timings_s.items()},
            memory_report=_plain(result.memory_report),
            examples=result.examples,
            worker=self.name,
            pid=os.getpid(),
            evaluator_load_s=self._load_s.get(key, 0.0),
        )


def _persistent_compilation_cache(folder: Path) -> None:
    """Share compiled executables across trials, workers and runs: a plan whose layout was
    compiled before (same formats and shapes) loads its executable instead of compiling."""
    import jax

    folder.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder.resolve()))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if hasattr(value, "to_dict"):
        return _plain(value.to_dict())
    return value
