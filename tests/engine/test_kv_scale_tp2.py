"""Planner == engine at tp=2 for bf16/E8M0 KV scales: each of two devices holds the planner's
per-chip bytes for every KV layer (scales and zero points sharded by KV head with the pages).

JAX fixes its device count at import, so the engine runs in a subprocess with two forced CPU
devices and prints what each device holds; the planner's figures are computed here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tenantq.capacity.kv import kv_pool_bytes
from tenantq.model.config import ModelConfig
from tenantq.quant.plan import QuantPlan

CONFIG = dict(
    model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=8, num_kv_heads=4, head_dim=16, max_position_embeddings=64,
)  # fmt: skip
POOL = dict(num_pages=6, max_seqs=3, page_tokens=8, max_seq_tokens=32)
PLANS = {
    "int2_bf16": {"kv": {"key_format": "int2", "value_format": "int2", "sink_tokens": 2,
                         "scale_dtype": "bf16"}},
    "int4_fp8_e8m0": {"kv": {"key_format": "int4", "value_format": "fp8_e4m3",
                             "scale_dtype": "e8m0", "bf16_layers": [-1]}},
}  # fmt: skip
SCRIPT = """
import json, sys
from tenantq.engine import Engine
from tenantq.engine.sharding import device_bytes
from tenantq.model.config import ModelConfig
from tenantq.model.decoder import init_params
from tenantq.quant.plan import QuantPlan
config, pool, plans = json.loads(sys.argv[1])
config = ModelConfig(**config)
params = init_params(config, seed=0)
out = {}
for name, raw in plans.items():
    eng = Engine(config, params, QuantPlan.from_dict(raw), dtype="bfloat16", tp=2, **pool)
    out[name] = {"kv": [sorted(device_bytes(layer).values()) for layer in eng.cache.state],
                 "num_pages": eng.cache.num_pages}
print(json.dumps(out))
"""


@pytest.mark.slow  # a subprocess that imports JAX and builds two sharded engines
def test_each_of_two_devices_holds_the_planners_kv_bytes():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu")  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps([CONFIG, POOL, PLANS])],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    held = json.loads(done.stdout.strip().splitlines()[-1])
    config = ModelConfig(**CONFIG)
    for name, raw in PLANS.items():
        plan = QuantPlan.from_dict(raw)
        assert held[name]["num_pages"] == POOL["num_pages"]
        kv = kv_pool_bytes(config, plan, POOL["num_pages"], POOL["max_seqs"],
                           POOL["page_tokens"], tp=2)  # fmt: skip
        for layer, (per_device, row) in enumerate(zip(held[name]["kv"], kv["layers"], strict=True)):
            assert per_device == [row["total_bytes"]] * 2, (name, layer)
        # the scale dtype changed the bytes (2 B or 1 B scales, not 4 B): a float32 plan differs
        plain = QuantPlan.from_dict({"kv": {**raw["kv"], "scale_dtype": "float32"}})
        f32 = kv_pool_bytes(config, plain, POOL["num_pages"], POOL["max_seqs"],
                            POOL["page_tokens"], tp=2)  # fmt: skip
        assert f32["layers"][0]["total_bytes"] > kv["layers"][0]["total_bytes"]
