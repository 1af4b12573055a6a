"""KV bytes per token, per page, per slot and per tenant, against hand arithmetic."""

from __future__ import annotations

import pytest

from tenantq.capacity import Deployment, budget, get_model_config, kv_pool_bytes
from tenantq.quant.plan import KVPlan, QuantPlan
from tenantq.storage.kv import kv_storage

V6E_1 = Deployment.of("tpu-v6e", 1)


def test_llama_70b_bf16_kv_is_327680_bytes_per_token():
    # 80 layers x 8 KV heads x 128 head_dim x 2 (K and V) x 2 bytes (bf16) = 327,680.
    b = budget(get_model_config("llama-3.1-70b"), QuantPlan(), V6E_1, 4096)
    assert b.kv_bytes_per_token == 80 * 8 * 128 * 2 * 2 == 327_680


def test_llama_8b_bf16_kv_is_131072_bytes_per_token():
    # 32 layers x 8 KV heads x 128 x 2 x 2 bytes = 131,072.
    b = budget(get_model_config("llama-3.1-8b"), QuantPlan(), V6E_1, 4096)
    assert b.kv_bytes_per_token == 32 * 8 * 128 * 2 * 2 == 131_072


def test_tensor_parallel_splits_kv_per_token_by_chips():
    # 8 chips each hold 1 of the 8 KV heads: 327,680 / 8 = 40,960 per chip; the total is unchanged.
    b = budget(get_model_config("llama-3.1-70b"), QuantPlan(), Deployment.of("tpu-v6e", 8), 4096)
    assert b.kv_bytes_per_token_per_chip == 40_960
    assert b.kv_bytes_per_token == 327_680


def test_fp8_kv_halves_elements_and_adds_exactly_its_scales():
    # fp8: 1 byte per element, half of bf16's 327,680 -> 163,840. Keys per channel: one fp32
    # scale per (head, channel) per 16-token page = 8*128*4/16 = 256 B per token per layer;
    # values per token: one fp32 scale per (token, head) = 8*4 = 32 B per token per layer.
    plan = QuantPlan(kv=KVPlan("fp8_e4m3", "channel", "fp8_e4m3", "token"))
    b = budget(get_model_config("llama-3.1-70b"), plan, V6E_1, 4096)
    assert b.kv_bytes_per_token == 327_680 // 2 + 80 * (8 * 128 * 4 // 16 + 8 * 4) == 186_880


# per layer, K and V: a float32 scale (tensor) or 8 (head), plus two int32 clip counters
STATIC_8B = [("tensor", 32 * 2 * (4 + 8)), ("head", 32 * 2 * (8 * 4 + 8))]


@pytest.mark.parametrize(("axis", "static_bytes"), STATIC_8B)
def test_static_fp8_axes_cost_no_bytes_per_token_only_their_scales_once(axis, static_bytes):
    # Llama-3.1-8B: 32 layers x 8 KV heads x 128 x 2 (K, V) x 1 B = 65,536 B/token. tensor: one
    # float32 per layer for K and V; head: one per KV head (x 8); both add the engine's two
    # int32 clip counters. Neither needs a residual window (the scale is known in advance).
    plan = QuantPlan(kv=KVPlan("fp8_e4m3", axis, "fp8_e4m3", axis))
    b = budget(get_model_config("llama-3.1-8b"), plan, V6E_1, 4096)
    assert b.kv_bytes_per_token == 65_536
    assert b.kv_static_bytes_per_chip == static_bytes
    assert b.tenant_slot_bytes_per_chip == 0
    assert b.pool_pages == (b.pool_bytes_per_chip - static_bytes) // b.page_bytes_per_chip > 0


def test_int2_kivi_bytes_by_hand():
    # Llama-70B layer, 16-token page, 8 heads x 128: codes 4 per byte = 16*8*128/4 = 4,096 B
    # per tensor. Keys per channel (the page is the group): scale + zero point float32 per
    # (head, channel) = 8*128*8 = 8,192 B; values per token in groups of 32 (KIVI's G):
    # 16*8*4 groups * 8 B = 4,096 B. Keys wait in a bf16 residual page: 16*8*128*2 = 32,768 B.
    plan = QuantPlan(kv=KVPlan("int2", "channel", "int2", "token"))
    (lay, *_) = kv_storage(get_model_config("llama-3.1-70b"), plan, 16)
    assert lay.page_bytes == 2 * 4_096 + 8_192 + 4_096
    assert lay.residual_bytes == 32_768 and lay.static_bytes == 0


def test_page_slot_and_sink_bytes_by_hand():
    # Llama-70B, fp8 KV, 4 sink tokens, layers 0 and 79 in bf16, one chip, 16-token pages.
    plan = QuantPlan(kv=KVPlan("fp8_e4m3", "channel", "fp8_e4m3", "token", 4, (0, -1)))
    pool = kv_pool_bytes(get_model_config("llama-3.1-70b"), plan, 10, 3, 16)
    first, mid, last = pool["layers"][0], pool["layers"][1], pool["layers"][79]
    # bf16 page: 16 tokens x 8 heads x 128 x 2 bytes, for K and V: 65,536; no residual, no sink.
    assert first["page_bytes"] == last["page_bytes"] == 2 * 16 * 8 * 128 * 2 == 65_536
    assert first["residual_bytes"] == first["sink_bytes"] == 0
    # fp8 page: K 16*8*128 + 8*128*4 scales, V 16*8*128 + 16*8*4 scales = 37,376.
    assert mid["page_bytes"] == 2 * 16 * 8 * 128 + 8 * 128 * 4 + 16 * 8 * 4 == 37_376
    # Per slot: bf16 residual page for the per-channel keys (16*8*128*2), and a bf16 copy of
    # 4 sink tokens of K and V (2 * 4*8*128*2); times 3 slots.
    assert mid["residual_bytes"] == 3 * 16 * 8 * 128 * 2
    assert mid["sink_bytes"] == 3 * 2 * 4 * 8 * 128 * 2
    assert mid["pages_bytes"] == 10 * 37_376
    assert mid["total_bytes"] == mid["pages_bytes"] + mid["residual_bytes"] + mid["sink_bytes"]
    assert pool["total_bytes"] == sum(r["total_bytes"] for r in pool["layers"])
    assert pool["total_bytes"] == (
        pool["pages_bytes"] + pool["residual_bytes"] + pool["sink_bytes"]
    )


