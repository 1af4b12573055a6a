"""What one chip stores, checked by hand (`make mutation TARGETS=storage`): the tensor-parallel
layout, each layer's KV arrays (shape, dtype, bytes, report lines) for every kind of axis and
format, and the pool arithmetic. Pure Python, no engine: each test is milliseconds.

Shapes follow LayerKVStorage's docstring: a page is [page_tokens, kv_heads, head_dim] per
tensor; "channel" scales one per (head, channel) over the page's tokens, "token" one per
(token, head, group) over head_dim; "tensor"/"head" one float32 per layer / per KV head.
Element sizes: int8/fp8 1 B, int4/fp4 two per byte, int2 four per byte, bf16 2 B; scales
float32 4 B, e8m0 (MX) and e4m3 (nvfp4) 1 B; MX blocks are 32 wide, nvfp4 16.
"""

from __future__ import annotations

import re

import pytest

from tenantq.quant.plan import KVPlan, LayerKV, QuantPlan
from tenantq.storage.kv import KVArray, LayerKVStorage, kv_quant_args, kv_storage, layer_bytes_row
from tenantq.storage.pool import pages_that_fit, pool_bytes_left
from tenantq.storage.tp import (
    check_tp,
    kv_heads_per_chip,
    shard_shape,
    tp_line,
    tp_split_axis,
    vocab_replicated,
)
from tenantq.testing import tiny_config

# A page of 4 tokens x 2 KV heads x 32 channels = 256 elements per tensor; 2 sink tokens.
P, H, D, S = 4, 2, 32, 2


def _layer(kv: LayerKV, **kw) -> LayerKVStorage:
    args = dict(layer=3, kv=kv, page_tokens=P, kv_heads=H, head_dim=D, sink_tokens=S)
    args.update(kw)
    return LayerKVStorage(**args)


# ----------------------------------------------------------------------- tensor parallelism
@pytest.mark.parametrize("bad", [0, -2, True, 2.0, "2", None])
def test_check_tp_refuses_what_is_not_a_positive_integer(bad):
    message = f"tp (chips) must be a positive integer, got {bad!r}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        check_tp(tiny_config(), bad)


def test_check_tp_returns_the_degree_and_names_the_valid_ones():
    # tiny: 4 heads, 2 KV heads, 64 MLP units -> tp in {1, 2}; 4 does not divide 2 KV heads.
    config = tiny_config()
    assert check_tp(config, 1) == 1
    assert check_tp(config, 2) == 2
    with pytest.raises(
        ValueError, match=r"does not divide num_key_value_heads=2.*valid chips are 1, 2$"
    ):
        check_tp(config, 4, valid_name="chips")


def test_vocabulary_split_only_when_the_chips_divide_it():
    # 64 % 2 == 0: split; 65 % 2 == 1: embed and lm_head stay whole on each chip.
    assert vocab_replicated(tiny_config(), 2) is False
    assert vocab_replicated(tiny_config(vocab_size=65), 2) is True
    assert vocab_replicated(tiny_config(vocab_size=65), 1) is False


@pytest.mark.parametrize(
    ("path", "line", "axis"),
    [
        ("embed", "embed", 0),
        ("lm_head", "lm_head", 1),
        ("layers/0/attn/q_proj", "attention", 1),
        ("layers/1/attn/k_proj", "attention", 1),
        ("layers/1/attn/v_proj", "attention", 1),
        ("layers/0/attn/o_proj", "attention", 0),
        ("layers/0/attn/q_bias", "attention", 0),
        ("layers/0/attn/k_bias", "attention", 0),
        ("layers/0/attn/v_bias", "attention", 0),
        ("layers/0/mlp/gate_proj", "mlp", 1),
        ("layers/0/mlp/up_proj", "mlp", 1),
        ("layers/1/mlp/down_proj", "mlp", 0),
        ("layers/0/attn/o_bias", "norms", None),
        ("layers/0/input_norm", "norms", None),
        ("final_norm", "norms", None),
    ],
)
def test_megatron_layout_line_and_split_axis(path, line, axis):
    # Weights stored [in, out]: column-parallel q/k/v/gate/up split axis 1, row-parallel
    # o/down axis 0 (DESIGN.md, Megatron); biases have one axis; norms and o_bias replicate.
    assert tp_line(path) == line
    assert tp_split_axis(path, tiny_config(), 2) == axis


