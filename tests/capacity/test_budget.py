"""The budget's lines add up, tenants are maximal, levers compound, and failures explain.

The budget of a tiny deployment, every line by hand (`make mutation TARGETS=capacity-budget`):
weights per line, pool, pages, tenants, the longest context, the reasons for 0 tenants, the
notes, the KV lines and their layer ranges, and `to_dict`. Pure Python, milliseconds each.

The tiny model (tiny_config): 2 layers, width 32, 4 query heads and 2 KV heads of 8
channels, MLP 64, vocabulary 64, context 128, untied lm_head. bf16 weights: embed and
lm_head 64*32*2 = 4,096 B each; attention per layer (32*32 + 32*16 + 32*16 + 32*32) * 2 =
6,144 B; MLP per layer 3 * 32*64 * 2 = 12,288 B; norms 5 vectors of 32 * 2 B = 320 B;
45,376 B in all. bf16 KV: a 16-token page of one layer is 2 * 16*2*8 * 2 = 1,024 B.
"""

from __future__ import annotations

import re
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
from tenantq.quant.plan import KVPlan, QuantPlan, Rule
from tenantq.testing import tiny_config

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


MEMORY, RESERVE = 1_000_000, 100_000


def _cpu(chips: int = 1, **kw) -> Deployment:
    return Deployment.of("cpu", chips, memory_bytes=kw.pop("memory", MEMORY), reserve=RESERVE, **kw)


def _raises(message: str):
    return pytest.raises(ValueError, match=f"^{re.escape(message)}$")


def test_bf16_budget_by_hand():
    # pool = 1,000,000 - 45,376 - 100,000 = 854,624 B; a page in both layers 2,048 B -> 417
    # pages, 6,672 tokens. 100 tokens = ceil(100/16) = 7 pages per layer: 14 * 1,024 =
    # 14,336 B per tenant -> 854,624 // 14,336 = 59 tenants; one tenant fits the whole
    # context of 128 (16 pages = 16,384 B), so the longest context is the model's.
    b = budget(tiny_config(), QuantPlan(), _cpu(), 100)
    assert (b.model, b.hardware, b.chips, b.context_tokens, b.page_tokens) == (
        "llama", "cpu", 1, 100, 16,
    )  # fmt: skip
    assert (b.weights_bytes_per_chip, b.weights_bytes, b.reserve_bytes_per_chip) == (
        45_376, 45_376, 100_000,
    )  # fmt: skip
    assert (b.pool_bytes_per_chip, b.pool_bytes, b.hbm_bytes_per_chip) == (854_624, 854_624, MEMORY)
    assert [(w.name, w.tensors, w.params, w.bytes_per_chip) for w in b.weight_lines] == [
        ("embed", 1, 2_048, 4_096), ("lm_head", 1, 2_048, 4_096),
        ("attention", 8, 6_144, 12_288), ("mlp", 6, 12_288, 24_576), ("norms", 5, 160, 320),
    ]  # fmt: skip
    assert (b.page_bytes_per_chip, b.kv_bytes_per_token_per_chip, b.kv_bytes_per_token) == (
        2_048, 128.0, 128.0,
    )  # fmt: skip
    assert (b.pool_pages, b.pool_tokens, b.tenant_pages) == (417, 6_672, 14)
    assert (b.tenant_page_bytes_per_chip, b.tenant_slot_bytes_per_chip) == (14_336, 0)
    assert (b.tenant_bytes_per_chip, b.tenants, b.fits) == (14_336, 59, True)
    assert (b.max_context_tokens, b.max_context_limit, b.target_tenants) == (128, "model", 1)
    assert (b.reason, b.notes, b.kv_static_bytes_per_chip) == ("", (), 0)
    assert (b.weights_summary, b.kv_summary, b.reserve) == ("bf16", "bf16", "fixed 100,000 B")
    assert b.plan_fingerprint == QuantPlan().fingerprint()
    (line,) = b.kv_lines
    assert (line.layers, line.layer_ranges, line.kind, line.window_tokens) == (
        (0, 1),
        "0-1",
        "full",
        None,
    )
    assert (line.key, line.value, line.page_bytes, line.slot_bytes, line.pages_per_tenant) == (
        "bf16", "bf16", 1_024, 0, 7,
    )  # fmt: skip


