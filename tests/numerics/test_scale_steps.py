"""Quantization in two steps: `compute_scale_zero_point` then `quantize_with_scale_zero_point`.

Their composition must be `quantize` bit for bit (every stored byte, -0 and NaN included)
for every format, axis and group case, eagerly and inside jit/vmap; given statistics must
give the scales the format's formula gives; given scales must clip to the format's range
as documented. Expected codes are worked out by hand from the format's definition.
"""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest

from tenantq.numerics import (
    NVFP4Scale,
    compute_scale_zero_point,
    dequantize,
    quantize,
    quantize_with_scale_zero_point,
    unpack_fp4,
    unpack_int4,
)

X = np.random.default_rng(3).standard_t(3, size=(3, 5, 45)).astype(np.float32)
X[0, 0, :20] = 0.0  # an all-zero block / group
X[1, 2, 7] = -0.0

# (format, kwargs): every granularity a caller can ask for.
CASES = [
    ("bf16", {}),
    ("fp16", {}),
    ("fp8_e4m3", {"axis": -1}),
    ("fp8_e4m3", {"axis": None}),
    ("fp8_e4m3", {"axis": 1, "group_size": 2}),
    ("fp8_e5m2", {"axis": 0}),
    ("int8", {"axis": -1}),
    ("int8", {"axis": None}),
    ("int8", {"axis": -1, "group_size": 16, "symmetric": False}),
    ("int8", {"axis": None, "symmetric": False}),
    ("int4", {"axis": -1}),
    ("int4", {"axis": 1, "group_size": 2}),
    ("int4", {"axis": -1, "group_size": 8, "symmetric": False}),
    ("mxfp8", {"axis": -1}),
    ("mxfp8", {"axis": 0}),
    ("mxfp4", {"axis": -1}),
    ("mxfp4", {"axis": 1}),
    ("nvfp4", {"axis": -1}),
    ("nvfp4", {"axis": 0}),
]


def case_id(case):
    fmt, kwargs = case
    return fmt + "".join(f"-{k}={v}" for k, v in kwargs.items())


def raw(array) -> np.ndarray | None:
    """Raw bytes, so that -0/+0 and NaN payloads count as differences."""
    if array is None:
        return None
    return np.ascontiguousarray(np.atleast_1d(np.asarray(array))).view(np.uint8)


def assert_same_bytes(a, b):
    assert (a.shape, a.fmt, a.axis, a.group_size) == (b.shape, b.fmt, b.axis, b.group_size)
    for field in ("data", "scale", "zero_point", "tensor_scale"):
        x, y = raw(getattr(a, field)), raw(getattr(b, field))
        if x is None or y is None:
            assert x is None and y is None, field
        else:
            np.testing.assert_array_equal(x, y, err_msg=field)


def two_steps(x, fmt, kwargs):
    scale, zero_point = compute_scale_zero_point(x, fmt, **kwargs)
    step_kwargs = {k: v for k, v in kwargs.items() if k != "symmetric"}
    return quantize_with_scale_zero_point(x, fmt, scale, zero_point, **step_kwargs)


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_two_steps_equal_quantize_bit_for_bit(case):
    fmt, kwargs = case
    expected = quantize(X, fmt, **kwargs)
    assert_same_bytes(two_steps(X, fmt, kwargs), expected)
    # Inside a caller's jit, and vmapped over a leading batch, the bytes are the same.
    jitted = jax.jit(lambda x: two_steps(x, fmt, kwargs))(X)
    assert_same_bytes(jitted, expected)
    if kwargs.get("axis", -1) is not None:
        batched = jax.jit(jax.vmap(lambda x: two_steps(x, fmt, kwargs)))(X[None])
        for field in ("data", "scale", "zero_point", "tensor_scale"):
            value = getattr(batched, field)
            if value is not None:
                np.testing.assert_array_equal(raw(value[0]), raw(getattr(expected, field)))