def test_vocabulary_tensors_replicate_when_the_split_is_uneven():
    config = tiny_config(vocab_size=65)
    assert tp_split_axis("embed", config, 2) is None
    assert tp_split_axis("lm_head", config, 2) is None
    assert shard_shape("embed", (65, 32), config, 2) == (65, 32)


def test_shard_shapes_by_hand():
    # tp=2 halves exactly the split axis.
    config = tiny_config()
    assert shard_shape("layers/0/attn/q_proj", (32, 32), config, 2) == (32, 16)
    assert shard_shape("layers/0/attn/o_proj", (32, 32), config, 2) == (16, 32)
    assert shard_shape("layers/0/mlp/down_proj", (64, 32), config, 2) == (32, 32)
    assert shard_shape("embed", (64, 32), config, 2) == (32, 32)
    assert shard_shape("lm_head", (32, 64), config, 2) == (32, 32)
    assert shard_shape("layers/0/input_norm", (32,), config, 2) == (32,)
    assert shard_shape("layers/0/mlp/up_proj", (32, 64), config, 1) == (32, 64)
    # Whole numbers of elements: a shape of floats (16.0) would print and multiply as floats.
    assert all(type(n) is int for n in shard_shape("layers/0/attn/q_proj", (32, 32), config, 2))


