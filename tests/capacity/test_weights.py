"""Weight bytes per chip, per tensor, in the plan's formats, against independent arithmetic.

Capacity byte arithmetic that the budget tests leave unpinned (found by `make mutation
TARGETS=capacity-bytes`): sharding labels, a static W8A8 scale's 4 bytes, the store dtype of
unquantized KV, and the one-line errors for impossible counts. Expected bytes by hand on the
tiny model (2 layers, 2 KV heads of 8, 16-token pages).
"""

from __future__ import annotations

import math

import pytest

from tenantq.capacity import PRESETS, Deployment, budget, get_model_config
from tenantq.capacity.kv import kv_pool_bytes, pool_bytes_from_layers, tenant_pages
from tenantq.capacity.weights import sharding_label, tensor_bytes
from tenantq.numerics import storage_nbytes
from tenantq.quant.plan import STATIC_ACT_SCALE_BYTES, KVPlan, QuantPlan, Rule
from tenantq.storage.kv import kv_storage
from tenantq.testing import tiny_config

V6E = Deployment.of("tpu-v6e", 1)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_bf16_weights_are_two_bytes_per_parameter(name):
    # bf16 stores 2 bytes per element, no scales: weights = 2 x parameters on one chip.
    config = get_model_config(name)
    b = budget(config, QuantPlan(), V6E, 1024)
    assert b.weights_bytes_per_chip == b.weights_bytes == 2 * config.param_count()
    assert sum(w.bytes_per_chip for w in b.weight_lines) == b.weights_bytes_per_chip


def test_tied_embeddings_are_counted_once():
    # Gemma 3 ties lm_head to the embedding: no lm_head line, the vocab x hidden matrix once.
    b = budget(get_model_config("gemma-3-12b"), QuantPlan(), V6E, 1024)
    names = [w.name for w in b.weight_lines]
    assert "lm_head" not in names
    embed = next(w for w in b.weight_lines if w.name == "embed")
    assert embed.bytes_per_chip == 262_208 * 3840 * 2


def _fp8_linear(rows: int, cols: int) -> int:
    # [in, out] quantized along axis 0 (one fp32 scale per output column): data + 4 B x out.
    return rows * cols + 4 * cols


def test_fp8_weights_by_hand_llama_8b():
    # Every linear and the embedding in fp8 with per-channel fp32 scales; norms bf16.
    c = get_model_config("llama-3.1-8b")
    h, i, v, q, kv = 4096, 14336, 128256, 32 * 128, 8 * 128
    layer = (
        _fp8_linear(h, q)
        + 2 * _fp8_linear(h, kv)
        + _fp8_linear(q, h)
        + 2 * _fp8_linear(h, i)
        + _fp8_linear(i, h)
        + 2 * h * 2  # two RMSNorm weights, bf16
    )
    embed = v * h + 4 * v  # [vocab, hidden] scaled along hidden: one scale per row
    expected = c.num_layers * layer + embed + _fp8_linear(h, v) + h * 2
    b = budget(c, QuantPlan.uniform("fp8_e4m3", "bf16"), V6E, 1024)
    assert b.weights_bytes_per_chip == expected


def test_int4_packing_padding_and_partial_groups(tiny):
    # int4, group 4 along axis 0, on odd shapes. A [rows, cols] linear stores rows x ceil(cols/2)
    # packed bytes (two nibbles per byte, odd cols padded) + ceil(rows/4) x cols fp32 scales.
    config = tiny()  # vocab 11, hidden 8, intermediate 13, q 8, kv 4, 2 layers, untied
    plan = QuantPlan(rules=(Rule(".*", "int4", group_size=4),))

    def lin(rows, cols):
        return rows * math.ceil(cols / 2) + math.ceil(rows / 4) * cols * 4

    by_path = {t.path: t.bytes_per_chip for t in tensor_bytes(config, plan)}
    assert by_path["layers/0/mlp/up_proj"] == lin(8, 13) == 8 * 7 + 2 * 13 * 4
    assert by_path["layers/0/mlp/down_proj"] == lin(13, 8) == 13 * 4 + 4 * 8 * 4
    assert by_path["layers/1/attn/k_proj"] == lin(8, 4)
    # Embedding [11, 8] scaled along axis 1 in groups of 4: 11 x 4 bytes + 11 x 2 scales x 4 B.
    assert by_path["embed"] == 11 * 4 + 11 * 2 * 4
    assert by_path["lm_head"] == lin(8, 11)
    assert by_path["final_norm"] == 8 * 2


