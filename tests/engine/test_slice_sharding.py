"""The engine on a multi-host slice: 2 processes x 2 CPU devices = one 4-device program.

`_slice_check.py` runs as a pair joined by `jax.distributed` (gloo collectives, as the hosts
of a TPU slice join theirs); JAX fixes its device count at import, hence subprocesses. One
run serves every test here. The tensor-parallel layout is the one of test_sharding.py, so
its bounds hold: a multi-host run only moves where the shards live.
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
from _slice_check import REPLICATED  # noqa: E402
from test_sharding import LOGITS_ATOL, LOGITS_RTOL  # noqa: E402

# slow; e2e: the jax.distributed coordinator binds a port (the serial xdist group)
pytestmark = [pytest.mark.slow, pytest.mark.e2e]

SCRIPT = Path(__file__).with_name("_slice_check.py")
HOSTS = ("multi-0", "multi-1")


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
            [sys.executable, str(SCRIPT), str(i), port, str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-4000:]
    runs = {n: json.loads((out / f"{n}.json").read_text()) for n in HOSTS}
    return {n: {"logits": dict(np.load(out / f"{n}.npz")), **runs[n]} for n in HOSTS}


def test_two_hosts_form_one_four_device_program(slice_run):
    for host in HOSTS:
        assert slice_run[host]["devices"] == 4 and slice_run[host]["local"] == 2


def test_sliced_logits_equal_the_unsharded_run(slice_run):
    # Bound: test_sharding.py's (float32 sums reordered, Higham's gamma_K, plus the random
    # model's measured conditioning); the multi-host all-reduce is one more reordering.
    for host in HOSTS:
        got = slice_run[host]["logits"]
        sliced = [k for k in got if "__tp4" in k]
        assert len(sliced) == 4  # bf16 logits, decode, prefill_last; the quantized plan's logits
        for key in sliced:
            ref = got[key.replace("__tp4", "__ref")]
            bound = LOGITS_ATOL + LOGITS_RTOL * float(np.abs(ref).max())
            assert float(np.abs(got[key] - ref).max()) <= bound, (host, key)
    # Every host reads the same replicated outputs, bit for bit.
    for key, got in slice_run["multi-0"]["logits"].items():
        np.testing.assert_array_equal(got, slice_run["multi-1"]["logits"][key])


def _planned(name: str, vocab: int) -> tuple[dict[str, int], list[int]]:
    """The capacity planner's bytes per chip at tp=4: each weight tensor, each KV layer."""
    import dataclasses

    from tenantq.capacity.kv import kv_pool_bytes
    from tenantq.capacity.weights import tensor_bytes
    from tenantq.quant.plan import QuantPlan

    config = dataclasses.replace(CONFIG, vocab_size=vocab)
    plan = QuantPlan.from_dict(CAPACITY_PLANS[name])
    weights = {t.path: t.bytes_per_chip for t in tensor_bytes(config, plan, tp=4)}
    pool = CAPACITY_POOL
    kv = kv_pool_bytes(config, plan, pool["num_pages"], pool["max_seqs"], pool["page_tokens"], tp=4)
    return weights, [row["total_bytes"] for row in kv["layers"]]


@pytest.mark.parametrize("vocab", [CONFIG.vocab_size, CONFIG.vocab_size + 2])
def test_planner_equals_what_every_device_of_the_slice_holds(slice_run, vocab):
    # DESIGN: capacity = the engine's real allocation, byte for byte; here per device of a
    # two-host slice (each host reports its own devices). 130 is not split by tp=4: the
    # embedding and lm_head are whole on every device of both hosts.
    for name in CAPACITY_PLANS if vocab == CONFIG.vocab_size else REPLICATED:
        weights, kv = _planned(name, vocab)
        per_host = [slice_run[h]["capacity_tp4"][f"{name}/vocab{vocab}"] for h in HOSTS]
        for path, chip_bytes in weights.items():
            held = [b for host in per_host for b in host["weights"][path].values()]
            assert held == [chip_bytes] * 4, (name, vocab, path)
        for layer, row_bytes in enumerate(kv):
            held = [b for host in per_host for b in host["kv"][layer].values()]
            assert held == [row_bytes] * 4, (name, vocab, layer)
        # host_memory: this host's two devices, the planner's per-chip sum on each
        chip = sum(weights.values()) + sum(kv)
        for i, host in enumerate(per_host):
            memory = host["host_memory"]
            assert memory["process_index"] == i and len(memory["device_bytes"]) == 2
            assert list(memory["device_bytes"].values()) == [chip, chip], (name, vocab, i)
        # the logical report (QArray.nbytes) does not depend on where the shards live
        assert per_host[0]["memory_total"] == per_host[1]["memory_total"]


def test_hosts_agree_only_when_every_host_says_yes(slice_run):
    # A cache one host has on disk and another must compute would leave the computing host
    # waiting in a collective: hosts take the cached path only if all of them can.
    for host in HOSTS:
        assert slice_run[host]["agree"] == {"both": True, "one": False, "neither": False}