def numpy_group_reduce(x, axis, group, reduce):
    """Reference per-group reduction with the scale's shape (partial last group real)."""
    if axis is None:
        return reduce(x).reshape((1,) * x.ndim)
    x = np.moveaxis(x, axis, -1)
    n = -(-x.shape[-1] // group)
    out = np.stack([reduce(x[..., i * group : (i + 1) * group], axis=-1) for i in range(n)], -1)
    return np.moveaxis(out, -1, axis)


@pytest.mark.parametrize(
    ("fmt", "kwargs", "group"),
    [
        ("int8", {"axis": -1}, 45),
        ("int4", {"axis": -1, "group_size": 16}, 16),
        ("fp8_e4m3", {"axis": 1}, 5),
        ("mxfp4", {"axis": -1}, 32),
        ("nvfp4", {"axis": -1}, 16),
    ],
)
def test_given_amax_equal_to_the_measured_one_gives_quantize(fmt, kwargs, group):
    # The documented meaning of amax: max |x| per group (per block for MX/nvfp4).
    amax = numpy_group_reduce(np.abs(X), kwargs["axis"], group, np.max)
    scale, zp = compute_scale_zero_point(X, fmt, amax=amax, **kwargs)
    assert_same_bytes(
        quantize_with_scale_zero_point(X, fmt, scale, zp, **kwargs), quantize(X, fmt, **kwargs)
    )


def test_given_amax_and_amin_for_asymmetric_int():
    # Asymmetric: amax = max x, amin = min x per group (not |x|); [min(lo,0), max(hi,0)].
    kwargs = {"axis": -1, "group_size": 9, "symmetric": False}
    hi = numpy_group_reduce(X, -1, 9, np.max)
    lo = numpy_group_reduce(X, -1, 9, np.min)
    got = compute_scale_zero_point(X, "int8", amax=hi, amin=lo, **kwargs)
    want = compute_scale_zero_point(X, "int8", **kwargs)
    np.testing.assert_array_equal(raw(got[0]), raw(want[0]))
    np.testing.assert_array_equal(raw(got[1]), raw(want[1]))
    # A clipping search's narrower range: scale = (hi - lo) / 255, here (2 - -1) / 255.
    scale, zp = compute_scale_zero_point(X, "int8", amax=2.0, amin=-1.0, **kwargs)
    np.testing.assert_array_equal(np.asarray(scale), np.float32(3.0) / np.float32(255))
    # zero point = round(-128 - lo / scale) = round(-128 + 85) = -43
    np.testing.assert_array_equal(np.asarray(zp), -43)


def test_nvfp4_given_amax_and_tensor_scale():
    # Given block amax: G = max(amax) / 2688 unless tensor_scale fixes it; s = e4m3(amax/6/G).
    x = np.linspace(-3, 3, 32, dtype=np.float32).reshape(1, 32)
    amax = np.array([[12.0, 1.5]], np.float32)  # a calibrated range wider than the data
    scale, _ = compute_scale_zero_point(x, "nvfp4", amax=amax)
    assert isinstance(scale, NVFP4Scale)
    g = np.float32(12.0) / np.float32(2688.0)
    np.testing.assert_array_equal(np.asarray(scale.tensor), g)
    target = (amax / np.float32(6.0)) / g
    np.testing.assert_array_equal(np.asarray(scale.block), target.astype(ml_dtypes.float8_e4m3fn))
    fixed, _ = compute_scale_zero_point(x, "nvfp4", tensor_scale=np.float32(0.5))
    np.testing.assert_array_equal(np.asarray(fixed.tensor), np.float32(0.5))
    block_amax = np.array([[3.0, 3.0]], np.float32)  # |x| max in each block of 16
    want = ((block_amax / np.float32(6)) / np.float32(0.5)).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(fixed.block), want)


# --- given scales clip to the format's range --------------------------------------------------


def int_codes(q):
    if q.fmt == "int4":
        return np.asarray(unpack_int4(q.data, q.shape[-1]))
    return np.asarray(q.data)


def test_given_scale_int_clips_to_the_grid():
    x = np.array([[300.0, -300.0, 126.5, -127.5, 6.5, -8.5]], np.float32)
    one = np.ones((1, 1), np.float32)
    # Symmetric grids are [-127, 127] and [-7, 7] (no -128/-8); ties round half to even.
    q8 = quantize_with_scale_zero_point(x, "int8", one, axis=-1)
    np.testing.assert_array_equal(int_codes(q8), [[127, -127, 126, -127, 6, -8]])
    q4 = quantize_with_scale_zero_point(x, "int4", one, axis=-1)
    np.testing.assert_array_equal(int_codes(q4), [[7, -7, 7, -7, 6, -7]])
    # Asymmetric grids are [-128, 127] and [-8, 7]: round(x / s) + zp, then clip.
    zp = np.zeros((1, 1), np.int8)
    a8 = quantize_with_scale_zero_point(x, "int8", one, zp, axis=-1)
    np.testing.assert_array_equal(int_codes(a8), [[127, -128, 126, -128, 6, -8]])
    a4 = quantize_with_scale_zero_point(x, "int4", one, np.full((1, 1), 3, np.int8), axis=-1)
    # 6.5 -> 6 + 3 = 9 -> 7; -8.5 -> -8 + 3 = -5; 126.5 -> 7; -127.5 -> -128 + 3 -> -8
    np.testing.assert_array_equal(int_codes(a4), [[7, -8, 7, -8, 7, -5]])


