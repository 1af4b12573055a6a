"""The engine on a multi-host slice, simulated on CPU; run by test_slice_sharding.py.

`PROCESS_ID PORT OUT`: one of two processes (2 forced CPU devices each) joined by
`jax.distributed` (gloo collectives) into one 4-device program, as the hosts of a TPU slice
are. Each writes OUT/multi-PROCESS_ID.npz (the sliced logits and its own unsharded reference,
computed on one local device) and .json (per-device bytes, host memory, host agreement).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

# One plan quantizing weights and the KV pool: int4 weight shards with their group scales,
# fp8 keys per channel, packed int4 values, sinks.
QUANT_PLAN = {
    "rules": [{"pattern": ".*", "format": "int4", "group_size": 16}],
    "kv": {"key_format": "fp8_e4m3", "key_axis": "channel", "value_format": "int4",
           "value_axis": "token", "sink_tokens": 2},
}  # fmt: skip


REPLICATED = ("int4_g16_kv_int8_int4_sinks",)  # the plan checked on a vocabulary tp leaves whole


def main(argv: list[str]) -> None:
    process_id, port, out = int(argv[0]), int(argv[1]), Path(argv[2])
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    import numpy as np
    from _sharding_check import CAPACITY_PLANS, CAPACITY_POOL, CONFIG, engine
    from _sharding_check import static_scales as scales

    from tenantq.engine import Engine
    from tenantq.engine.sharding import device_bytes, on_every_host
    from tenantq.model.decoder import init_params
    from tenantq.quant.plan import QuantPlan

    params = init_params(CONFIG, seed=0)
    tokens = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, 12))
    logits, report = {}, {"devices": jax.device_count(), "local": jax.local_device_count()}
    for plan_name, plan in (("bf16", None), ("quant", QuantPlan.from_dict(QUANT_PLAN))):
        # tp=None: one local device, no collective: the reference each host computes alone
        for layout, eng in (("tp4", engine(params, plan, tp=4)), ("ref", engine(params, plan))):
            logits[f"{plan_name}/{layout}"] = eng.logits(tokens)
            if plan_name == "bf16":  # a prefill and one decode step, as generation runs them
                batch, first = eng.prefill(tokens.tolist(), reserve_tokens=2)
                logits[f"{plan_name}/{layout}/decode"] = eng.decode(batch, [3, 5])
                logits[f"{plan_name}/{layout}/prefill_last"] = first
                eng.release(batch)
    capacity = {}
    # 128 splits over tp=4; 130 does not (embed and lm_head whole on every device): one plan
    for vocab, names in ((CONFIG.vocab_size, CAPACITY_PLANS), (CONFIG.vocab_size + 2, REPLICATED)):
        config = dataclasses.replace(CONFIG, vocab_size=vocab)
        weights = init_params(config, seed=0)
        for name in names:
            raw = CAPACITY_PLANS[name]
            eng = Engine(config, weights, QuantPlan.from_dict(raw), dtype="bfloat16", tp=4,
                         kv_scales=scales(config), **CAPACITY_POOL)  # fmt: skip
            capacity[f"{name}/vocab{vocab}"] = {
                "weights": {p: device_bytes(v) for p, v in eng.params.items()},
                "kv": [device_bytes(layer) for layer in eng.cache.state],
                "num_pages": eng.cache.num_pages,
                "host_memory": eng.host_memory(),
                "memory_total": eng.memory_report().total_bytes,
            }
    report["capacity_tp4"] = capacity
    # Whether a cache is on disk can differ between hosts: they must agree before computing.
    report["agree"] = {
        "both": on_every_host(True),
        "one": on_every_host(process_id == 0),
        "neither": on_every_host(False),
    }
    name = f"multi-{process_id}"
    np.savez(out / f"{name}.npz", **{k.replace("/", "__"): v for k, v in logits.items()})
    (out / f"{name}.json").write_text(json.dumps(report, default=str))
    jax.distributed.shutdown()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main(sys.argv[1:])
