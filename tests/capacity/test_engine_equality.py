"""The planner predicts the engine's real allocation byte for byte (weights and KV pool).

For the same model, plan and pool size, `capacity.tensor_bytes` must equal each weight
tensor's true storage in `Engine.memory_report()`, and `capacity.kv_pool_bytes` each KV
layer's page, residual and sink bytes, read from the pool's real arrays.
"""

from __future__ import annotations

import numpy as np
import pytest

from tenantq.capacity import kv as capacity_kv
from tenantq.capacity.weights import tensor_bytes
from tenantq.engine import Engine
from tenantq.model.config import ModelConfig
from tenantq.quant.kv_calibration import KVScales
from tenantq.quant.plan import KVPlan, QuantPlan, Rule
from tenantq.reference import reference_model_path


def _reference_shape() -> ModelConfig:
    return ModelConfig.from_file(reference_model_path())  # the shipped model's shape


def _odd_shape() -> ModelConfig:
    # Odd sizes: packing pads a nibble, groups and nvfp4/MX blocks run partial.
    return ModelConfig(
        model_type="llama", vocab_size=37, hidden_size=24, intermediate_size=40,
        num_layers=3, num_heads=2, num_kv_heads=1, head_dim=12, max_position_embeddings=64,
    )  # fmt: skip


PLANS = {
    "bf16": QuantPlan(),
    "fp8 weights + fp8 kv": QuantPlan.uniform("fp8_e4m3", "fp8_e4m3"),
    "int4 mlp + int8/int4 kv, sinks, bf16 layers": QuantPlan(
        rules=(Rule("layers/.*/mlp/.*", "int4", group_size=128),),
        kv=KVPlan("int8", "channel", "int4", "token", sink_tokens=4, bf16_layers=(0, -1)),
    ),
    "nvfp4 weights + mxfp4/nvfp4 kv, per-layer override": QuantPlan(
        rules=(Rule("layers/.*", "nvfp4"), Rule(".*", "mxfp4")),
        kv=KVPlan(
            "nvfp4",
            "channel",
            "mxfp4",
            "token",
            sink_tokens=2,
            layer_formats=((1, "fp8_e5m2", "nvfp4"),),
        ),  # fmt: skip
    ),
    "W4A8: int4/g128 x int8 activations, int4 x fp8 lm_head, int8 kv": QuantPlan(
        rules=(
            Rule("layers/.*", "int4", group_size=128, activations="int8"),
            Rule("lm_head", "int4", group_size=16, activations="fp8_e4m3"),
        ),
        kv=KVPlan("int8", "channel", "int8", "token"),
    ),
    "kv axes swapped": QuantPlan(kv=KVPlan("int4", "token", "nvfp4", "channel", sink_tokens=3)),
    "static fp8 per tensor (the fp8 default)": QuantPlan.uniform("bf16", "fp8_e4m3"),
    "static int8 keys per head, int2 values per head, sinks": QuantPlan(
        kv=KVPlan(
            "int8", "head", "int2", "head", sink_tokens=2, layer_formats=((0, "int4", "bf16"),)
        )
    ),
    "int2 KIVI (keys per channel, values per token)": QuantPlan(
        kv=KVPlan("int2", "channel", "int2", "token", bf16_layers=(-1,))
    ),
    "bf16 scales and zero points: int2 KIVI, an int4/fp8 layer, sinks": QuantPlan(
        kv=KVPlan(
            "int2",
            "channel",
            "int2",
            "token",
            sink_tokens=2,
            layer_formats=((0, "int4", "fp8_e4m3"),),
            scale_dtype="bf16",
        )
    ),
    "e8m0 scales: int4 keys per channel, fp8 values per token, bf16 last layer": QuantPlan(
        kv=KVPlan("int4", "channel", "fp8_e4m3", "token", bf16_layers=(-1,), scale_dtype="e8m0")
    ),
}


