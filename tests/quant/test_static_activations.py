"""Static W8A8 activation scales: one calibrated scale per linear input, stored with the weight.

Bounds are exact: with a given scale s the int8 activation codes are clip(round_half_even(x/s),
-127, 127) (the numerics codec's definition), the int32 accumulation of integer codes is exact,
and the float32 rescale (acc * s_x) * s_w is one rounding per multiply, which numpy repeats in
the same order; so the static product must equal an independent numpy computation bit for bit.
Dynamic (per-token) W8A8 must stay bit-identical to the formula it had before static existed.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tenantq.model.layers import Linear, StaticActQArray, matmul
from tenantq.numerics import compute_scale_zero_point, quantize
from tenantq.quant.apply import apply_plan, quantize_tensor, static_activation_scale
from tenantq.quant.plan import QuantPlan, Rule

IN, OUT = 64, 16


def _weight(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((IN, OUT)) / np.sqrt(IN)).astype(np.float32)


def test_static_int8_product_equals_numpy_with_the_given_scale() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, IN)).astype(np.float32)
    x[0, 0, :4] = [9.0, -9.0, 40.0, -40.0]  # beyond the scale's range: must clip to +-127
    amax = np.float32(8.0)
    w = StaticActQArray.wrap(
        quantize(_weight(), "int8", axis=0), static_activation_scale(amax, "int8")
    )
    got = np.asarray(matmul(jnp.asarray(x), w, dtype=jnp.float32, activations="int8"))
    s_x = np.float32(amax / np.float32(127))  # symmetric int8: amax / 127, a float32 division
    assert np.float32(w.act_scale) == s_x
    codes = np.clip(np.rint(x / s_x), -127, 127).astype(np.int64)  # rint: half to even
    assert codes[0, 0, 2] == 127 and codes[0, 0, 3] == -127
    acc = (codes @ np.asarray(w.data, np.int64)).astype(np.float32)
    want = acc * s_x * np.asarray(w.scale, np.float32).reshape(-1)
    np.testing.assert_array_equal(got, want)


def test_static_fp8_codes_are_the_codecs_with_that_scale() -> None:
    # E4M3 codes of x / s saturate at 448; the product of codes runs in float32.
    import ml_dtypes

    rng = np.random.default_rng(2)
    x = (3 * rng.standard_normal((5, IN))).astype(np.float32)
    amax = np.float32(2.0)  # most of x lies beyond it: saturation must hold at +-448
    w = StaticActQArray.wrap(
        quantize(_weight(), "fp8_e4m3", axis=0), static_activation_scale(amax, "fp8_e4m3")
    )
    s_x = np.float32(amax / np.float32(448))
    (scale_numerics, _) = compute_scale_zero_point(x, "fp8_e4m3", axis=None, amax=amax)
    assert np.float32(w.act_scale) == s_x == np.float32(np.asarray(scale_numerics).item())
    got = np.asarray(matmul(jnp.asarray(x), w, dtype=jnp.float32, activations="fp8_e4m3"))
    codes = np.clip(x / s_x, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    wcodes = np.asarray(w.data).astype(np.float64)
    want = (codes @ wcodes) * s_x * np.asarray(w.scale, np.float64).reshape(-1)
    # float32 accumulation of IN products of exact fp8 values: IN * 2^-24 relative of sum |.|
    slack = IN * 2.0**-24 * (np.abs(codes) @ np.abs(wcodes)) * s_x * np.abs(w.scale).reshape(-1)
    assert (np.abs(got - want) <= slack + 1e-30).all()


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_dynamic_w8a8_is_bit_identical_to_per_token_scales(fmt: str) -> None:
    # The formula W8A8 has always run: per-token quantize, product of codes, both rescales.
    import jax

    x = np.random.default_rng(3).standard_normal((4, IN)).astype(np.float32)
    w = quantize(_weight(), fmt, axis=0)
    got = np.asarray(matmul(jnp.asarray(x), w, dtype=jnp.float32, activations=fmt))
    xq = quantize(jnp.asarray(x), fmt, axis=-1)
    acc = jnp.int32 if fmt == "int8" else jnp.float32
    dims = (((1,), (0,)), ((), ()))
    y = jax.lax.dot_general(xq.data, w.data, dims, preferred_element_type=acc)
    want = np.asarray(y.astype(jnp.float32) * xq.scale * w.scale.reshape(-1))
    np.testing.assert_array_equal(got, want)


def test_static_scale_counts_its_bytes_and_survives_jit() -> None:
    import jax

    q = quantize(_weight(), "int8", axis=0)
    w = StaticActQArray.wrap(q, static_activation_scale(4.0, "int8"))
    assert w.nbytes == q.nbytes + 4  # one float32 scale
    leaves, tree = jax.tree_util.tree_flatten(w)
    back = jax.tree_util.tree_unflatten(tree, leaves)
    assert isinstance(back, StaticActQArray) and float(back.act_scale) == float(w.act_scale)
    x = jnp.ones((2, IN))
    f = jax.jit(lambda v, ww: matmul(v, ww, dtype=jnp.float32, activations="int8"))
    np.testing.assert_array_equal(f(x, w), matmul(x, w, dtype=jnp.float32, activations="int8"))


def test_rule_field_round_trips_and_is_checked() -> None:
    rule = Rule(".*_proj", "int8", activations="int8", activation_scale="static")
    plan = QuantPlan(rules=(rule,))
    assert QuantPlan.from_json(plan.to_json()) == plan
    assert rule.to_dict()["activation_scale"] == "static"
    dynamic = Rule(".*_proj", "int8", activations="int8")
    assert "activation_scale" not in dynamic.to_dict()  # old plans keep their fingerprint
    with pytest.raises(ValueError, match="applies to W8A8 only"):
        Rule(".*", "int8", activation_scale="static")
    with pytest.raises(ValueError, match="unknown activation scale 'per_token'"):
        Rule.from_dict({"pattern": ".*", "format": "int8", "activations": "int8",
                        "activation_scale": "per_token"})  # fmt: skip


def test_static_without_statistics_is_a_clear_error() -> None:
    plan = QuantPlan(rules=(Rule("w_proj", "int8", activations="int8", activation_scale="static"),))
    how = plan.resolve({"w_proj": _info()})["w_proj"]
    with pytest.raises(ValueError, match="need calibration statistics; run .*site_inputs"):
        quantize_tensor(_weight(), how)
    with pytest.raises(ValueError, match="act_amax must be a finite"):
        quantize_tensor(_weight(), how, act_amax=float("nan"))
    with pytest.raises(ValueError, match="carries a static activation scale"):
        Linear("w_proj", quantize_tensor(_weight(), how, act_amax=1.0), dtype=jnp.float32)
    q = apply_plan({"w_proj": _weight()}, plan, inputs={"w_proj": {"act_amax": 2.0}})["w_proj"]
    assert float(q.act_scale) == np.float32(2.0) / np.float32(127)


def _info():
    from tenantq.model.config import TensorInfo

    return TensorInfo("w_proj", (IN, OUT), "linear", 0)


def test_planner_counts_the_static_scale_as_the_engine_does() -> None:
    # capacity.weights (the planner, no JAX) must give each static W8A8 tensor the bytes the
    # engine's StaticActQArray holds: the weight's storage plus one float32 scale.
    from tenantq.capacity.weights import tensor_bytes
    from tenantq.model.decoder import init_params
    from tenantq.testing import tiny_config

    config = tiny_config()
    rule = Rule("layers/.*/mlp/.*", "int8", activations="int8", activation_scale="static")
    plan = QuantPlan(rules=(rule,))
    params = init_params(config, seed=0)
    static = [p for p in plan.resolve(config)]
    inputs = {p: {"act_amax": 3.0} for p in static}
    quantized = apply_plan(params, plan, config, inputs=inputs)
    planned = {t.path: t.bytes_per_chip for t in tensor_bytes(config, plan)}
    assert static and all(isinstance(quantized[p], StaticActQArray) for p in static)
    for path in static:
        assert planned[path] == quantized[path].nbytes, path
    dynamic = QuantPlan(rules=(Rule("layers/.*/mlp/.*", "int8", activations="int8"),))
    without = {t.path: t.bytes_per_chip for t in tensor_bytes(config, dynamic)}
    assert all(planned[p] - without[p] == 4 for p in static)  # exactly one float32 each
