"""The budget's lines add up, tenants are maximal, levers compound, and failures explain."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tenantq.capacity import (
    Deployment,
    budget,
    get_model_config,
    kv_pool_bytes,
    max_context_for,
)
from tenantq.capacity.units import GiB
from tenantq.quant.plan import KVPlan, QuantPlan

LLAMA_8B = get_model_config("llama-3.1-8b")
LLAMA_70B = get_model_config("llama-3.1-70b")


def test_lines_add_up_per_chip_and_over_chips():
    # HBM - weights - reserve = pool, per chip; the all-chips columns are chips x per chip.
    dep = Deployment.of("tpu-v6e", 8)
    b = budget(LLAMA_70B, QuantPlan.uniform("fp8_e4m3", "fp8_e4m3"), dep, 32768)
    assert b.hbm_bytes_per_chip - b.weights_bytes_per_chip - b.reserve_bytes_per_chip == (
        b.pool_bytes_per_chip
    )
    assert b.weights_bytes == 8 * b.weights_bytes_per_chip
    assert b.pool_bytes == 8 * b.pool_bytes_per_chip
    assert b.pool_tokens == (b.pool_bytes_per_chip // b.page_bytes_per_chip) * 16
    # Default reserve: floor(10% of 32 GiB).
    assert b.reserve_bytes_per_chip == 32 * GiB // 10
    assert b.tenant_bytes_per_chip == b.tenant_page_bytes_per_chip + b.tenant_slot_bytes_per_chip


def test_tenants_are_the_most_that_fit():
    # tenants x tenant bytes <= pool < (tenants + 1) x tenant bytes, and the engine's pool
    # formula for that many slots and pages agrees.
    dep = Deployment.of("tpu-v6e", 8)
    plan = QuantPlan.uniform("fp8_e4m3", "fp8_e4m3")
    b = budget(LLAMA_70B, plan, dep, 32768)
    n, pages = b.tenants, 32768 // 16
    assert n > 0
    fit = kv_pool_bytes(LLAMA_70B, plan, n * pages, n, 16, tp=8)["total_bytes"]
    over = kv_pool_bytes(LLAMA_70B, plan, (n + 1) * pages, n + 1, 16, tp=8)["total_bytes"]
    assert fit <= b.pool_bytes_per_chip < over


def test_the_two_levers_compound():
    # With no reserve and page rounding set aside, pool tokens = pool bytes / KV bytes per
    # token. Weights change only the pool and the KV format only the per-token bytes, so
    # ratio(fp8, fp8) = ratio(fp8 weights, bf16 KV) x ratio(bf16 weights, fp8 KV), exactly.
    dep = Deployment.of("tpu-v6e", 1, reserve=0)

    def exact_pool_tokens(weights, kv):
        b = budget(LLAMA_8B, QuantPlan.uniform(weights, kv), dep, 8192)
        return Fraction(b.pool_bytes_per_chip) / Fraction(b.page_bytes_per_chip, b.page_tokens)

    base = exact_pool_tokens("bf16", "bf16")
    both = exact_pool_tokens("fp8_e4m3", "fp8_e4m3") / base
    weights_only = exact_pool_tokens("fp8_e4m3", "bf16") / base
    kv_only = exact_pool_tokens("bf16", "fp8_e4m3") / base
    assert both == weights_only * kv_only
    assert weights_only > 1 and kv_only > 1


def test_weights_that_do_not_fit_give_zero_tenants_and_the_reason():
    # Llama-70B in bf16 is 141 GB; one 16 GiB v5e chip cannot hold it. No exception.
    b = budget(LLAMA_70B, QuantPlan(), Deployment.of("tpu-v5e", 1), 8192)
    assert b.tenants == 0 and b.pool_bytes_per_chip == 0 and b.max_context_tokens == 0
    assert "weights alone need" in b.reason
    assert b.weights_bytes_per_chip > b.hbm_bytes_per_chip


def test_reserve_that_eats_the_pool_is_a_reason_too():
    # 8B bf16 weights are 16.06 GB; an 18.5 GB reserve on a 32 GiB (34.36 GB) chip leaves nothing.
    b = budget(LLAMA_8B, QuantPlan(), Deployment.of("tpu-v6e", 1, reserve="18.5GB"), 1024)
    assert b.tenants == 0 and "reserve" in b.reason


def test_pool_smaller_than_one_tenant_is_explained():
    # 8B bf16 on a 20 GB cpu with no reserve: ~3.9 GB of pool, a 131,072-token tenant needs 16 GiB.
    dep = Deployment.of("cpu", 1, memory_bytes="20GB", reserve=0)
    b = budget(LLAMA_8B, QuantPlan(), dep, 131072)
    assert b.tenants == 0 and "one tenant" in b.reason
    assert b.max_context_tokens > 0


@pytest.mark.parametrize("tenants", [2, 7, 40])
def test_max_context_is_the_longest_that_fits(tenants):
    # N tenants at the returned context fit; one more token (a new page) does not. (Two or
    # more: one 8B tenant could hold all 131,072 tokens, the model's cap, in the 13.8 GiB pool.)
    dep = Deployment.of("tpu-v6e", 1)
    plan = QuantPlan(kv=KVPlan("fp8_e4m3", "channel", "fp8_e4m3", "token", 4, (0, -1)))
    c = max_context_for(LLAMA_8B, plan, dep, tenants)
    pool = budget(LLAMA_8B, plan, dep, 1).pool_bytes_per_chip

    def need(context):
        return kv_pool_bytes(LLAMA_8B, plan, tenants * -(-context // 16), tenants, 16)[
            "total_bytes"
        ]

    assert 0 < c < LLAMA_8B.max_position_embeddings
    assert need(c) <= pool < need(c + 1)
    assert budget(LLAMA_8B, plan, dep, c).tenants >= tenants


def test_max_context_is_capped_by_the_model():
    # A single 8B tenant on 8 H200s has room for far more than 131,072 tokens: report the cap.
    b = budget(LLAMA_8B, QuantPlan(), Deployment.of("h200", 8), 1024)
    assert b.max_context_tokens == 131072 and b.max_context_limit == "model"


def test_context_past_the_model_limit_is_a_note_not_an_error():
    b = budget(LLAMA_8B, QuantPlan(), Deployment.of("h200", 1), 200_000)
    assert any("max_position_embeddings" in n for n in b.notes)


@settings(max_examples=25, deadline=None)
@given(
    context=st.integers(1, 140_000),
    page_tokens=st.sampled_from([1, 8, 16, 32, 256]),
    chips=st.sampled_from([1, 2, 4, 8]),
    kv=st.sampled_from(["bf16", "fp8_e4m3", "int8", "int4", "mxfp4"]),
)
def test_tenant_count_invariant(context, page_tokens, chips, kv):
    # For any deployment: tenants x tenant bytes <= pool < (tenants + 1) x tenant bytes, and
    # the per-tenant pages are ceil(context / page_tokens) in each of the 80 layers.
    dep = Deployment.of("tpu-v5p", chips, page_tokens=page_tokens)
    b = budget(LLAMA_70B, QuantPlan.uniform("fp8_e4m3", kv), dep, context)
    assert b.tenants * b.tenant_bytes_per_chip <= b.pool_bytes_per_chip
    assert (b.tenants + 1) * b.tenant_bytes_per_chip > b.pool_bytes_per_chip
    assert b.tenant_pages == 80 * -(-context // page_tokens)


def test_to_dict_has_the_issue_fields():
    d = budget(LLAMA_8B, QuantPlan(), Deployment.of("tpu-v6e", 1), 8192).to_dict()
    for key in ("weights_bytes", "kv_bytes_per_token", "pool_bytes", "pool_tokens", "tenants"):
        assert key in d
    assert d["kv_bytes_per_token"] == 131_072 and isinstance(d["kv_bytes_per_token"], int)


def test_true_is_not_a_count_of_tenants_or_of_page_tokens():
    # True is an int to Python; as a tenant count or page size it used to pass as 1 (issue 27
    # item 8 made these checks the one check_positive_int, which refuses a bool as the
    # engine's own counts always did). The message names the argument and the value given.
    dep = Deployment.of("tpu-v6e", 1)
    with pytest.raises(ValueError, match=r"^target tenants must be a positive integer, got True$"):
        budget(LLAMA_8B, QuantPlan(), dep, 4096, target_tenants=True)
    with pytest.raises(ValueError, match=r"^tenants must be a positive integer, got True$"):
        max_context_for(LLAMA_8B, QuantPlan(), dep, True)
    with pytest.raises(ValueError, match=r"^page_tokens must be a positive integer, got True$"):
        Deployment.of("tpu-v6e", 1, page_tokens=True)