@pytest.mark.parametrize(
    ("fmt", "scale", "top"),
    [
        ("fp8_e4m3", np.ones((1, 1), np.float32), 448.0),  # OCP E4M3FN max finite
        ("fp8_e5m2", np.ones((1, 1), np.float32), 57344.0),  # OCP E5M2 max finite
        ("mxfp8", np.full((1, 1), 127, np.uint8), 448.0),  # E8M0 code 127 = 2^0
        ("mxfp4", np.full((1, 1), 127, np.uint8), 6.0),  # E2M1 max
        ("nvfp4", NVFP4Scale(np.ones((1, 1), ml_dtypes.float8_e4m3fn), np.float32(1)), 6.0),
    ],
)
def test_given_scale_float_formats_saturate(fmt, scale, top):
    # Beyond the format's range a value saturates at +-max finite (never NaN or inf, which a
    # plain ml_dtypes cast of 1e6 to E4M3FN would give).
    x = np.array([[1e6, -1e6, 1.0, -1.0] + [0.0] * 12], np.float32)
    got = np.asarray(dequantize(quantize_with_scale_zero_point(x, fmt, scale, axis=-1)))
    np.testing.assert_array_equal(got[0, :4], [top, -top, 1.0, -1.0])


def test_given_amax_below_the_data_saturates():
    # amax = 1 gives scale 1/127; 2 and -3 lie beyond it and clip to +-127 codes.
    x = np.array([[0.25, 2.0, -3.0]], np.float32)
    scale, _ = compute_scale_zero_point(x, "int8", axis=-1, amax=np.ones((1, 1)))
    np.testing.assert_array_equal(np.asarray(scale), np.float32(1) / np.float32(127))
    q = quantize_with_scale_zero_point(x, "int8", scale, axis=-1)
    np.testing.assert_array_equal(int_codes(q), [[32, 127, -127]])  # 0.25 * 127 = 31.75 -> 32


def test_static_scale_broadcasts_per_head():
    # One scale per KV head (vLLM-style static scales): shape [1, heads, 1] broadcasts.
    x = np.random.default_rng(0).standard_normal((4, 2, 8)).astype(np.float32)
    head_scale = np.array([[[0.5], [0.25]]], np.float32)
    q = quantize_with_scale_zero_point(x, "fp8_e4m3", head_scale, axis=-1)
    assert q.scale.shape == (4, 2, 1)
    want = (x / head_scale).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(raw(q.data), raw(want))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: compute_scale_zero_point(X, "int8", amin=0.0), "amin applies to asymmetric"),
        (lambda: compute_scale_zero_point(X, "bf16", amax=1.0), "plain cast with no scale"),
        (lambda: compute_scale_zero_point(X, "int8", amax=-1.0), "amax .* must be >= 0"),
        (lambda: compute_scale_zero_point(X, "int8", amax=np.inf), "amax must be finite"),
        (
            lambda: compute_scale_zero_point(X, "int8", amax=np.ones((3, 5, 2))),
            r"amax has shape \(3, 5, 2\); it must broadcast to the scale shape \(3, 5, 1\)",
        ),
        (lambda: compute_scale_zero_point(X, "int8", tensor_scale=1.0), "nvfp4 only"),
        (
            lambda: quantize_with_scale_zero_point(X, "int8", np.zeros((3, 5, 1))),
            "every scale must be positive and finite",
        ),
        (lambda: quantize_with_scale_zero_point(X, "int8", None), "needs a scale"),
        (lambda: quantize_with_scale_zero_point(X, "fp16", 1.0), "pass scale=None"),
        (lambda: quantize_with_scale_zero_point(X, "mxfp8", 1.0), "E8M0 codes"),
        (
            lambda: quantize_with_scale_zero_point(X, "mxfp8", np.uint8(255)),
            r"codes must lie in \[0, 254\]",
        ),
        (lambda: quantize_with_scale_zero_point(X, "nvfp4", 1.0), "NVFP4Scale"),
        (
            lambda: quantize_with_scale_zero_point(X, "fp8_e4m3", 1.0, np.int8(0)),
            "zero_point exists only for int8, int4 and int2",
        ),
        (
            lambda: quantize_with_scale_zero_point(X, "int4", 1.0, np.int8(9)),
            r"zero_point must be an integer in \[-8, 7\]",
        ),
    ],
)
def test_bad_statistics_and_scales_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- issue 9: correctly rounded scales under jit ------------------------------------------------