def test_kv_heads_per_chip():
    # 2 KV heads: 2 on one chip, 1 each on two; 4 chips would replicate them: refused.
    assert kv_heads_per_chip(tiny_config(), 1) == 2
    assert kv_heads_per_chip(tiny_config(), 2) == 1
    message = (
        "tensor-parallel degree 4 does not divide num_key_value_heads=2; it must divide the "
        "heads, KV heads and MLP units: valid tp values are 1, 2"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        kv_heads_per_chip(tiny_config(), 4)


# ----------------------------------------------------------------------- KV arrays
def test_codec_axes_of_a_page():
    # channel: reduce over the page's tokens (axis 0); token: over head_dim (last axis);
    # static: one group of head_dim per (token, head) row.
    kv = LayerKV("int8", "channel", "int8", "token")
    assert kv_quant_args(kv.keys, D) == {"axis": 0}
    assert kv_quant_args(kv.values, D) == {"axis": -1}
    static = LayerKV("int8", "tensor", "int8", "head")
    assert kv_quant_args(static.keys, D) == {"axis": -1, "group_size": D}
    assert kv_quant_args(static.values, 16) == {"axis": -1, "group_size": 16}


@pytest.mark.parametrize(
    ("field", "bad"),
    [("page_tokens", 0), ("kv_heads", -1), ("head_dim", True), ("page_tokens", 2.0)],
)
def test_layer_geometry_must_be_positive_integers(field, bad):
    with pytest.raises(ValueError, match=rf"^{field} must be a positive integer, got {bad!r}$"):
        _layer(LayerKV("int8", "channel", "int8", "token"), **{field: bad})


def test_unknown_store_dtype_names_the_valid_ones():
    message = "KV store dtype 'float16' is not modelled; valid: bfloat16, float32"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        _layer(LayerKV("bf16", "channel", "bf16", "token"), store_dtype="float16")


def test_kivi_int8_keys_and_int2_values_by_hand():
    lay = _layer(LayerKV("int8", "channel", "int2", "token"))
    keys, values = (lay.arrays(s) for _, s in lay.tensors)
    assert keys == (
        KVArray("pages", "page", (4, 2, 32), "int8", 1),  # 256 B
        KVArray("scales", "page", (1, 2, 32), "float32", 4),  # one per (head, channel): 256 B
        KVArray("residual", "slot", (4, 2, 32), "bfloat16", 2),  # the open page: 512 B
        KVArray("sinks", "slot", (2, 2, 32), "bfloat16", 2),  # 2 tokens: 256 B
    )
    assert values == (
        KVArray("pages", "page", (4, 2, 8), "uint8", 1),  # 4 codes per byte: 64 B
        KVArray("scales", "page", (4, 2, 1), "float32", 4),  # group 32 = head_dim: 32 B
        KVArray("zero_points", "page", (4, 2, 1), "float32", 4),  # int2 is asymmetric: 32 B
        KVArray("sinks", "slot", (2, 2, 32), "bfloat16", 2),
    )
    assert (lay.page_data_bytes, lay.page_scale_bytes, lay.page_bytes) == (320, 320, 640)
    assert (lay.residual_bytes, lay.sink_bytes, lay.slot_bytes, lay.static_bytes) == (
        512, 512, 1024, 0,
    )  # fmt: skip
    assert lay.page_shape == (4, 2, 32)
    assert lay.byte_lines() == (
        "K elements: 256 x 1 B (int8) = 256 B per page",
        "K scales: 64 x 4 B (float32) = 256 B per page",
        "K residual window: 256 x 2 B (bfloat16) = 512 B per sequence slot",
        "K sink tokens: 128 x 2 B (bfloat16) = 256 B per sequence slot",
        "V elements: 64 x 1 B (uint8) = 64 B per page",
        "V scales: 8 x 4 B (float32) = 32 B per page",
        "V zero points: 8 x 4 B (float32) = 32 B per page",
        "V sink tokens: 128 x 2 B (bfloat16) = 256 B per sequence slot",
    )


def test_static_tensor_and_head_scales_are_paid_once_per_layer():
    # Keys int8 per tensor: one float32 scale (4 B) + clip counters [clipped, written] int32
    # (8 B). Values int2 per head: 2 scales and 2 zero points (8 B each) + 8 B counters.
    # No page scales and no residual window (static scales quantize at write time).
    lay = _layer(LayerKV("int8", "tensor", "int2", "head"))
    keys, values = (lay.arrays(s) for _, s in lay.tensors)
    assert keys == (
        KVArray("pages", "page", (4, 2, 32), "int8", 1),
        KVArray("static_scale", "layer", (1,), "float32", 4),
        KVArray("clip_counts", "layer", (2,), "int32", 4),
        KVArray("sinks", "slot", (2, 2, 32), "bfloat16", 2),
    )
    assert values == (
        KVArray("pages", "page", (4, 2, 8), "uint8", 1),
        KVArray("static_scale", "layer", (1, 1, 2, 1), "float32", 4),
        KVArray("static_zero_point", "layer", (1, 1, 2, 1), "float32", 4),
        KVArray("clip_counts", "layer", (2,), "int32", 4),
        KVArray("sinks", "slot", (2, 2, 32), "bfloat16", 2),
    )
    assert (lay.page_scale_bytes, lay.static_bytes, lay.residual_bytes) == (0, 4 + 8 + 8 + 8 + 8, 0)
    assert lay.byte_lines() == (
        "K elements: 256 x 1 B (int8) = 256 B per page",
        "K scales: 1 per layer, 4 B, static",
        "K clip counters: 2 x 4 B (int32) = 8 B per layer, static",
        "K sink tokens: 128 x 2 B (bfloat16) = 256 B per sequence slot",
        "V elements: 64 x 1 B (uint8) = 64 B per page",
        "V scales: 1 per KV head per layer, 8 B, static",
        "V zero points: 1 per KV head per layer, 8 B, static",
        "V clip counters: 2 x 4 B (int32) = 8 B per layer, static",
        "V sink tokens: 128 x 2 B (bfloat16) = 256 B per sequence slot",
    )


def test_block_formats_nvfp4_and_mxfp4_by_hand():
    # nvfp4: 16-wide blocks -> 2 e4m3 scales (1 B) per (token, head) + one float32 tensor
    # scale per page; mxfp4: one 32-wide block -> 1 e8m0 scale (1 B) per (token, head).
    lay = _layer(LayerKV("nvfp4", "token", "mxfp4", "token"), sink_tokens=0)
    keys, values = (lay.arrays(s) for _, s in lay.tensors)
    assert keys == (
        KVArray("pages", "page", (4, 2, 16), "uint8", 1),
        KVArray("scales", "page", (4, 2, 2), "float8_e4m3fn", 1),
        KVArray("tensor_scale", "page", (), "float32", 4),
    )
    assert values == (
        KVArray("pages", "page", (4, 2, 16), "uint8", 1),
        KVArray("scales", "page", (4, 2, 1), "uint8", 1),
    )
    assert (lay.page_data_bytes, lay.page_scale_bytes, lay.slot_bytes) == (256, 16 + 4 + 8, 0)
    assert lay.byte_lines()[2] == "K tensor scale: 1 x 4 B (float32) = 4 B per page"


def test_fp8_keys_and_unquantized_values_in_a_float32_store():
    # fp8 elements are 1 B; an unquantized tensor is one page array in the store dtype
    # (float32: 4 B), with no sink copy of its own; the keys' residual and sinks are float32.
    lay = _layer(LayerKV("fp8_e4m3", "channel", "bf16", "token"), store_dtype="float32")
    keys, values = (lay.arrays(s) for _, s in lay.tensors)
    assert keys[0] == KVArray("pages", "page", (4, 2, 32), "float8_e4m3fn", 1)
    assert keys[2:] == (
        KVArray("residual", "slot", (4, 2, 32), "float32", 4),
        KVArray("sinks", "slot", (2, 2, 32), "float32", 4),
    )
    assert values == (KVArray("pages", "page", (4, 2, 32), "float32", 4),)
    assert (lay.page_data_bytes, lay.residual_bytes, lay.sink_bytes) == (256 + 1024, 1024, 512)


def test_bytes_row_by_hand():
    # 5 pages and 3 slots of the KIVI layer above: data 5*320, scales 5*320, residual 3*512,
    # sinks 3*512.
    lay = _layer(LayerKV("int8", "channel", "int2", "token"))
    assert lay.bytes_row(5, 3) == {
        "layer": 3, "key_format": "int8", "key_axis": "channel", "value_format": "int2",
        "value_axis": "token", "pages": 5, "page_bytes": 640, "data_bytes": 1600,
        "scale_bytes": 1600, "pages_bytes": 3200, "residual_bytes": 1536, "sink_bytes": 1536,
        "static_bytes": 0, "total_bytes": 3200 + 1536 + 1536,
    }  # fmt: skip
    static = _layer(LayerKV("int8", "tensor", "int2", "head"), sink_tokens=0)
    row = static.bytes_row(2, 7)
    assert (row["static_bytes"], row["residual_bytes"], row["total_bytes"]) == (36, 0, 2 * 320 + 36)
    # The row helper on its own: static bytes default to none.
    row = layer_bytes_row(lay, 1, data_bytes=10, scale_bytes=20, residual_bytes=40, sink_bytes=80)
    assert (row["pages_bytes"], row["static_bytes"], row["total_bytes"]) == (30, 0, 150)


def test_kv_storage_follows_the_plan_per_layer_and_chip():
    # tiny (2 layers, 2 KV heads of 8) at tp=2: one KV head per chip; layer 0 pinned bf16.
    plan = QuantPlan(kv=KVPlan("int8", "channel", "int4", "token", sink_tokens=3, bf16_layers=(0,)))
    layers = kv_storage(tiny_config(), plan, 16, 2, store_dtype="float32")
    assert [(x.layer, x.kv.key_format, x.kv.value_format) for x in layers] == [
        (0, "bf16", "bf16"), (1, "int8", "int4"),
    ]  # fmt: skip
    for x in layers:
        assert (x.page_tokens, x.kv_heads, x.head_dim, x.sink_tokens, x.store_dtype) == (
            16, 1, 8, 3, "float32",
        )  # fmt: skip
    assert kv_storage(tiny_config(), plan, 16)[1].kv_heads == 2  # tp defaults to 1
    assert kv_storage(tiny_config(), plan, 16)[1].store_dtype == "bfloat16"


@pytest.mark.parametrize("bad", [0, True, 1.5])
def test_kv_storage_page_tokens_must_be_a_positive_integer(bad):
    # Checked before the chips (tp=3 divides nothing here): the first error is the pages'.
    with pytest.raises(ValueError, match=rf"^page_tokens must be a positive integer, got {bad!r}$"):
        kv_storage(tiny_config(), QuantPlan(), bad, 3)


def test_kv_storage_one_token_pages():
    # The smallest page is one token: 2 layers of [1, 2, 8] bf16 keys and values = 64 B.
    layers = kv_storage(tiny_config(), QuantPlan(), 1)
    assert [x.page_bytes for x in layers] == [64, 64]


# ----------------------------------------------------------------------- pool arithmetic
def test_pool_bytes_left():
    assert pool_bytes_left(100, 30, 20) == 50
    assert pool_bytes_left(100, 60, 40) == 0
    assert pool_bytes_left(100, 80, 30) == 0  # never negative


def test_pages_that_fit_by_hand():
    # Two KIVI layers: a page in both is 2*640 = 1,280 B; a slot 2*1,024 B. Static layer
    # (int8 tensor / int2 head, no sinks): page 320 B, static 36 B once.
    kivi = (_layer(LayerKV("int8", "channel", "int2", "token")),) * 2
    slots = 3 * 2048
    assert pages_that_fit(kivi, slots + 1280, 3) == 1  # the smallest pool
    assert pages_that_fit(kivi, slots + 5 * 1280 + 1279, 3) == 5
    message = (
        "a KV pool of 7,423 bytes cannot hold the 3 sequence slots' residual/sink buffers "
        "and static scales (6,144 bytes) and one page in every layer (1,280 bytes); "
        "give it more memory or fewer max_seqs"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        pages_that_fit(kivi, slots + 1279, 3)
    static = (_layer(LayerKV("int8", "tensor", "int2", "head"), sink_tokens=0),)
    assert pages_that_fit(static, 36 + 320, 8) == 1  # static bytes paid once, not per slot
    assert pages_that_fit(static, 36 + 3 * 320 - 1, 8) == 2
    with pytest.raises(ValueError, match=r"\(36 bytes\) and one page in every layer \(320 bytes\)"):
        pages_that_fit(static, 355, 8)


def test_stored_scale_dtypes_by_hand():
    # kv.scale_dtype replaces the float32 page/token scales of fp8/int formats (KV_SCALE_STORAGE:
    # bf16 2 B, E8M0 1 B as its uint8 code) and int2's zero points with them; block formats
    # keep their own (nvfp4 e4m3), static axes keep one float32 per layer.
    # int4 keys per channel: one scale per (head, channel) [1, 2, 32]; int2 values per token
    # in 32-wide groups: [4, 2, 1] scales and as many zero points.
    lay = _layer(LayerKV("int4", "channel", "int2", "token", "bf16"), sink_tokens=0)
    keys, values = (lay.arrays(s) for _, s in lay.tensors)
    assert keys[1] == KVArray("scales", "page", (1, 2, 32), "bfloat16", 2)
    assert values[1:3] == (
        KVArray("scales", "page", (4, 2, 1), "bfloat16", 2),
        KVArray("zero_points", "page", (4, 2, 1), "bfloat16", 2),
    )
    assert lay.page_scale_bytes == 64 * 2 + 8 * 2 + 8 * 2
    lay = _layer(LayerKV("fp8_e4m3", "token", "int8", "channel", "e8m0"), sink_tokens=0)
    keys, values = (lay.arrays(s) for _, s in lay.tensors)
    assert keys[1] == KVArray("scales", "page", (4, 2, 1), "uint8", 1)
    assert values[1] == KVArray("scales", "page", (1, 2, 32), "uint8", 1)
    assert lay.page_scale_bytes == 8 + 64
    # nvfp4 keys fix their own e4m3 block scales; int8 values on a static axis: none per page
    lay = _layer(LayerKV("nvfp4", "token", "int8", "head", "bf16"), sink_tokens=0)
    keys, values = (lay.arrays(s) for _, s in lay.tensors)
    assert keys[1] == KVArray("scales", "page", (4, 2, 2), "float8_e4m3fn", 1)
    assert [a.name for a in values] == ["pages", "static_scale", "clip_counts"]