def test_kv_pool_bytes_takes_per_layer_page_counts():
    # An int applies to every layer; a sequence gives each layer its own count.
    config = get_model_config("llama-3.1-8b")
    same = kv_pool_bytes(config, QuantPlan(), 7, 1, 16)
    listed = kv_pool_bytes(config, QuantPlan(), [7] * 32, 1, 16)
    assert same == listed
    with pytest.raises(ValueError, match="32 layers"):
        kv_pool_bytes(config, QuantPlan(), [7] * 31, 1, 16)


def test_page_rounding_is_per_sequence():
    # 17 tokens in 16-token pages take 2 pages in each of 32 layers: 2 * 32 * 65,536 B (bf16).
    config = get_model_config("llama-3.1-8b")
    b = budget(config, QuantPlan(), V6E_1, 17)
    assert b.tenant_pages == 2 * 32
    assert b.tenant_bytes_per_chip == 2 * 32 * 65_536
    # ...and exactly one page at 16 tokens.
    assert budget(config, QuantPlan(), V6E_1, 16).tenant_bytes_per_chip == 32 * 65_536


def test_tenant_bytes_equal_the_pool_formula():
    # The budget's per-tenant figure is kv_pool_bytes for one slot holding that tenant's pages.
    config = get_model_config("qwen3-8b")
    plan = QuantPlan(kv=KVPlan("int4", "channel", "fp8_e4m3", "token", 8, (0,)))
    dep = Deployment.of("h100-sxm", 2)
    b = budget(config, plan, dep, 5000)
    pages = -(-5000 // 16)
    one = kv_pool_bytes(config, plan, pages, 1, 16, tp=2)
    assert b.tenant_bytes_per_chip == one["total_bytes"]
    assert b.tenant_slot_bytes_per_chip == one["residual_bytes"] + one["sink_bytes"]


def test_gemma3_local_layers_stop_growing_at_the_window():
    # Gemma-3-12B: 40 sliding layers (window 1,024) and 8 global ones. Past the window only
    # the 8 global layers grow: from 2,048 to 32,768 tokens, (2048 - 128) more pages each.
    config = get_model_config("gemma-3-12b")
    at = {c: budget(config, QuantPlan(), V6E_1, c) for c in (512, 1024, 2048, 32768)}
    sliding = {c: next(k for k in b.kv_lines if k.kind == "sliding") for c, b in at.items()}
    full = {c: next(k for k in b.kv_lines if k.kind == "full") for c, b in at.items()}
    assert len(sliding[2048].layers) == 40 and len(full[2048].layers) == 8
    assert sliding[512].pages_per_tenant == 32
    assert sliding[1024].pages_per_tenant == sliding[2048].pages_per_tenant == 64
    assert sliding[32768].pages_per_tenant == 64
    assert full[32768].pages_per_tenant == 2048
    # A bf16 page of one layer: 16 tokens x 8 heads x 256 x 2 x 2 bytes = 131,072.
    page = 16 * 8 * 256 * 2 * 2
    assert full[2048].page_bytes == page
    grown = at[32768].tenant_bytes_per_chip - at[2048].tenant_bytes_per_chip
    assert grown == 8 * (2048 - 128) * page
    # Below the window every layer grows alike: 512 -> 1,024 tokens adds 32 pages in all 48.
    assert at[1024].tenant_bytes_per_chip - at[512].tenant_bytes_per_chip == 48 * 32 * page


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_residual_and_sink_bytes_per_chip_under_tensor_parallelism(tp: int):
    # Llama-3.1-8B KV (8 KV heads of 128), int8 keys per channel (residual window), int4
    # values per token, 4 sink tokens, 16-token pages. A chip holds 8/tp heads, so per slot:
    # residual = 16 tokens x 8/tp heads x 128 x 2 bytes (bf16) for the keys only:
    # 4,096 B at tp=8, not 32,768 B (the whole model's heads); sinks = 2 tensors x 4 tokens
    # x 8/tp heads x 128 x 2 bytes: 2,048 B at tp=8.
    plan = QuantPlan(kv=KVPlan("int8", "channel", "int4", "token", sink_tokens=4))
    pool = kv_pool_bytes(get_model_config("llama-3.1-8b"), plan, 0, 1, 16, tp)
    heads = 8 // tp
    for row in pool["layers"]:
        assert row["residual_bytes"] == 16 * heads * 128 * 2
        assert row["sink_bytes"] == 2 * 4 * heads * 128 * 2
    if tp == 8:
        assert pool["layers"][0]["residual_bytes"] == 4_096
        assert pool["layers"][0]["sink_bytes"] == 2_048