def test_int4_example_codes_with_true_division():
    # amax 21 / qmax 7 = 3 exactly; 4.5 / 3 = 1.5 is a tie that rounds half to even: 2.
    # XLA's reciprocal rewrite gives 21 * (1/7) = 3.0000002 and 4.5 / that = 1.4999999 -> 1.
    x = np.array([21.0, 7.5, 4.5, -7.5], np.float32)
    for q in (
        quantize(x, "int4", axis=None),
        jax.jit(lambda v: quantize(v, "int4", axis=None))(x),
        jax.jit(jax.vmap(lambda v: quantize(v, "int4", axis=None)))(x[None]),
    ):
        np.testing.assert_array_equal(np.asarray(q.scale).reshape(-1), [3.0])
        codes = np.asarray(unpack_int4(q.data, 4)).reshape(-1)
        np.testing.assert_array_equal(codes, [7, 2, 2, -2])


AMAX = np.random.default_rng(11).uniform(1e-3, 1e3, size=(64, 1)).astype(np.float32)


@pytest.mark.parametrize(
    ("fmt", "divisor"), [("int8", 127), ("int4", 7), ("fp8_e4m3", 448), ("fp8_e5m2", 57344)]
)
def test_jitted_scales_equal_numpy_division(fmt, divisor):
    # scale = amax / qmax with IEEE division (numpy float32), not amax * (1 / qmax).
    want = AMAX / np.float32(divisor)
    x = np.concatenate([AMAX, -AMAX / 2], axis=1)  # rows whose amax is AMAX
    for scale in (
        compute_scale_zero_point(x, fmt, axis=-1)[0],
        jax.jit(lambda v: compute_scale_zero_point(v, fmt, axis=-1)[0])(x),
        jax.jit(lambda v: quantize(v, fmt, axis=-1).scale)(x),
        jax.jit(jax.vmap(lambda v: quantize(v, fmt, axis=-1).scale))(x[None])[0],
    ):
        np.testing.assert_array_equal(np.asarray(scale), want)
    # ... and the elements are x / scale correctly rounded too: the -amax/2 column.
    y = (-AMAX / 2) / want
    q = jax.jit(lambda v: quantize(v, fmt, axis=-1))(x)
    if fmt.startswith("int"):
        codes = int_codes(q)[:, 1:2]
        np.testing.assert_array_equal(codes, np.round(y))
    else:
        dtype = ml_dtypes.float8_e4m3fn if fmt == "fp8_e4m3" else ml_dtypes.float8_e5m2
        np.testing.assert_array_equal(raw(q.data[:, 1:2]), raw(y.astype(dtype)))


def test_jitted_asymmetric_and_nvfp4_scales_equal_numpy_division():
    x = np.concatenate([AMAX, -AMAX / 3], axis=1)
    # asymmetric int8: (hi - lo) / 255 with hi = AMAX, lo = -AMAX / 3
    span = x[:, :1] - x[:, 1:]
    scale = jax.jit(lambda v: quantize(v, "int8", axis=-1, symmetric=False).scale)(x)
    np.testing.assert_array_equal(np.asarray(scale), span / np.float32(255))
    # nvfp4: G = amax / 2688, block scale = e4m3((amax_b / 6) / G), one block per row
    wide = np.zeros((64, 16), np.float32)
    wide[:, :2] = x
    q = jax.jit(lambda v: quantize(v, "nvfp4", axis=-1))(wide)
    g = np.float32(AMAX.max()) / np.float32(2688)
    np.testing.assert_array_equal(np.asarray(q.tensor_scale), g)
    block = ((AMAX / np.float32(6)) / g).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(raw(q.scale), raw(block))


# --- issue 9: negative zero in E2M1 -------------------------------------------------------------


