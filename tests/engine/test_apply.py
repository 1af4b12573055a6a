"""apply_plan: the one path from full-precision params to quantized params."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tenantq.numerics import QArray, dequantize, quantize
from tenantq.quant import algorithms as algorithms_mod
from tenantq.quant.apply import UnusedRuleWarning, apply_plan, quantize_tensor
from tenantq.quant.plan import QuantPlan, Rule, TensorQuant


def test_first_match_decides_each_tensor(config, params):
    plan = QuantPlan(
        rules=(
            Rule("layers/1/mlp/down_proj", "int8"),
            Rule("layers/.*/mlp/.*", "int4", group_size=16),
            Rule("embed", "bf16"),
            Rule(".*", "fp8_e4m3"),
        )
    )
    out = apply_plan(params, plan, config)
    assert out["layers/1/mlp/down_proj"].fmt == "int8"
    assert out["layers/0/mlp/down_proj"].fmt == "int4"
    assert out["layers/0/mlp/down_proj"].group_size == 16
    assert out["layers/0/attn/q_proj"].fmt == "fp8_e4m3"
    assert out["embed"] is params["embed"]  # an explicit bf16 rule keeps the tensor as it is
    assert out["layers/0/input_norm"] is params["layers/0/input_norm"]
    assert isinstance(out["lm_head"], QArray) and out["lm_head"].axis == 0


def test_quantized_values_are_rtn_of_the_source(config, params):
    out = apply_plan(params, QuantPlan.uniform("int4", group_size=16), config)
    w = params["layers/0/attn/v_proj"]
    expect = quantize(w, "int4", axis=0, group_size=16)
    np.testing.assert_array_equal(np.asarray(out["layers/0/attn/v_proj"].data), expect.data)
    np.testing.assert_array_equal(dequantize(out["layers/0/attn/v_proj"]), dequantize(expect))


def test_unused_rules_warn_and_strict_raises(config, params):
    plan = QuantPlan(rules=(Rule(".*", "int8"), Rule("layers/.*/mlp/.*", "int4")))
    with pytest.warns(UnusedRuleWarning, match=r"layers/\.\*/mlp/\.\*"):
        apply_plan(params, plan, config)
    with pytest.raises(ValueError, match="matched no tensor"):
        apply_plan(params, plan, config, strict=True)


def test_applying_twice_is_harmless_but_requantizing_is_refused(config, params):
    plan = QuantPlan.uniform("int8")
    once = apply_plan(params, plan, config)
    twice = apply_plan(once, plan, config)
    assert twice["layers/0/attn/q_proj"] is once["layers/0/attn/q_proj"]
    with pytest.raises(ValueError, match="already quantized to int8 but the plan wants int4"):
        apply_plan(once, QuantPlan.uniform("int4"), config)


def test_algorithm_seam_dispatches_by_rule_name(config, params):
    calls = []

    def fake_gptq(weight, how, **inputs):
        calls.append((how.path, sorted(inputs)))
        return quantize(weight, how.format, axis=how.axis, group_size=how.group_size)

    plan = QuantPlan(rules=(Rule("layers/0/mlp/up_proj", "int4", algorithm="gptq"),))
    # The table is shared by every later test: restore it whole, order included (monkeypatch
    # would put a deleted-then-restored "gptq" last, and the table's order is the plan's).
    table, saved = algorithms_mod.ALGORITHMS, dict(algorithms_mod.ALGORITHMS)
    try:
        del table["gptq"]  # the table holds the real one
        with pytest.raises(ValueError, match="algorithm 'gptq' is not available; registered: rtn"):
            apply_plan(params, plan, config)
        table["gptq"] = fake_gptq
        inputs = {"layers/0/mlp/up_proj": {"hessian": np.eye(32)}}
        out = apply_plan(params, plan, config, inputs=inputs)
    finally:
        table.clear()
        table.update(saved)
    assert calls == [("layers/0/mlp/up_proj", ["hessian"])]
    assert out["layers/0/mlp/up_proj"].fmt == "int4"


def test_w8a8_needs_per_channel_weight_scales():
    how = TensorQuant("layers/0/attn/q_proj", "int8", 0, 64, True, "rtn", "int8")
    with pytest.raises(ValueError, match="per-channel"):
        quantize_tensor(jnp.ones((128, 8)), how)


def test_params_with_unknown_paths_are_rejected(config, params):
    with pytest.raises(ValueError, match="does not have"):
        apply_plan({**params, "layers/7/attn/q_proj": params["embed"]}, QuantPlan(), config)


def test_apply_plan_without_config_reads_the_inventory_off_the_params(config, params) -> None:
    # apply_plan(params, plan) -- the pinned two-argument form -- must store the same bytes as
    # the form given the model config: both resolve the same formats, axes and groups.
    from tenantq.quant.apply import apply_plan
    from tenantq.quant.plan import QuantPlan, Rule

    plan = QuantPlan(rules=(Rule("embed", "int8"), Rule("layers/.*/mlp/.*", "int4", 16)))
    with_config = apply_plan(params, plan, config)
    without = apply_plan(params, plan)
    assert with_config.keys() == without.keys()
    for path, value in with_config.items():
        other = without[path]
        assert type(value) is type(other), path
        if hasattr(value, "fmt"):
            assert (value.fmt, value.axis, value.group_size) == (
                other.fmt,
                other.axis,
                other.group_size,
            )
            assert value.nbytes == other.nbytes
    assert without["embed"].axis == 1 and without["layers/0/mlp/up_proj"].axis == 0
