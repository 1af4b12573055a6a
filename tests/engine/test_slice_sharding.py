"""The engine on a multi-host slice: 2 processes x 2 CPU devices = one 4-device program.

`_slice_check.py` runs twice as a pair joined by `jax.distributed` (gloo collectives, as the
hosts of a TPU slice join theirs) and once as a single 4-device process; JAX fixes its
device count at import, hence subprocesses. The tensor-parallel layout is the one of
test_sharding.py, so its bounds hold: a multi-host run only moves where the shards live.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _sharding_check import CAPACITY_PLANS, CAPACITY_POOL, CONFIG  # noqa: E402
from test_sharding import LOGITS_ATOL, LOGITS_RTOL  # noqa: E402

# slow; e2e: the jax.distributed coordinator binds a port (the serial xdist group)
pytestmark = [pytest.mark.slow, pytest.mark.e2e]

SCRIPT = Path(__file__).with_name("_slice_check.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def slice_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("slice")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), "multi", str(i), port, str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    single = subprocess.run(
        [sys.executable, str(SCRIPT), "single", str(out)], env=env, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-4000:]
    assert single.returncode == 0, single.stderr[-4000:]
    names = ("multi-0", "multi-1", "single")
    runs = {n: json.loads((out / f"{n}.json").read_text()) for n in names}
    return {n: {"logits": dict(np.load(out / f"{n}.npz")), **runs[n]} for n in names}


def test_two_hosts_form_one_four_device_program(slice_run):
    for host in ("multi-0", "multi-1"):
        assert slice_run[host]["devices"] == 4 and slice_run[host]["local"] == 2


def test_sliced_logits_equal_the_single_process_tp4_and_unsharded_runs(slice_run):
    # Bound: test_sharding.py's (float32 sums reordered, Higham's gamma_K, plus the random
    # model's measured conditioning); the multi-host all-reduce is one more reordering.
    single = slice_run["single"]["logits"]
    for host in ("multi-0", "multi-1"):
        sliced = slice_run[host]["logits"]
        assert set(sliced) == {k for k in single if not k.endswith("__unsharded")}
        for key, got in sliced.items():
            refs = [key] + ([key.replace("__tp4", "__unsharded")] if key.endswith("__tp4") else [])
            for ref_key in refs:  # decode and prefill_last: against the tp=4 run only
                ref = single[ref_key]
                bound = LOGITS_ATOL + LOGITS_RTOL * float(np.abs(ref).max())
                assert float(np.abs(got - ref).max()) <= bound, (host, key, ref_key)
    # Every host reads the same replicated outputs, bit for bit.
    for key, got in slice_run["multi-0"]["logits"].items():
        np.testing.assert_array_equal(got, slice_run["multi-1"]["logits"][key])


def test_each_host_holds_half_and_the_hosts_sum_to_one_host_with_four_devices(slice_run):
    hosts = [slice_run[h]["host_memory"] for h in ("multi-0", "multi-1")]
    assert [h["process_index"] for h in hosts] == [0, 1]
    assert all(len(h["device_bytes"]) == 2 for h in hosts)
    one = slice_run["single"]["host_memory"]
    assert sum(h["bytes"] for h in hosts) == one["bytes"]
    assert sorted(b for h in hosts for b in h["device_bytes"].values()) == sorted(
        one["device_bytes"].values()
    )
    # the logical report (QArray.nbytes) does not depend on where the shards live
    assert slice_run["multi-0"]["memory_total"] == slice_run["single"]["memory_total"]


def test_planner_equals_what_every_device_of_the_slice_holds(slice_run):
    # DESIGN: capacity = the engine's real allocation, byte for byte; here per device of a
    # two-host slice (each host reports its own devices).
    from tenantq.capacity.kv import kv_pool_bytes
    from tenantq.capacity.weights import tensor_bytes
    from tenantq.quant.plan import QuantPlan

    for name, raw in CAPACITY_PLANS.items():
        plan = QuantPlan.from_dict(raw)
        planned = {t.path: t.bytes_per_chip for t in tensor_bytes(CONFIG, plan, tp=4)}
        per_host = [slice_run[h]["capacity_tp4"][name] for h in ("multi-0", "multi-1")]
        for path, chip_bytes in planned.items():
            held = [b for host in per_host for b in host["weights"][path].values()]
            assert held == [chip_bytes] * 4, (name, path)
        kv = kv_pool_bytes(
            CONFIG, plan, per_host[0]["num_pages"], CAPACITY_POOL["max_seqs"],
            CAPACITY_POOL["page_tokens"], tp=4,
        )  # fmt: skip
        for layer, row in enumerate(kv["layers"]):
            held = [b for host in per_host for b in host["kv"][layer].values()]
            assert held == [row["total_bytes"]] * 4, (name, layer)
