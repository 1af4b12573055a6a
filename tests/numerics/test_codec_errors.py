"""codec.py's argument checks, each message word for word (found unpinned by `make mutation
TARGETS=numerics-codec`): every bad input names the format, what was wrong and what is
allowed (E8M0 codes 0..254 with 255 = NaN, OCP MX v1.0 5.4.1; int zero points in [-qmax - 1,
qmax]; scales positive and finite); the edges of each range are accepted, and inside jit
(tracers) nothing is checked. No test here compiles more than a few tiny layouts.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tenantq.numerics import (
    codec,
    compute_scale_zero_point,
    quantize,
    quantize_with_scale_zero_point,
)

X = np.ones((2, 4), np.float32)
B16 = np.ones((1, 16), np.float32)  # one nvfp4 block
B32 = np.ones((1, 32), np.float32)  # one MX block
SHAPE_MSG = "it must broadcast to the scale shape {} (one per group)"
NOT_FINITE = "input elements are not finite (inf or NaN in float32); quantize only finite tensors"


CASES = [
    (lambda: quantize(np.arange(3, dtype=np.int32), "int8"),
     "quantize to int8: x must be a float array, got int32"),
    (lambda: quantize(jnp.arange(3, dtype=jnp.int32), "int4"),
     "quantize to int4: x must be a float array, got int32"),
    (lambda: quantize(np.array([1e300, 1.0]), "int8"),  # float64 beyond float32: inf
     f"quantize to int8: 1 of 2 {NOT_FINITE}"),
    (lambda: quantize(np.array([[np.nan, np.inf, 1.0]], np.float32), "mxfp8"),
     f"quantize to mxfp8: 2 of 3 {NOT_FINITE}"),
    (lambda: quantize(jnp.array([[np.nan, 1.0]], jnp.bfloat16), "fp16"),
     f"quantize to fp16: 1 of 2 {NOT_FINITE}"),
    (lambda: compute_scale_zero_point(np.arange(3, dtype=np.int8), "fp8_e5m2"),
     "quantize to fp8_e5m2: x must be a float array, got int8"),
    (lambda: quantize_with_scale_zero_point(np.arange(3, dtype=np.int16), "int8", 1.0),
     "quantize to int8: x must be a float array, got int16"),
    (lambda: compute_scale_zero_point(X, "bf16", amax=1.0),
     "bf16 is a plain cast with no scale; pass amax=None, amin=None"),
    (lambda: compute_scale_zero_point(X, "fp16", amin=1.0),
     "fp16 is a plain cast with no scale; pass amax=None, amin=None"),
    (lambda: compute_scale_zero_point(X, "int8", amin=-1.0),
     "int8: amin applies to asymmetric int only (symmetric=False); "
     "a symmetric scale reads amax = max |x|"),
    (lambda: compute_scale_zero_point(X, "int8", tensor_scale=1.0),
     "int8: tensor_scale applies to nvfp4 only; pass None"),
    (lambda: compute_scale_zero_point(X, "int8", amax=-1.0),
     "int8: amax is max |x| per group and must be >= 0"),
    (lambda: compute_scale_zero_point(X, "int8", amax=np.inf),
     "int8: amax must be finite in every group"),
    (lambda: compute_scale_zero_point(X, "int8", symmetric=False, amax=np.inf),
     "int8: amax must be finite in every group"),
    (lambda: compute_scale_zero_point(X, "int8", symmetric=False, amin=np.nan),
     "int8: amin must be finite in every group"),
    (lambda: compute_scale_zero_point(X, "int8", amax=np.ones(3)),  # (3,) vs (2, 1): (2, 3)
     "int8: amax has shape (3,); " + SHAPE_MSG.format((2, 1))),
    (lambda: compute_scale_zero_point(X, "int8", amax=np.ones((2, 4))),  # broadcasts, too big
     "int8: amax has shape (2, 4); " + SHAPE_MSG.format((2, 1))),
    (lambda: compute_scale_zero_point(X, "int8", symmetric=False, amin=np.ones((3, 1))),
     "int8: amin has shape (3, 1); " + SHAPE_MSG.format((2, 1))),  # no broadcast at all
    (lambda: compute_scale_zero_point(B16, "nvfp4", tensor_scale=-1.0),
     "nvfp4: every tensor_scale must be positive and finite"),
    (lambda: compute_scale_zero_point(B16, "nvfp4", tensor_scale=0.0),
     "nvfp4: every tensor_scale must be positive and finite"),
    (lambda: compute_scale_zero_point(B16, "nvfp4", tensor_scale=np.ones(3)),
     "nvfp4: tensor_scale has shape (3,); " + SHAPE_MSG.format((1, 1))),
    (lambda: quantize_with_scale_zero_point(X, "fp8_e4m3", 1.0, 0),
     "fp8_e4m3: zero_point exists only for int8, int4 and int2; pass None"),
    (lambda: quantize_with_scale_zero_point(X, "bf16", 1.0),
     "bf16 is a plain cast with no scale; pass scale=None"),
    (lambda: quantize_with_scale_zero_point(X, "int8", None),
     "int8 needs a scale; get one from compute_scale_zero_point"),
    (lambda: quantize_with_scale_zero_point(B16, "nvfp4", 1.0),
     "nvfp4 needs scale=NVFP4Scale(block, tensor) (E4M3 block scales and a float32 tensor "
     "scale), as compute_scale_zero_point returns"),
    (lambda: quantize_with_scale_zero_point(B16, "nvfp4", (1.0, 1.0, 1.0)),
     "nvfp4 needs scale=NVFP4Scale(block, tensor) (E4M3 block scales and a float32 tensor "
     "scale), as compute_scale_zero_point returns"),
    (lambda: quantize_with_scale_zero_point(B16, "nvfp4", (-1.0, 1.0)),
     "nvfp4: every block scale must be finite and >= 0"),
    (lambda: quantize_with_scale_zero_point(B16, "nvfp4", (np.inf, 1.0)),
     "nvfp4: every block scale must be finite and >= 0"),
    (lambda: quantize_with_scale_zero_point(B16, "nvfp4", (1.0, 0.0)),
     "nvfp4: every tensor scale must be positive and finite"),
    (lambda: quantize_with_scale_zero_point(B16, "nvfp4", (1.0, np.ones(3))),
     "nvfp4: tensor scale has shape (3,); " + SHAPE_MSG.format((1, 1))),
    (lambda: quantize_with_scale_zero_point(B16, "nvfp4", (np.ones(3), 1.0)),
     "nvfp4: block scale has shape (3,); " + SHAPE_MSG.format((1, 1))),
    (lambda: quantize_with_scale_zero_point(B32, "mxfp8", 1.0),
     "mxfp8: scale must be E8M0 codes (uint8, scale 2^(code-127)), got float32"),
    (lambda: quantize_with_scale_zero_point(B32, "mxfp8", np.uint8(255)),
     "mxfp8: E8M0 scale codes must lie in [0, 254] (255 is NaN)"),
    (lambda: quantize_with_scale_zero_point(B32, "mxfp4", np.int32(-1)),
     "mxfp4: E8M0 scale codes must lie in [0, 254] (255 is NaN)"),
    (lambda: quantize_with_scale_zero_point(B32, "mxfp4", np.ones(3, np.uint8)),
     "mxfp4: scale has shape (3,); " + SHAPE_MSG.format((1, 1))),
    (lambda: quantize_with_scale_zero_point(X, "int8", 0.0),
     "int8: every scale must be positive and finite"),
    (lambda: quantize_with_scale_zero_point(X, "int8", np.nan),
     "int8: every scale must be positive and finite"),
    (lambda: quantize_with_scale_zero_point(X, "int8", np.ones(3, np.float32)),
     "int8: scale has shape (3,); " + SHAPE_MSG.format((2, 1))),
    (lambda: quantize_with_scale_zero_point(X, "int2", 1.0),
     "int2 is asymmetric: pass zero_point (float32, one per scale) as "
     "compute_scale_zero_point returns it"),
    (lambda: quantize_with_scale_zero_point(X, "int2", 1.0, np.inf),
     "int2: every zero_point must be finite"),
    (lambda: quantize_with_scale_zero_point(X, "int2", 1.0, np.ones(3)),
     "int2: zero_point has shape (3,); " + SHAPE_MSG.format((2, 1))),
    (lambda: quantize_with_scale_zero_point(X, "int8", 1.0, 128),
     "int8: zero_point must be an integer in [-128, 127]"),
    (lambda: quantize_with_scale_zero_point(X, "int8", 1.0, -129),
     "int8: zero_point must be an integer in [-128, 127]"),
    (lambda: quantize_with_scale_zero_point(X, "int4", 1.0, 8),
     "int4: zero_point must be an integer in [-8, 7]"),
    (lambda: quantize_with_scale_zero_point(X, "int4", 1.0, -9),
     "int4: zero_point must be an integer in [-8, 7]"),
    (lambda: quantize_with_scale_zero_point(X, "int4", 1.0, np.zeros(3, np.int8)),
     "int4: zero_point has shape (3,); " + SHAPE_MSG.format((2, 1))),
]  # fmt: skip


@pytest.mark.parametrize(("call", "message"), CASES)
def test_bad_argument_is_one_exact_line(call, message):
    with pytest.raises(ValueError) as err:
        call()
    assert str(err.value) == message


def test_the_edges_of_each_range_are_accepted():
    # Checks only: no quantization is run here (each call below would raise if rejected).
    from tenantq.numerics import resolve_layout

    int8 = resolve_layout(X.shape, "int8", symmetric=False)
    int4 = resolve_layout(X.shape, "int4", symmetric=False)
    mx = resolve_layout(B32.shape, "mxfp8")
    nv = resolve_layout(B16.shape, "nvfp4")
    for zp in (127, -128):
        assert codec._given_scales(int8, 1.0, zp)[1].tolist() == [[zp], [zp]]
    for zp in (7, -8):
        assert codec._given_scales(int4, 1.0, zp)[1].dtype == jnp.int8
    for code in (0, 254):
        assert codec._given_scales(mx, np.uint8(code), None)[0].tolist() == [[code]]
    block = codec._given_scales(nv, (0.0, 1.0), None)[0].block  # a zero block scale is fine
    assert block.dtype == ml_dtypes.float8_e4m3fn and block.astype(float).tolist() == [[0.0]]
    sym = resolve_layout(X.shape, "int8")
    assert codec._given_statistics(sym, 0.0, None, None)[0].tolist() == [[0.0], [0.0]]
    # asymmetric amax is the group's max x, which may be negative
    amax, amin, _ = codec._given_statistics(int8, -1.0, -3.0, None)
    assert amax.tolist() == [[-1.0], [-1.0]] and amin.tolist() == [[-3.0], [-3.0]]
    ts = codec._given_statistics(nv, None, None, 0.5)[2]
    assert ts.dtype == jnp.float32 and ts.tolist() == 0.5


def test_inside_jit_nothing_is_checked():
    # Tracers cannot be inspected: the checks step aside and the values flow through.
    def steps(x, amax, zp, code):
        scale, _ = compute_scale_zero_point(x, "int8", amax=amax)
        q = quantize_with_scale_zero_point(x, "int8", scale, zp)
        m = quantize_with_scale_zero_point(jnp.ones((1, 32)), "mxfp8", code)
        return scale, q.data, m.scale

    scale, data, code = jax.jit(steps)(X, jnp.float32(254), jnp.int8(-1), jnp.uint8(120))
    # amax 254 -> scale 2; 1 / 2 = 0.5 -> 0 (half to even), + zero point -1
    assert scale.tolist() == [[2.0], [2.0]] and data.tolist() == [[-1] * 4] * 2
    assert code.tolist() == [[120]]


def test_float64_beyond_float32_is_one_error_and_no_warning():
    # float64 1e300 becomes inf in float32: reported as the ValueError, without numpy's
    # overflow RuntimeWarning on the way (the cast runs under np.errstate(over="ignore")).
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError) as err:
            quantize(np.array([1e300, 1.0]), "int8")
    assert str(err.value) == f"quantize to int8: 1 of 2 {NOT_FINITE}"
