"""The KV-axis checks of QuantPlan that the round-trip tests cannot see (found by `make
mutation TARGETS=plan` after the static `tensor`/`head` axes landed): which formats a static
axis accepts, per-layer key vs value formats, the exact one-line error, and `uniform` on a
name that is not a format. Expected values come from plan.py's documented contract:
STATIC_KV_FORMATS = formats with one float32 scale and no block (fp8, int8, int4, int2).
"""

from __future__ import annotations

import re

import pytest

from tenantq.quant.plan import DEFAULT_KV_SCALE_DTYPES, KVPlan, LayerKV, QuantPlan

STATIC_LIST = "fp8_e4m3, fp8_e5m2, int8, int4, int2"


def test_static_axis_accepts_bf16_layers():
    # bf16 is the baseline (no scale at all): a static axis is allowed beside it, whether bf16
    # is the plan-wide format or one layer's override.
    plan = KVPlan(key_format="bf16", key_axis="tensor", value_format="int8", value_axis="head")
    assert (plan.key_format, plan.key_axis) == ("bf16", "tensor")
    plan = KVPlan(
        key_format="int8",
        key_axis="tensor",
        value_format="int8",
        value_axis="tensor",
        layer_formats=((1, "bf16", "bf16"),),
    )
    assert plan.layer_formats == ((1, "bf16", "bf16"),)


def test_static_axis_error_names_every_block_format_in_order():
    # Two block formats in the layer overrides of the keys: the message lists both, sorted,
    # joined by ", ", and ends with the two axes that work.
    message = (
        f"kv.key_axis: 'tensor' (a static scale) needs a format with a float32 scale "
        f"({STATIC_LIST}); mxfp4, nvfp4 fixes its own block scales: use 'channel' or 'token'"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        KVPlan(
            key_format="int8",
            key_axis="tensor",
            value_format="int8",
            value_axis="token",
            layer_formats=((1, "nvfp4", "int8"), (0, "mxfp4", "int4")),
        )


def test_key_and_value_axes_see_their_own_layer_formats():
    # A layer override's key format is checked against key_axis, its value format against
    # value_axis, never the other way round.
    # Keys static, a layer's key in mxfp4 (values fine): refused on key_axis.
    with pytest.raises(ValueError, match=r"^kv\.key_axis: 'tensor' .*; mxfp4 fixes"):
        KVPlan(
            key_format="int8",
            key_axis="tensor",
            value_format="int8",
            value_axis="token",
            layer_formats=((1, "mxfp4", "int8"),),
        )
    # Values static, a layer's value in mxfp8 (keys per channel): refused on value_axis.
    with pytest.raises(ValueError, match=r"^kv\.value_axis: 'head' .*; mxfp8 fixes"):
        KVPlan(
            key_format="int8",
            key_axis="channel",
            value_format="int8",
            value_axis="head",
            layer_formats=((0, "int8", "mxfp8"),),
        )
    # Keys static with block-format values on a per-token axis: accepted (keys are int8).
    plan = KVPlan(
        key_format="int8",
        key_axis="tensor",
        value_format="int8",
        value_axis="token",
        layer_formats=((0, "int8", "nvfp4"),),
    )
    assert plan.layer_formats == ((0, "int8", "nvfp4"),)


def test_uniform_on_an_unknown_kv_format_is_a_one_line_value_error():
    # Not a TypeError from unpacking a missing default: the plan's own message.
    with pytest.raises(ValueError, match=r"^kv\.key_format: unknown format 'int3'; valid"):
        QuantPlan.uniform(kv="int3")


def test_every_layer_carries_the_plans_scale_dtype():
    # for_layer has three paths (a bf16 layer, a per-layer override, the plan-wide formats);
    # each LayerKV names the plan's scale_dtype, and so do its key and value specs.
    plan = KVPlan(
        key_format="int8",
        value_format="int4",
        bf16_layers=(0,),
        layer_formats=((1, "int2", "fp8_e4m3"),),
        scale_dtype="bf16",
    )
    assert plan.for_layer(0, 3) == LayerKV("bf16", "channel", "bf16", "token", "bf16")
    assert plan.for_layer(1, 3) == LayerKV("int2", "channel", "fp8_e4m3", "token", "bf16")
    assert plan.for_layer(2, 3) == LayerKV("int8", "channel", "int4", "token", "bf16")
    assert plan.for_layer(1, 3).keys.stored_scale_dtype == "bf16"
    assert plan.for_layer(2, 3).values.stored_scale_dtype == "bf16"


def test_uniform_scale_dtype_defaults_and_override():
    # DEFAULT_KV_SCALE_DTYPES (plan.py, chosen on the quick suite): int4 and int2 store bf16
    # scales by default, every other format float32; an explicit kv_scale_dtype wins (int8's
    # default axes are static, with no page/token scales to store otherwise).
    assert DEFAULT_KV_SCALE_DTYPES == {"int4": "bf16", "int2": "bf16"}
    assert QuantPlan.uniform(kv="int4").kv.scale_dtype == "bf16"
    assert QuantPlan.uniform(kv="int2").kv.scale_dtype == "bf16"
    assert QuantPlan.uniform(kv="int8").kv.scale_dtype == "float32"
    assert QuantPlan.uniform(kv="int4", kv_scale_dtype="e8m0").kv.scale_dtype == "e8m0"
    assert QuantPlan.uniform(kv="int4", kv_scale_dtype="float32").kv.scale_dtype == "float32"


def test_scale_dtype_refusals_are_one_line_and_exact():
    # _check_scale_dtype's three refusals, each with the whole message (plan.py): block
    # formats (sorted, joined by ", ") fix their own scales; E8M0 is for symmetric formats
    # (int2 has a zero point); a setting with no page/token scale to apply to is refused.
    own = (
        "kv.scale_dtype: 'bf16' replaces float32 page/token scales; mxfp4, nvfp4 fixes its own "
        "block scales: use scale_dtype 'float32' or fp8_e4m3, fp8_e5m2, int8, int4, int2"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(own)}$"):
        KVPlan(key_format="nvfp4", value_format="int8", scale_dtype="bf16",
               layer_formats=((0, "mxfp4", "int8"),))  # fmt: skip
    asym = (
        "kv.scale_dtype: 'e8m0' is a power-of-two scale for symmetric formats; int2 "
        "(asymmetric, with a zero point) takes scale_dtype 'float32' or 'bf16'"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(asym)}$"):
        KVPlan(key_format="int4", value_format="int2", scale_dtype="e8m0")
    none = (
        "kv.scale_dtype: 'e8m0' applies to page/token scales, and no quantized KV tensor has "
        "them (bf16 or static tensor/head axes only); use 'float32' or a channel/token axis"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(none)}$"):
        KVPlan(key_format="int8", key_axis="tensor", value_format="bf16", scale_dtype="e8m0")


def test_scale_dtype_accepted_where_it_applies():
    # bf16 scales take int2 (its zero point is stored bf16 too); E8M0 takes symmetric int/fp8
    # with a per-channel/token axis; float32 is accepted with block formats (nothing replaced).
    assert KVPlan(key_format="int2", value_format="int2", scale_dtype="bf16").scale_dtype == "bf16"
    plan = KVPlan(key_format="int4", value_format="fp8_e4m3", scale_dtype="e8m0")
    assert plan.for_layer(0, 1).values.stored_scale_dtype == "e8m0"
    assert KVPlan(key_format="nvfp4", value_format="mxfp4").scale_dtype == "float32"