def _scales(config: ModelConfig) -> KVScales:
    """Static scales from made-up statistics (their values do not change a byte)."""
    shape = (config.num_layers, config.num_kv_heads)
    per_head = {"absmax": np.full(shape, 2.0, np.float32), "min": np.full(shape, -2.0, np.float32),
                "max": np.full(shape, 2.0, np.float32), "percentile": np.ones(shape, np.float32),
                "layer_percentile": np.ones(shape[0], np.float32)}  # fmt: skip
    return KVScales("model", "data", 99.99, 0, {"keys": per_head, "values": per_head})


POOLS = [
    dict(num_pages=7, max_seqs=3, page_tokens=16),
    dict(num_pages=40, max_seqs=5, page_tokens=8),
]


@pytest.fixture(scope="module", params=["reference", "odd"])
def model(request):
    from tenantq.model.decoder import init_params

    config = _reference_shape() if request.param == "reference" else _odd_shape()
    return config, init_params(config, seed=0)


@pytest.mark.parametrize("plan_name", list(PLANS))
def test_memory_report_equals_the_planner(model, plan_name: str) -> None:
    config, params = model
    plan = PLANS[plan_name]
    for pool in POOLS:
        engine = Engine(config, params, plan, dtype="bfloat16", kv_scales=_scales(config), **pool)
        report = engine.memory_report()
        planned = {t.path: t.bytes_per_chip for t in tensor_bytes(config, plan, tp=1)}
        assert report.weight_bytes == planned
        for path, parts in report.weight_parts.items():
            assert sum(parts.values()) == report.weight_bytes[path]
        kv = capacity_kv.kv_pool_bytes(
            config, plan, pool["num_pages"], pool["max_seqs"], pool["page_tokens"]
        )
        for got, want in zip(report.kv_layers, kv["layers"], strict=True):
            assert got["pages_bytes"] == want["pages_bytes"], (plan_name, pool, got["layer"])
            assert got["residual_bytes"] == want["residual_bytes"]
            assert got["sink_bytes"] == want["sink_bytes"]
            assert got["static_bytes"] == want["static_bytes"]
        assert report.cache_bytes == kv["total_bytes"]


def test_float32_engine_stores_unquantized_kv_in_float32_and_the_planner_counts_it() -> None:
    # A float32 (parity) engine keeps bf16-format pages, residual windows and sinks in float32:
    # 4 bytes per element, not 2. The planner is told the storage dtype and must agree.
    from tenantq.model.decoder import init_params

    config = _odd_shape()
    plan = PLANS["int4 mlp + int8/int4 kv, sinks, bf16 layers"]
    pool = POOLS[0]
    report = Engine(config, init_params(config), plan, dtype="float32", **pool).memory_report()
    args = (config, plan, pool["num_pages"], pool["max_seqs"], pool["page_tokens"])
    f32 = capacity_kv.kv_pool_bytes(*args, store_dtype="float32")
    bf16 = capacity_kv.kv_pool_bytes(*args)
    assert [r["total_bytes"] for r in report.kv_layers] == [r["total_bytes"] for r in f32["layers"]]
    assert list(report.kv_layers) == f32["layers"]  # every figure, formats included
    assert report.cache_bytes == f32["total_bytes"]
    # Layer 1 quantizes (int8 keys per channel: residual; sinks for both tensors): float32
    # doubles exactly those buffers; layer 0 is a bf16 layer: its float32 pages double.
    mid32, mid16 = f32["layers"][1], bf16["layers"][1]
    assert mid32["residual_bytes"] == 2 * mid16["residual_bytes"] > 0
    assert mid32["sink_bytes"] == 2 * mid16["sink_bytes"] > 0
    assert mid32["pages_bytes"] == mid16["pages_bytes"]  # quantized pages do not change
    assert f32["layers"][0]["pages_bytes"] == 2 * bf16["layers"][0]["pages_bytes"]
