"""Each quantized linear layer stays within the error bound its format implies.

For y = x @ W with W quantized group-wise along its input axis, every output obeys
|y_q - y|_j <= sum_i |x_i| * e_ij, where e_ij bounds the element error from the format's
definition alone (scale derived from the group's amax, the element grid, saturation):
  int (symmetric): half a step, step = amax / qmax;  asymmetric: one step (hi - lo) / (2^b - 1)
  fp8 E4M3 / E5M2: 2^-4 / 2^-3 relative (3 / 2 mantissa bits) plus half a subnormal step
  MX (OCP MX v1.0 6.3): X = 2^(floor(log2 amax) - emax); element grid of E4M3 or E2M1 in
      units of X, plus saturation of values above the largest element
  NVFP4: step = e4m3(amax_b / 6 / G) * G with G = amax / (448 * 6); E2M1 grid in steps
  bf16 / fp16 casts: 2^-8 / 2^-11 relative (fp16 plus half its smallest subnormal).
The engine's path (NNX `Linear`: dequantize inside the matmul, or W8A8 codes) is compared
with a float64 reference; float32 accumulation adds at most ~n*eps*sum|x||w|.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tenantq.model.layers import Embedding, Linear
from tenantq.numerics import dequantize, get_format, quantize

IN, OUT = 256, 48
F32_SLACK = 256 * 2.0**-23  # n * eps relative to sum |x| |w|


def _weights(seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((IN, OUT)) / math.sqrt(IN)
    w[rng.integers(0, IN, 6), rng.integers(0, OUT, 6)] *= 12.0  # a few outliers
    x = rng.standard_normal((4, IN))
    return x.astype(np.float32), w.astype(np.float32)


def _groups(a: np.ndarray, group: int | None, reduce) -> np.ndarray:
    """reduce over groups of `group` rows along axis 0, broadcast back to a's shape."""
    g = a.shape[0] if group is None else group
    out = np.empty_like(a)
    for start in range(0, a.shape[0], g):
        out[start : start + g] = reduce(a[start : start + g], axis=0, keepdims=True)
    return out


def _e2m1_error(units: np.ndarray) -> np.ndarray:
    """Worst rounding error of |value| / step = units on the E2M1 grid, in steps."""
    half_step = np.where(units < 2, 0.25, np.where(units < 4, 0.5, 1.0))
    return np.where(units <= 6, half_step, units - 6)


def _fp8_error(w, step, mantissa_bits, min_subnormal_exp, max_finite):
    relative = 2.0 ** -(mantissa_bits + 1) * np.abs(w)
    subnormal = 2.0 ** (min_subnormal_exp - 1) * step
    saturate = np.maximum(np.abs(w) - max_finite * step, 0)
    return relative + subnormal + saturate


def element_bound(w: np.ndarray, fmt: str, group: int | None, symmetric=True) -> np.ndarray:
    """Largest |dequantize(quantize(w)) - w| per element the format allows."""
    w = w.astype(np.float64)
    a = np.abs(w)
    if fmt == "bf16":
        return 2.0**-8 * a
    if fmt == "fp16":
        return 2.0**-11 * a + 2.0**-25  # plus half the smallest subnormal
    spec = get_format(fmt)
    group = spec.block_size or group
    amax = _groups(a, group, np.max)
    if spec.family == "int":
        if symmetric:
            return 0.5 * amax / spec.max_finite
        span = _groups(np.maximum(w, 0), group, np.max) - _groups(np.minimum(w, 0), group, np.min)
        return span / (2**spec.element_bits - 1)
    if fmt == "fp8_e4m3":
        return _fp8_error(w, amax / 448.0, 3, -9, 448.0)
    if fmt == "fp8_e5m2":
        return _fp8_error(w, amax / 57344.0, 2, -16, 57344.0)
    if fmt == "mxfp8":
        step = 2.0 ** (np.floor(np.log2(amax)) - 8)
        return _fp8_error(w, step, 3, -9, 448.0)
    if fmt == "mxfp4":
        step = 2.0 ** (np.floor(np.log2(amax)) - 2)
        return _e2m1_error(a / step) * step
    assert fmt == "nvfp4"
    g = a.max() / (448.0 * 6.0)
    block = (amax / 6.0 / g).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    step = block * g
    return _e2m1_error(a / step) * step


