"""The engine on a multi-host slice, simulated on CPU; run by test_slice_sharding.py.

`multi PROCESS_ID PORT OUT`: one of two processes (2 forced CPU devices each) joined by
`jax.distributed` (gloo collectives) into one 4-device program, as the hosts of a TPU slice
are; writes OUT/multi-PROCESS_ID.npz (logits) and .json (per-device bytes, host memory).
`single OUT`: one process with 4 forced devices, the tp=4 and unsharded references.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

MODES = ("multi", "single")


def main(argv: list[str]) -> None:
    mode = argv[0]
    if mode not in MODES:
        sys.exit(f"mode {mode!r}: valid {MODES}")
    devices = 2 if mode == "multi" else 4
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    if mode == "multi":
        process_id, port, out = int(argv[1]), int(argv[2]), Path(argv[3])
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
        name = f"multi-{process_id}"
    else:
        out, name = Path(argv[1]), "single"
    import numpy as np
    from _sharding_check import CAPACITY_PLANS, CAPACITY_POOL, CONFIG, PLANS, engine
    from _sharding_check import static_scales as scales

    from tenantq.engine import Engine
    from tenantq.engine.sharding import device_bytes
    from tenantq.model.decoder import init_params
    from tenantq.quant.plan import QuantPlan

    params = init_params(CONFIG, seed=0)
    tokens = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, 12))
    logits, report = {}, {"devices": jax.device_count(), "local": jax.local_device_count()}
    for plan_name in ("bf16", "int4", "kv_fp8_int4"):
        sharded = engine(params, PLANS[plan_name], tp=4)
        logits[f"{plan_name}/tp4"] = sharded.logits(tokens)
        if mode == "single":  # the unsharded reference, once
            logits[f"{plan_name}/unsharded"] = engine(params, PLANS[plan_name]).logits(tokens)
        if plan_name == "bf16":  # a prefill and one decode step, as generation runs them
            batch, first = sharded.prefill(tokens.tolist(), reserve_tokens=2)
            logits["bf16/tp4/decode"] = sharded.decode(batch, [3, 5])
            logits["bf16/tp4/prefill_last"] = first
            sharded.release(batch)
        if plan_name == "int4":
            report["host_memory"] = sharded.host_memory()
            report["memory_total"] = sharded.memory_report().total_bytes
    capacity = {}
    for plan_name, raw in CAPACITY_PLANS.items():
        eng = Engine(CONFIG, params, QuantPlan.from_dict(raw), dtype="bfloat16", tp=4,
                     kv_scales=scales(CONFIG), **CAPACITY_POOL)  # fmt: skip
        capacity[plan_name] = {
            "weights": {p: device_bytes(v) for p, v in eng.params.items()},
            "kv": [device_bytes(layer) for layer in eng.cache.state],
            "num_pages": eng.cache.num_pages,
        }
    report["capacity_tp4"] = capacity
    np.savez(out / f"{name}.npz", **{k.replace("/", "__"): v for k, v in logits.items()})
    (out / f"{name}.json").write_text(json.dumps(report, default=str))
    if mode == "multi":
        jax.distributed.shutdown()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main(sys.argv[1:])