def test_longest_context_for_many_tenants():
    # 60 tenants: 60 * ceil(C/16) * 2,048 <= 854,624 -> ceil(C/16) <= 6.95 -> C = 96.
    b = budget(tiny_config(), QuantPlan(), _cpu(), 100, target_tenants=60)
    assert (b.max_context_tokens, b.max_context_limit) == (96, "memory")
    assert max_context_for(tiny_config(), QuantPlan(), _cpu(), 60) == 96
    assert max_context_for(tiny_config(), QuantPlan(), _cpu(), 1) == 128
    # 418 tenants cannot hold even one token each (one page per layer: 418 * 2,048 > pool).
    assert max_context_for(tiny_config(), QuantPlan(), _cpu(), 417) == 16
    b = budget(tiny_config(), QuantPlan(), _cpu(), 1, target_tenants=418)
    assert (b.max_context_tokens, b.max_context_limit) == (0, "memory")


@pytest.mark.parametrize("bad", [0, -3, True, 2.0])
def test_bad_counts(bad):
    config, plan, dep = tiny_config(), QuantPlan(), _cpu()
    if isinstance(bad, int) and not isinstance(bad, bool):
        message = f"context must be a positive number of tokens, got {bad}"
    else:
        message = f"context must be a whole number of tokens, got {bad!r}"
    with _raises(message):
        budget(config, plan, dep, bad)
    if not isinstance(bad, bool):
        with _raises(f"target tenants must be a positive integer, got {bad!r}"):
            budget(config, plan, dep, 8, target_tenants=bad)
        with _raises(f"tenants must be a positive integer, got {bad!r}"):
            max_context_for(config, plan, dep, bad)


def test_reasons_for_no_tenant():
    config, plan = tiny_config(), QuantPlan()
    b = budget(config, plan, _cpu(memory=45_375), 16)
    assert b.tenants == 0 and not b.fits
    assert b.reason == (
        "the weights alone need 45,376 B (44.31 KiB) per chip, more than the chip's "
        "45,375 B (44.31 KiB) of memory"
    )
    b = budget(config, plan, _cpu(memory=145_376), 16)  # weights + reserve = memory exactly
    assert b.reason == (
        "weights (45,376 B (44.31 KiB)) and the runtime reserve (100,000 B (97.66 KiB)) leave "
        "no KV pool in the chip's 145,376 B (141.97 KiB)"
    )
    # A pool of 16,383 B: one tenant at 128 tokens needs 16 pages * 1,024 B = 16,384 B.
    b = budget(config, plan, _cpu(memory=161_759), 128)
    assert (b.pool_bytes_per_chip, b.tenants) == (16_383, 0)
    assert b.reason == (
        "one tenant at 128 tokens needs 16,384 B (16.00 KiB) of KV per chip; the pool has "
        "16,383 B (16.00 KiB)"
    )
    assert budget(config, plan, _cpu(memory=161_760), 128).tenants == 1