def test_asymmetric_int4_adds_one_zero_point_byte_per_scale(tiny):
    # symmetric=False stores an int8 zero point next to every scale (numerics' layout).
    config = tiny()
    sym = tensor_bytes(config, QuantPlan(rules=(Rule(".*", "int4", group_size=4),)))
    asym = tensor_bytes(
        config, QuantPlan(rules=(Rule(".*", "int4", group_size=4, symmetric=False),))
    )
    up = {t.path: t.bytes_per_chip for t in sym}["layers/0/mlp/up_proj"]
    up_asym = {t.path: t.bytes_per_chip for t in asym}["layers/0/mlp/up_proj"]
    assert up_asym - up == 2 * 13  # ceil(8/4) groups x 13 columns, 1 byte each


def test_sharding_splits_columns_rows_and_vocab_and_replicates_norms():
    # Llama-70B on 8 chips, bf16: attention and MLP split exactly 8 ways, norms whole on every
    # chip, embedding and lm_head split over the vocabulary (128,256 / 8 = 16,032 rows).
    c = get_model_config("llama-3.1-70b")
    one = {w.name: w for w in budget(c, QuantPlan(), V6E, 1024).weight_lines}
    eight = budget(c, QuantPlan(), Deployment.of("tpu-v6e", 8), 1024)
    lines = {w.name: w for w in eight.weight_lines}
    for name in ("attention", "mlp", "embed", "lm_head"):
        assert lines[name].bytes_per_chip * 8 == one[name].bytes_per_chip
    assert lines["norms"].bytes_per_chip == one["norms"].bytes_per_chip
    assert lines["norms"].bytes_total == 8 * one["norms"].bytes_per_chip
    assert lines["embed"].bytes_per_chip == 16_032 * 8192 * 2
    shards = {t.path: t.shard_shape for t in eight.tensors}
    assert shards["layers/0/attn/q_proj"] == (8192, 1024)  # columns split (heads)
    assert shards["layers/0/attn/o_proj"] == (1024, 8192)  # rows split
    assert shards["layers/0/mlp/down_proj"] == (3584, 8192)
    assert shards["lm_head"] == (8192, 16_032)


def test_row_sharded_fp8_keeps_a_full_scale_row_on_each_chip():
    # o_proj [8192, 8192] split by rows over 8 chips: each chip stores 1024 x 8192 fp8 values
    # and its own per-column scale row of 8192 fp32 (scales reduce over the rows it holds).
    c = get_model_config("llama-3.1-70b")
    tensors = tensor_bytes(c, QuantPlan.uniform("fp8_e4m3", "bf16"), 8)
    o = next(t for t in tensors if t.path == "layers/0/attn/o_proj")
    assert o.bytes_per_chip == 1024 * 8192 + 8192 * 4


def test_vocab_not_divisible_by_chips_is_replicated(tiny):
    # vocab 11 over 2 chips: NamedSharding needs even shards, so the engine keeps the whole
    # 11 x 8 bf16 embedding on each chip; the planner counts what the engine holds.
    tensors = tensor_bytes(tiny(num_kv_heads=2, intermediate_size=14), QuantPlan(), 2)
    embed = next(t for t in tensors if t.path == "embed")
    assert embed.shard_shape == (11, 8) and embed.bytes_per_chip == 11 * 8 * 2
    even = tensor_bytes(tiny(num_kv_heads=2, intermediate_size=14, vocab_size=12), QuantPlan(), 2)
    assert next(t for t in even if t.path == "embed").shard_shape == (6, 8)