def test_e2m1_sign_of_zero_matches_ml_dtypes():
    # ml_dtypes' float4_e2m1fn (like torchao) keeps the sign: -0.1 -> -0 = code 0x8.
    y = np.array([-0.0, 0.0, -0.1, 0.1, -0.25, 0.25, -0.26, -5.0, 7.0, -7.0], np.float32)
    want = y.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    np.testing.assert_array_equal(want[:3], [8, 0, 8])  # the reference's own convention
    one = np.full((1, 1), 127, np.uint8)  # MX scale 2^0: elements are y itself
    q = quantize_with_scale_zero_point(y[None], "mxfp4", one, axis=-1)
    np.testing.assert_array_equal(np.asarray(unpack_fp4(q.data, y.size))[0], want)
    nv = NVFP4Scale(np.ones((1, 1), ml_dtypes.float8_e4m3fn), np.float32(1))
    q = quantize_with_scale_zero_point(y[None], "nvfp4", nv, axis=-1)
    np.testing.assert_array_equal(np.asarray(unpack_fp4(q.data, y.size))[0], want)


def test_negative_zero_through_quantize_dequantizes_to_minus_zero():
    # A small negative element in a block with max 6 (scale 1) rounds to -0 and stays -0.
    x = np.array([[6.0, -0.1, 0.1] + [0.0] * 29], np.float32)
    got = np.asarray(dequantize(quantize(x, "mxfp4", axis=-1)))
    assert np.signbit(got[0, 1]) and not np.signbit(got[0, 2]) and got[0, 1] == 0


# --- issue 15 survivor 1: round half to even is pinned ------------------------------------------


def test_int_ties_round_half_to_even():
    # [127, 2.5, -2.5, 0.5] at scale 1 -> [127, 2, -2, 0]: amax 127 / 127 = scale 1 exactly.
    # floor(x + 0.5) would give [127, 3, -2, 1]; round half away from zero [127, 3, -3, 1].
    x = np.array([[127.0, 2.5, -2.5, 0.5, 1.5, -1.5, 3.5]], np.float32)
    want = [[127, 2, -2, 0, 2, -2, 4]]
    np.testing.assert_array_equal(int_codes(quantize(x, "int8", axis=-1)), want)
    one = np.ones((1, 1), np.float32)
    np.testing.assert_array_equal(
        int_codes(quantize_with_scale_zero_point(x, "int4", one, axis=-1)),
        [[7, 2, -2, 0, 2, -2, 4]],  # 127 clips to int4's 7
    )
    # int4 through quantize: amax 7 / 7 = scale 1.
    x4 = np.array([[7.0, 2.5, -2.5, 0.5, 1.5, -1.5, 3.5]], np.float32)
    np.testing.assert_array_equal(
        int_codes(quantize(x4, "int4", axis=-1)), [[7, 2, -2, 0, 2, -2, 4]]
    )


@pytest.mark.parametrize(
    ("fmt", "ties", "want"),
    [
        # E4M3 has 3 mantissa bits: spacing 1/8 in [1, 2); midpoints go to the even mantissa.
        ("fp8_e4m3", [1.0625, 1.1875, -1.3125, 17.0], [1.0, 1.25, -1.25, 16.0]),
        ("mxfp8", [1.0625, 1.1875, -1.3125, 17.0], [1.0, 1.25, -1.25, 16.0]),
        # E5M2 has 2: spacing 1/4 in [1, 2).
        ("fp8_e5m2", [1.125, 1.375, -1.625], [1.0, 1.5, -1.5]),
        # E2M1 grid 0, 0.5, 1, 1.5, 2, 3, 4, 6: every midpoint and its even neighbour.
        ("mxfp4", [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0], [0, 1, 1, 2, 2, 4, 4, -4]),
        ("nvfp4", [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0], [0, 1, 1, 2, 2, 4, 4, -4]),
    ],
)
def test_float_ties_round_half_to_even(fmt, ties, want):
    x = np.zeros((1, 32), np.float32)
    x[0, : len(ties)] = ties
    scale = {
        "fp8_e4m3": np.ones((1, 1), np.float32),
        "fp8_e5m2": np.ones((1, 1), np.float32),
        "mxfp8": np.full((1, 1), 127, np.uint8),
        "mxfp4": np.full((1, 1), 127, np.uint8),
        "nvfp4": NVFP4Scale(np.ones((1, 2), ml_dtypes.float8_e4m3fn), np.float32(1)),
    }[fmt]
    got = np.asarray(dequantize(quantize_with_scale_zero_point(x, fmt, scale, axis=-1)))
    np.testing.assert_array_equal(got[0, : len(ties)], np.asarray(want, np.float32))
