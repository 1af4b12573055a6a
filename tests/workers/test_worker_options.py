"""Worker resources follow the host: TPU chips from ray.util.tpu, GPUs, or pinned CPU threads;
a multi-host slice is one SliceWorker over a gang of host actors.

Unit tests of the option dicts handed to `ray.remote(...).options()`; the e2e tests in
tests/search run real workers.
"""

from __future__ import annotations

import pytest

from tenantq.search.spec import WorkersSpec
from tenantq.workers.host import HostWorker, cpu_worker_env, worker_options
from tenantq.workers.pool import default_worker_class
from tenantq.workers.slice import SliceWorker, host_options, slice_args, slice_shape


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
    # v6e-8 (topology 2x4) is one host of 8 chips (Cloud TPU v6e docs); Ray's helper computes
    # it; the worker asks for that host's chips.
    one = WorkersSpec(kind="tpu", tpu_topology="2x4", tpu_accelerator_type="TPU-V6E")
    opts = worker_options(one)
    assert opts["resources"]["TPU"] == 8
    assert opts["runtime_env"]["env_vars"] == {"JAX_PLATFORMS": "tpu"}  # not the driver's cpu


def test_a_multi_host_topology_under_the_single_host_kind_is_a_one_line_error() -> None:
    # A 4x4 v6e slice is 4 hosts of 4 chips: four independent workers would each wait for
    # peers that never join the program, so the spec says which kind runs a slice.
    with pytest.raises(ValueError) as err:
        WorkersSpec(kind="tpu", tpu_topology="4x4", tpu_accelerator_type="TPU-V6E")
    message = str(err.value)
    assert "spans 4 hosts" in message and "kind = 'tpu_slice'" in message


def test_a_tpu_slice_is_one_worker_of_four_hosts_with_four_chips_each() -> None:
    spec = WorkersSpec(kind="tpu_slice", tpu_topology="4x4", tpu_accelerator_type="TPU-V6E")
    shape = slice_shape(spec)
    assert (shape.hosts, shape.devices_per_host, shape.devices) == (4, 4, 16)
    assert shape.accelerator == "v6e"
    assert host_options(shape)["resources"] == {"TPU": 4}
    assert host_options(shape)["runtime_env"]["env_vars"] == {"JAX_PLATFORMS": "tpu"}
    # the pool's actor is the SliceWorker, which holds no chips of its own
    assert worker_options(spec)["num_cpus"] == 0 and "resources" not in worker_options(spec)
    assert default_worker_class(spec) is SliceWorker
    assert slice_args(spec) == {"slice_shape": shape.__dict__}
    single = WorkersSpec(kind="tpu", tpu_topology="2x4", tpu_accelerator_type="TPU-V6E")
    assert default_worker_class(single) is HostWorker and slice_args(single) == {}


def test_a_cpu_slice_forces_its_devices_per_process() -> None:
    shape = slice_shape(WorkersSpec(kind="cpu_slice", cpu_slice_hosts=2, cpu_devices_per_host=2))
    assert (shape.hosts, shape.devices) == (2, 4)
    env = host_options(shape)["runtime_env"]["env_vars"]
    assert "--xla_force_host_platform_device_count=2" in env["XLA_FLAGS"]
    assert env["JAX_PLATFORMS"] == "cpu"


def test_a_tpu_slice_needs_its_topology() -> None:
    with pytest.raises(ValueError, match="needs tpu_topology"):
        WorkersSpec(kind="tpu_slice")


def test_a_v6e_2x4_of_two_four_chip_vms_is_a_two_host_slice() -> None:
    # v6e 2x4 is one 8-chip VM (ct6e-standard-8t) or two 4-chip VMs (ct6e-standard-4t): Ray's
    # chips_per_vm tells them apart; the single-host kind refuses the two-VM shape.
    spec = WorkersSpec(
        kind="tpu_slice", tpu_topology="2x4", tpu_accelerator_type="TPU-V6E", tpu_chips_per_host=4
    )
    shape = slice_shape(spec)
    assert (shape.hosts, shape.devices_per_host, shape.devices) == (2, 4, 8)
    with pytest.raises(ValueError, match="spans 2 hosts"):
        WorkersSpec(
            kind="tpu", tpu_topology="2x4", tpu_accelerator_type="TPU-V6E", tpu_chips_per_host=4
        )


def test_the_shipped_70b_slice_spec_budgets_the_slice_it_runs_on() -> None:
    from pathlib import Path

    from tenantq.search.spec import load_spec

    root = Path(__file__).parents[2]
    spec = load_spec(root / "experiments" / "llama-3.1-70b-v6e-2x4-slice.toml")
    shape = slice_shape(spec.workers)
    assert spec.workers.kind == "tpu_slice" and (shape.hosts, shape.devices_per_host) == (2, 4)
    assert spec.deployment.chips == shape.devices == 8


def test_a_slice_worker_is_neither_restarted_nor_retried_by_ray() -> None:
    # Its own gang retries replace Ray's: a restarted SliceWorker would reserve and load a
    # fresh gang that the pool, which saw the worker lost, then kills.
    spec = WorkersSpec(kind="cpu_slice", max_restarts=3, max_task_retries=1)
    opts = worker_options(spec)
    assert opts["max_restarts"] == 0 and opts["max_task_retries"] == 0 and opts["num_cpus"] == 0
