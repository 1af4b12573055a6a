"""Worker resources follow the host: TPU chips from ray.util.tpu, GPUs, or pinned CPU threads.

Unit tests of the option dicts handed to `ray.remote(...).options()`; the e2e tests in
tests/search run real workers.
"""

from __future__ import annotations

from tenantq.search.spec import WorkersSpec
from tenantq.workers.host import cpu_worker_env, worker_options


def test_cpu_worker_owns_its_cores_and_limits_threads() -> None:
    opts = worker_options(WorkersSpec(count=2, kind="cpu", cpus_per_worker=1))
    assert opts["num_cpus"] == 1 and "num_gpus" not in opts
    env = opts["runtime_env"]["env_vars"]
    assert env == cpu_worker_env(1)
    assert env["JAX_PLATFORMS"] == "cpu" and "intra_op_parallelism_threads=1" in env["XLA_FLAGS"]
    assert env["OMP_NUM_THREADS"] == "1"
    # Ray restarts a dead worker; it does not re-run the trial (the study's ledger retries)
    assert opts["max_restarts"] == 2 and opts["max_task_retries"] == 0


def test_gpu_worker_requests_gpus() -> None:
    opts = worker_options(WorkersSpec(kind="gpu", gpus_per_worker=8))
    assert opts["num_gpus"] == 8
    assert opts["runtime_env"]["env_vars"] == {"JAX_PLATFORMS": "cuda"}  # not the driver's cpu


def test_tpu_worker_requests_the_chips_of_one_host() -> None:
    # v6e-8 (topology 2x4) is one host of 8 chips; a 4x4 v6e slice is 4 hosts of 4 chips
    # (Cloud TPU v6e docs). Ray's helper computes it; the worker asks for one host's chips.
    one = WorkersSpec(kind="tpu", tpu_topology="2x4", tpu_accelerator_type="TPU-V6E")
    opts = worker_options(one)
    assert opts["resources"]["TPU"] == 8
    assert opts["runtime_env"]["env_vars"] == {"JAX_PLATFORMS": "tpu"}  # not the driver's cpu
    four = WorkersSpec(kind="tpu", tpu_topology="4x4", tpu_accelerator_type="TPU-V6E")
    assert worker_options(four)["resources"]["TPU"] == 4