def test_plan_rules_pick_formats_per_tensor():
    # MLP in int4 (g128), the rest fp8, embeddings left bf16 by an earlier rule.
    plan = QuantPlan(
        rules=(
            Rule("embed|lm_head", "bf16"),
            Rule("layers/.*/mlp/.*", "int4", group_size=128),
            Rule(".*", "fp8_e4m3"),
        )
    )
    b = budget(get_model_config("llama-3.1-8b"), plan, V6E, 1024)
    lines = {w.name: w.formats for w in b.weight_lines}
    assert lines == {
        "embed": "bf16",
        "lm_head": "bf16",
        "attention": "fp8_e4m3",
        "mlp": "int4/g128",
        "norms": "bf16",
    }


def test_sharding_labels_say_how_each_line_is_laid_out():
    assert sharding_label("embed", 1, False) == "whole (1 chip)"
    assert sharding_label("mlp", 1, False) == "whole (1 chip)"
    assert sharding_label("embed", 2, False) == "sharded over vocab"
    assert sharding_label("lm_head", 3, True) == "replicated (vocab not divisible by 3 chips)"
    assert sharding_label("attention", 2, False) == "sharded over heads"
    assert sharding_label("norms", 2, False) == "replicated"


def test_a_static_activation_scale_adds_one_float32_per_tensor():
    # Static W8A8 keeps one calibrated float32 activation scale per linear input (4 bytes,
    # replicated on every chip) on top of the weight's own storage.
    assert STATIC_ACT_SCALE_BYTES == 4
    config = tiny_config()
    rule = dict(pattern="layers/0/mlp/up_proj", format="int8", activations="int8")
    dynamic = QuantPlan(rules=(Rule(**rule),))
    static = QuantPlan(rules=(Rule(**rule, activation_scale="static"),))
    shape = config.tensors()["layers/0/mlp/up_proj"].shape
    want = storage_nbytes(shape, "int8", axis=0)
    for plan, extra in ((dynamic, 0), (static, 4)):
        by_path = {t.path: t.bytes_per_chip for t in tensor_bytes(config, plan)}
        assert by_path["layers/0/mlp/up_proj"] == want + extra


def test_a_bad_chip_count_names_chip_counts():
    with pytest.raises(ValueError) as err:
        tensor_bytes(tiny_config(), QuantPlan(), 3)  # 4 heads, 2 KV heads: 3 splits nothing
    assert str(err.value).endswith(": valid chip counts are 1, 2")


def test_unquantized_kv_is_stored_in_the_engines_dtype():
    # int8 keys per channel wait in a residual page of the store dtype: 16 tokens x 2 heads
    # x 8 dims per slot and layer = 256 values: 512 B in bfloat16, 1,024 B in float32.
    config = tiny_config()
    plan = QuantPlan(kv=KVPlan("int8"))
    for dtype, per_value in (("bfloat16", 2), ("float32", 4)):
        pool = kv_pool_bytes(config, plan, 0, 1, 16, store_dtype=dtype)
        assert pool["residual_bytes"] == 2 * 16 * 2 * 8 * per_value, dtype


def test_impossible_counts_are_refused():
    config = tiny_config()
    layers = kv_storage(config, QuantPlan(kv=KVPlan("int8", sink_tokens=4)), 16, 1)
    assert pool_bytes_from_layers(layers, 0, 0)["total_bytes"] == 0  # zero is allowed
    for pages, slots in ((-1, 0), (0, -1), ([1, -1], 0)):
        with pytest.raises(ValueError) as err:
            pool_bytes_from_layers(layers, pages, slots)
        assert str(err.value) == "page and slot counts must not be negative"
    for context in (0, -5, "8", 8.0):
        with pytest.raises(ValueError) as err:
            tenant_pages(config, context, 16)
        assert str(err.value) == f"context must be a positive number of tokens, got {context!r}"
    assert tenant_pages(config, 1, 16) == (1, 1)  # one token still takes a page per layer