CASES = [
    ("bf16", None, True),
    ("fp16", None, True),
    ("fp8_e4m3", None, True),
    ("fp8_e5m2", None, True),
    ("int8", None, True),
    ("int8", 64, False),
    ("int4", 128, True),
    ("int4", 32, True),
    ("int4", 64, False),
    ("mxfp8", None, True),
    ("mxfp4", None, True),
    ("nvfp4", None, True),
]


@pytest.mark.parametrize(("fmt", "group", "symmetric"), CASES)
def test_weight_only_linear_within_format_bound(fmt, group, symmetric):
    x, w = _weights()
    q = quantize(w, fmt, axis=0, group_size=group, symmetric=symmetric)
    layer = Linear("layers/0/mlp/up_proj", q, dtype=jnp.float32)
    got = np.asarray(layer(jnp.asarray(x)), np.float64)
    want = x.astype(np.float64) @ w.astype(np.float64)
    magnitude = np.abs(x) @ np.abs(w).astype(np.float64)
    bound = np.abs(x) @ element_bound(w, fmt, group, symmetric) + F32_SLACK * magnitude
    err = np.abs(got - want)
    scale = np.abs(want).max()
    assert (err <= bound).all(), (
        f"{fmt}: max error {err.max() / scale:.3g} of the output scale, "
        f"bound {bound[err > bound].min() / scale:.3g}"
    )
    if fmt not in ("bf16", "fp16"):
        assert err.max() > 0  # really quantized
    # Weight-only adds nothing beyond the stored values: the layer is x @ dequantize(q).
    exact = x.astype(np.float64) @ np.asarray(dequantize(q), np.float64)
    assert (np.abs(got - exact) <= F32_SLACK * magnitude).all()


def _activation_bound(x: np.ndarray, fmt: str) -> np.ndarray:
    amax = np.abs(x).max(axis=1, keepdims=True)
    if fmt == "int8":
        return 0.5 * amax / 127.0 * np.ones_like(x)
    return _fp8_error(x.astype(np.float64), amax / 448.0, 3, -9, 448.0)


@pytest.mark.parametrize(
    ("w_fmt", "a_fmt"), [("int8", "int8"), ("fp8_e4m3", "fp8_e4m3"), ("fp8_e5m2", "fp8_e4m3")]
)
def test_w8a8_linear_within_product_bound(w_fmt, a_fmt):
    x, w = _weights(seed=1)
    q = quantize(w, w_fmt, axis=0)
    layer = Linear("layers/0/attn/o_proj", q, dtype=jnp.float32, activations=a_fmt)
    got = np.asarray(layer(jnp.asarray(x)), np.float64)
    want = x.astype(np.float64) @ w.astype(np.float64)
    ew, ex = element_bound(w, w_fmt, None), _activation_bound(x, a_fmt)
    magnitude = np.abs(x) @ np.abs(w).astype(np.float64)
    bound = np.abs(x) @ ew + ex @ np.abs(w) + ex @ ew + F32_SLACK * magnitude
    err = np.abs(got - want)
    assert (err <= bound).all(), f"{w_fmt}/{a_fmt}: {err.max()} vs bound {bound.min()}"
    assert err.max() > 0


def test_w8a8_refuses_grouped_weights():
    _, w = _weights()
    with pytest.raises(ValueError, match="per output channel"):
        Linear(
            "lm_head",
            quantize(w, "int8", axis=0, group_size=64),
            dtype=jnp.float32,
            activations="int8",
        )


@pytest.mark.parametrize("fmt", ["int4", "mxfp4", "nvfp4", "int8"])
def test_quantized_embedding_rows_and_tied_head(fmt):
    rng = np.random.default_rng(2)
    table = rng.standard_normal((40, 64)).astype(np.float32)
    q = quantize(table, fmt, axis=1, group_size=32 if fmt == "int4" else None)
    emb = Embedding(q, dtype=jnp.float32)
    ids = jnp.array([[3, 0, 39], [7, 7, 1]])
    full = np.asarray(dequantize(q))
    np.testing.assert_array_equal(np.asarray(emb(ids)), full[np.asarray(ids)])
    h = rng.standard_normal((2, 64)).astype(np.float32)
    np.testing.assert_allclose(
        np.asarray(emb.attend(jnp.asarray(h))), h @ full.T, rtol=1e-5, atol=1e-5
    )
