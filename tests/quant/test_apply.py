"""apply_plan: the one path from full-precision params to quantized params."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tenantq.engine import Engine
from tenantq.engine.pool import PagedPool
from tenantq.numerics import QArray, dequantize, quantize
from tenantq.quant import algorithms as algorithms_mod
from tenantq.quant import apply as apply_mod
from tenantq.quant.apply import UnusedRuleWarning, apply_plan, quantize_tensor
from tenantq.quant.plan import QuantPlan, Rule, TensorQuant
from tenantq.testing import hf_tensors, tiny_checkpoint


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


def test_applying_a_plan_to_quantized_params_is_refused(config, params):
    # One plan -> params path: re-applying would quantize quantized values (or, before,
    # silently keep them), so a second apply_plan on the same params is an error.
    once = apply_plan(params, QuantPlan.uniform("int8"), config)
    with pytest.raises(ValueError, match="embed is already a int8 QArray: a plan is applied once"):
        apply_plan(once, QuantPlan.uniform("int8"), config)


@pytest.fixture
def quantized_paths(monkeypatch):
    """Every tensor path `quantize_tensor` is called for, in order (the one quantizer every
    plan -> params path runs: apply_plan, load_quantized, per-shard quantization)."""
    calls: list[str] = []
    real = apply_mod.quantize_tensor

    def counting(weight, how, **kwargs):
        calls.append(how.path)
        return real(weight, how, **kwargs)

    monkeypatch.setattr(apply_mod, "quantize_tensor", counting)
    return calls


def _planned(config, plan) -> list[str]:
    return sorted(plan.resolve(config))


def test_every_path_to_the_engine_quantizes_each_tensor_once(
    tmp_path, config, params, quantized_paths
):
    # Bound: exactly one quantize_tensor call per planned tensor, whatever the path (the
    # Engine applying the plan itself, receiving apply_plan's output, or from_checkpoint's
    # streamed load). Before, from_checkpoint and a calibrator's params were applied twice.
    plan = QuantPlan(rules=(Rule("layers/.*/mlp/.*", "int4", group_size=16), Rule(".*", "int8")))
    want = _planned(config, plan)
    options = {"dtype": "float32", "max_seqs": 2, "max_seq_tokens": 32}

    Engine(config, params, plan, **options)
    assert sorted(quantized_paths) == want
    quantized_paths.clear()

    Engine(config, apply_plan(params, plan, config), plan, **options)
    assert sorted(quantized_paths) == want
    quantized_paths.clear()

    tiny_checkpoint(tmp_path, config, tensors=hf_tensors(config, params, dtype=np.float32))
    Engine.from_checkpoint(tmp_path, plan, **options)
    assert sorted(quantized_paths) == want


def test_engine_refuses_params_quantized_under_another_plan(config, params):
    int8 = apply_plan(params, QuantPlan.uniform("int8"), config)
    with pytest.raises(ValueError, match="is stored as int8 but the plan wants int4"):
        Engine(config, int8, QuantPlan.uniform("int4"), max_seqs=2, max_seq_tokens=32)
    partly = {**params, "lm_head": int8["lm_head"]}  # one tensor quantized, the rest not
    with pytest.raises(ValueError, match="embed is stored as full precision but the plan wants"):
        Engine(config, partly, QuantPlan.uniform("int8"), max_seqs=2, max_seq_tokens=32)


def test_engine_refuses_a_kv_pool_built_for_another_plan(config, params):
    # The params follow a plan with an int8 KV cache; a pool built from the bf16 plan would
    # run and report bf16 KV under the int8 plan's name (PagedPool.check_plan was a no-op).
    plan = QuantPlan.from_dict({"kv": {"key_format": "int8", "value_format": "int8"}})
    pool = PagedPool(config, QuantPlan(), dtype="float32", num_pages=8, max_seqs=2,
                     max_seq_tokens=32)  # fmt: skip
    with pytest.raises(ValueError, match="KV pool of layer 0 was built for"):
        Engine(config, params, plan, dtype="float32", cache=pool)
    same = PagedPool(config, plan, dtype="float32", num_pages=8, max_seqs=2, max_seq_tokens=32)
    assert Engine(config, params, plan, dtype="float32", cache=same).cache is same


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


def test_engine_refuses_params_quantized_with_another_layout_of_the_planned_format(config, params):
    # Same format is not the same plan: int4 groups of 16 run under a plan of groups of 32
    # would serve (and report) the g32 plan with g16 numerics; an rtn int8 weight under a
    # static-W8A8 rule lacks the calibrated activation scale the rule asks for.
    # (Before, only the format was compared: both ran.)
    g16 = apply_plan(params, QuantPlan(rules=(Rule("layers/.*", "int4", group_size=16),)), config)
    g32 = QuantPlan(rules=(Rule("layers/.*", "int4", group_size=32),))
    with pytest.raises(ValueError, match="stored as int4 with groups of 16 along axis 0 but the"):
        Engine(config, g16, g32, max_seqs=2, max_seq_tokens=32)
    int8 = apply_plan(params, QuantPlan(rules=(Rule("layers/.*", "int8"),)), config)
    static = QuantPlan(
        rules=(Rule("layers/.*", "int8", activations="int8", activation_scale="static"),)
    )
    with pytest.raises(
        ValueError, match="per axis-0 slice but the plan wants int8 .*, a static activation scale"
    ):
        Engine(config, int8, static, max_seqs=2, max_seq_tokens=32)
    # the layout apply_plan gives is accepted as it is
    same = QuantPlan(rules=(Rule("layers/.*", "int4", group_size=16),))
    engine = Engine(config, g16, same, max_seqs=2, max_seq_tokens=32)
    assert engine.params["layers/0/attn/q_proj"] is g16["layers/0/attn/q_proj"]


def test_apply_plan_quantizes_each_tp_shard_alone_where_shard_axes_split(config, params):
    # scale_scope="shard" lives in apply_plan now: o_proj splits its input rows (axis 0),
    # the axis int8's per-channel scale reduces over, so each of 2 shards gets its own scale
    # row (groups of one shard) where the whole tensor has one. Without shard_axes: whole.
    from tenantq.storage.tp import tp_split_axis

    plan, path = QuantPlan.uniform("int8"), "layers/0/attn/o_proj"
    axes = {p: tp_split_axis(p, config, 2) for p in params}
    assert axes[path] == 0
    sharded = apply_plan(params, plan, config, shard_axes=axes, tp=2)[path]
    rows = params[path].shape[0]
    assert (sharded.axis, sharded.group_size, sharded.scale.shape[0]) == (0, rows // 2, 2)
    for i, half in enumerate(np.split(np.asarray(params[path], np.float32), 2, axis=0)):
        alone = quantize_tensor(half, plan.resolve(config)[path])
        assert np.array_equal(np.asarray(sharded.scale[i]), np.asarray(alone.scale[0]))
    assert apply_plan(params, plan, config)[path].scale.shape[0] == 1