def test_two_chips_mixed_formats_by_hand():
    # 6 layers, 3-token pages, 2 chips (one KV head each). KV int8 keys per channel, values
    # per token, 2 sink tokens, layers 3 and 4 in bf16. Per chip and layer, a quantized page
    # is keys 3*8 B + 8 float32 scales (32 B) + values 24 B + 3 scales (12 B) = 92 B and a
    # slot is the keys' bf16 residual (48 B) + sinks 2 * 2*8*2 B = 112 B; a bf16 page 96 B.
    # A page in every layer: 4 * 92 + 2 * 96 = 560 B = 186.67 B per token per chip.
    config = tiny_config(num_layers=6)
    plan = QuantPlan(
        rules=(Rule("layers/[01]/mlp/.*", "int4"), Rule("nothing", "int8"), Rule(".*", "fp8_e4m3")),
        kv=KVPlan("int8", "channel", "int8", "token", sink_tokens=2, bf16_layers=(3, 4)),
    )
    b = budget(config, plan, _cpu(2, page_tokens=3), 200, model_name="toy")
    assert (b.model, b.chips, b.page_bytes_per_chip) == ("toy", 2, 560)
    assert b.kv_bytes_per_token_per_chip == pytest.approx(560 / 3, rel=1e-15)
    assert b.kv_bytes_per_token == pytest.approx(1120 / 3, rel=1e-15)
    assert b.kv_summary == "K int8/channel, V int8/token (2 sink tokens, bf16 layers [3, 4])"
    q, f = b.kv_lines
    assert (q.layer_ranges, q.key, q.value, q.page_bytes, q.slot_bytes) == (
        "0-2,5", "int8/channel", "int8/token", 92, 112,
    )  # fmt: skip
    assert (f.layer_ranges, f.key, f.value, f.page_bytes, f.slot_bytes) == (
        "3-4",
        "bf16",
        "bf16",
        96,
        0,
    )
    assert q.pages_per_tenant == f.pages_per_tenant == 67  # ceil(200 / 3)
    assert q.parts[0] == "K elements: 24 x 1 B (int8) = 24 B per page"
    # 6 * 67 = 402 layer-pages of 67 * 560 = 37,520 B, slots 4 * 112 = 448 B.
    assert (b.tenant_pages, b.tenant_page_bytes_per_chip, b.tenant_slot_bytes_per_chip) == (
        402, 37_520, 448,
    )  # fmt: skip
    assert b.tenant_bytes_per_chip == 37_968
    assert b.tenants == b.pool_bytes_per_chip // 37_968
    assert b.pool_bytes == 2 * b.pool_bytes_per_chip
    assert b.weights_bytes == 2 * b.weights_bytes_per_chip
    mlp = next(w for w in b.weight_lines if w.name == "mlp")
    # 12 fp8 and 6 int4 MLP tensors: the most common label first.
    assert (mlp.formats, mlp.tensors, mlp.params) == ("fp8_e4m3 x12, int4/g128 x6", 18, 36_864)
    assert mlp.bytes_total == 2 * mlp.bytes_per_chip
    assert b.weights_summary == "fp8_e4m3 x38, int4/g128 x6"  # norms are not counted
    assert b.notes == (
        "context 200 exceeds the model's max_position_embeddings (128)",
        "plan rules that match no tensor: nothing",
    )
    d = b.to_dict(per_tensor=True)
    assert d["kv_bytes_per_token_per_chip"] == pytest.approx(560 / 3)
    assert [(x["layers"], x["num_layers"]) for x in d["kv_lines"]] == [("0-2,5", 4), ("3-4", 2)]
    assert d["tensors"][0] == {
        "path": "embed", "line": "embed", "shape": [64, 32], "shard_shape": [32, 32],
        "format": "fp8_e4m3", "group_size": None, "bytes_per_chip": b.tensors[0].bytes_per_chip,
    }  # fmt: skip
    assert isinstance(d["notes"], list)
    assert "tensors" not in b.to_dict()


def test_notes_static_scales_sliding_layers_and_a_whole_vocabulary():
    # Static int8 KV: keys and values each hold a 4 B scale and 8 B of clip counters per
    # layer: 2 * 2 * 12 = 48 B. A sliding layer (window 32) holds ceil(32/16) = 2 pages.
    config = tiny_config(
        layer_types=("sliding", "full"), sliding_window=32, vocab_size=65, name="t"
    )
    b = budget(config, QuantPlan.uniform("bf16", "int8"), _cpu(2), 100)
    assert (b.model, b.kv_static_bytes_per_chip, b.kv_summary) == (
        "t",
        48,
        "K int8/tensor, V int8/tensor",
    )
    assert [(k.layers, k.kind, k.window_tokens, k.pages_per_tenant) for k in b.kv_lines] == [
        ((0,), "sliding", 32, 2), ((1,), "full", None, 7),
    ]  # fmt: skip
    assert b.notes == (
        "static KV scales (tensor/head axes) are calibrated per model "
        "(tenantq.quant.kv_calibration); values beyond them clip, and the engine reports the "
        "clip rate (Engine.kv_clip_rate)",
        "1 of 2 layers are sliding-window: their KV stops growing at 32 tokens (pool tokens "
        "count a page in every layer, so tenants x context can exceed them)",
        "vocab 65 is not divisible by 2 chips: embed and lm_head are replicated whole on every "
        "chip (not padded, not sharded)",
    )
    # Static bytes come off the pool before tenants are counted.
    paged = b.pool_bytes_per_chip - 48
    assert b.tenants == paged // b.tenant_bytes_per_chip
    assert b.pool_pages == paged // b.page_bytes_per_chip
    # The same plan with every KV layer in bf16 has no static note.
    plain = QuantPlan(kv=KVPlan("int8", "tensor", "int8", "tensor", bf16_layers=(0, 1)))
    notes = budget(config, plain, _cpu(2), 100).notes
    assert not any(n.startswith("static KV scales") for n in notes)


def test_kv_summary_counts_layer_overrides():
    plan = QuantPlan(
        kv=KVPlan("bf16", "channel", "bf16", "token", layer_formats=((1, "int8", "int4"),))
    )
    b = budget(tiny_config(), plan, _cpu(), 16)
    assert b.kv_summary == "K bf16/channel, V bf16/token (1 per-layer overrides)"
    assert [k.layer_ranges for k in b.kv_lines] == ["0", "1"]


def test_longest_context_at_an_exact_fit_with_one_token_pages():
    # 1-token pages: a token in both layers is 2 * (2 * 1*2*8 * 2) = 128 B. A pool of exactly
    # 3 * 51 * 128 = 19,584 B (memory 45,376 + 100,000 + 19,584) holds 3 tenants of 51 tokens
    # with no byte to spare (52 would need 19,968): the longest context is 51, exactly.
    assert max_context_for(tiny_config(), QuantPlan(), _cpu(memory=164_960, page_tokens=1), 3) == 51
    # A pool of 3 * 128 = 384 B holds one token each and not two.
    assert max_context_for(tiny_config(), QuantPlan(), _cpu(memory=145_760, page_tokens=1), 3) == 1


def test_static_kv_bytes_are_held_once_not_per_tenant():
    # fp8 keys and values, one static scale per tensor: a 16-token page of one layer is
    # 2 * 16*2*8 * 1 = 512 B (1,024 B in both layers); static bytes once per layer: K and V
    # scales 4 B each + 2 clip counters of 4 B each = 24 B, 48 B in all. Memory 45,376 +
    # 100,000 + 48 + 2 * 4 * 1,024 = 153,616 B: 2 tenants of 64 tokens (4 pages) fit exactly.
    b = budget(tiny_config(), QuantPlan.uniform("bf16", "fp8_e4m3"), _cpu(memory=153_616), 64,
               target_tenants=2)  # fmt: skip
    assert (b.kv_static_bytes_per_chip, b.tenant_bytes_per_chip, b.tenants) == (48, 4_096, 2)
    assert (b.max_context_tokens, b.max_context_limit) == (64, "memory")


def test_weights_that_fill_the_chip_exactly_leave_no_pool_for_the_reserve():
    # Weights of 45,376 B on a chip of 45,376 B are not more than the chip; with the reserve
    # they leave no pool, and that is the reason given.
    b = budget(tiny_config(), QuantPlan(), _cpu(memory=45_376), 100)
    assert b.tenants == 0
    assert b.reason.startswith("weights (45,376 B (44.31 KiB)) and the runtime reserve")


def test_context_at_the_models_limit_gets_no_note():
    assert budget(tiny_config(), QuantPlan(), _cpu(), 128).notes == ()
    assert budget(tiny_config(), QuantPlan(), _cpu(), 129).notes == (
        "context 129 exceeds the model's max_position_embeddings (128)",
    )


def test_tied_embeddings_have_no_lm_head_line_and_keep_the_rest():
    b = budget(tiny_config(tie_word_embeddings=True), QuantPlan(), _cpu(), 100)
    assert [w.name for w in b.weight_lines] == ["embed", "attention", "mlp", "norms"]


def test_sharding_labels_on_two_chips():
    # vocab 65 is odd: 2 chips cannot split it, so embed and lm_head stay whole on each.
    lines = budget(tiny_config(vocab_size=65), QuantPlan(), _cpu(2), 100).weight_lines
    assert [(w.name, w.sharding) for w in lines] == [
        ("embed", "replicated (vocab not divisible by 2 chips)"),
        ("lm_head", "replicated (vocab not divisible by 2 chips)"),
        ("attention", "sharded over heads"), ("mlp", "sharded over MLP units"),
        ("norms", "replicated"),
    ]  # fmt: skip


def test_every_unused_rule_is_named_in_one_note():
    plan = QuantPlan(rules=(Rule("nope1", "int8"), Rule("nope2", "int8")))
    assert budget(tiny_config(), plan, _cpu(), 100).notes == (
        "plan rules that match no tensor: nope1, nope2",
    )
