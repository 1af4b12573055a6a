"""Per-element error bounds of every format, derived from the format, on awkward data.

Every bound is evaluated in float64 from the stored scales, and each stored scale is
checked separately against the formula the format prescribes, so a wrong scale and a
wrong element rounding both fail. Element-format facts (mantissa bits m, smallest normal
exponent emin, largest finite value) are typed in from the specs, not read from tenantq.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from tenantq.numerics import dequantize, quantize

# Element formats, from the specs: (mantissa bits m, min normal exponent emin, max finite).
# IEEE binary16 / bfloat16; OCP 8-bit FP v1.0 (E4M3FN, E5M2); OCP MX v1.0 (E2M1).
ELEMENT = {
    "bfloat16": (7, -126, 3.3895313892515355e38),
    "float16": (10, -14, 65504.0),
    "e4m3": (3, -6, 448.0),
    "e5m2": (2, -14, 57344.0),
    "e2m1": (1, 0, 6.0),
}
EMAX = {"e4m3": 8, "e2m1": 2}  # exponent of the largest power of two (OCP MX v1.0 6.3)

# float32 arithmetic slack: a division and a multiplication each add <= 2^-24 relative
# error, and XLA:CPU flushes results below 2^-126 to zero.
F32_REL = 2.0**-21
F32_ABS = 2.0**-126


def float_element_error(y, element):
    """Largest |y - round(y)| for rounding float64 `y` to the element format.

    In [2^e, 2^(e+1)) the spacing is 2^(e-m), so round-to-nearest errs by at most half
    of it, 2^(e-m-1) <= 2^-(m+1) |y|. Below 2^emin (subnormals) the spacing is a constant
    2^(emin-m), half of it 2^(emin-m-1). Beyond max finite the cast saturates: |y| - max.
    """
    m, emin, max_finite = ELEMENT[element]
    rounding = np.maximum(2.0 ** -(m + 1) * np.abs(y), 2.0 ** (emin - m - 1))
    return np.where(np.abs(y) > max_finite, np.abs(y) - max_finite, rounding)


def per_group(q, values):
    """Per-group array (the scale's shape) broadcast to every element of q's shape."""
    values = np.asarray(values, dtype=np.float64)
    if q.axis is not None and values.shape[q.axis] > 1:
        values = np.repeat(values, q.group_size, axis=q.axis)
        values = np.take(values, np.arange(q.shape[q.axis]), axis=q.axis)
    return np.broadcast_to(values, q.shape)


def group_reduce(q, x, reduce):
    """Reference reduction of x over q's groups, broadcast back to every element."""
    if q.axis is None:
        return np.broadcast_to(reduce(x), x.shape)
    g = q.group_size or x.shape[q.axis]
    n = math.ceil(x.shape[q.axis] / g)
    moved = np.moveaxis(x, q.axis, -1)
    pad = np.zeros(moved.shape[:-1] + (n * g - moved.shape[-1],), x.dtype)
    grouped = np.concatenate([moved, pad], axis=-1).reshape(moved.shape[:-1] + (n, g))
    out = np.repeat(reduce(grouped, axis=-1), g, axis=-1)[..., : moved.shape[-1]]
    return np.moveaxis(out, -1, q.axis)


# --- the data ----------------------------------------------------------------------------


def cases(shape, seed=0):
    """Named test tensors of `shape`: distributions, special blocks, extreme magnitudes."""
    rng = np.random.default_rng(seed)
    normal = rng.standard_normal(shape)
    out = {
        "normal": normal,
        "student_t_df2": rng.standard_t(2, shape),
        "uniform_positive": rng.uniform(0, 3, shape),
        "huge_1e30": normal * 1e30,
        "tiny_1e-30": normal * 1e-30,
        "mixed_1e-12_to_1e12": normal * 10.0 ** rng.uniform(-12, 12, shape),
        "all_zero": np.zeros(shape),
        "constant": np.full(shape, -2.75),
    }
    outliers = normal.copy()  # a few channels (last-axis indices) 100x larger
    outliers[..., :: max(1, shape[-1] // 3)] *= 100.0
    out["outlier_channels_x100"] = outliers
    blocks = normal.copy()  # a zero block, a single-value block, one lone spike
    blocks[..., :33] = 0.0
    blocks[..., 33:50] = 1.5
    blocks.reshape(-1)[-1] = 40.0
    out["zero_and_constant_blocks"] = blocks
    return {name: v.astype(np.float32) for name, v in out.items()}


SHAPES = [(3, 37), (2, 5, 45)]  # odd last axes, lengths not multiples of any group


# --- bounds per family ---------------------------------------------------------------------


def check_cast(x, q, element):
    """bf16/fp16: round to nearest on the element grid; beyond max finite, saturate."""
    _, _, max_finite = ELEMENT[element]
    got = np.asarray(dequantize(q), np.float64)
    x64 = x.astype(np.float64)
    over = np.abs(x64) > max_finite
    np.testing.assert_array_equal(got[over], np.sign(x64[over]) * max_finite)
    bound = float_element_error(x64, element) + F32_ABS
    assert np.all(np.abs(got - x64)[~over] <= bound[~over])


def check_fp8(x, q, element):
    """fp8: scale = amax/max_finite per group, so |x/scale| <= max and the element
    rounding bound applies to y = x/scale, times scale, plus float32 slack."""
    _, _, max_finite = ELEMENT[element]
    x64 = x.astype(np.float64)
    amax = group_reduce(q, np.abs(x), np.max).astype(np.float64)
    scale = per_group(q, q.scale)
    # The scale is the correctly rounded float32 quotient (issue 9), bit for bit.
    with np.errstate(under="ignore"):
        quotient = amax.astype(np.float32) / np.float32(max_finite)
    expected = np.where(quotient >= F32_ABS, quotient, np.float32(1.0))
    np.testing.assert_array_equal(scale, expected)  # float32 -> float64 is exact
    y = x64 / scale
    assert np.all(np.abs(y) <= max_finite * (1 + 2**-22))  # amax scaling never saturates
    bound = float_element_error(y, element) * scale + F32_REL * np.abs(x64) + F32_ABS
    assert np.all(np.abs(np.asarray(dequantize(q), np.float64) - x64) <= bound)


def check_int(x, q, bits, symmetric):
    """int: |x - x_hat| <= scale/2 (round to nearest, never clipped: symmetric scale =
    amax/qmax maps amax to qmax; asymmetric scale = (hi-lo)/levels maps [lo, hi] onto
    [qmin, qmax]), plus float32 slack on the division and the multiplication."""
    qmax = 2 ** (bits - 1) - 1
    x64 = x.astype(np.float64)
    scale = per_group(q, q.scale)
    if symmetric:
        amax = group_reduce(q, np.abs(x), np.max).astype(np.float64)
        with np.errstate(under="ignore"):
            quotient = amax.astype(np.float32) / np.float32(qmax)  # correctly rounded
        exact = np.where(quotient >= F32_ABS, quotient, np.float32(1.0))
        np.testing.assert_array_equal(scale, exact)  # float32 -> float64 is exact
        expected = exact.astype(np.float64)
        assert q.zero_point is None
    else:
        lo = np.minimum(group_reduce(q, x, np.min), 0).astype(np.float64)
        hi = np.maximum(group_reduce(q, x, np.max), 0).astype(np.float64)
        span = (hi - lo) / (2 * qmax + 1)
        expected = np.where(span >= F32_ABS, span, 1.0)
        zp = np.asarray(q.zero_point)
        assert zp.dtype == np.int8 and zp.shape == q.scale.shape
        assert zp.min() >= -qmax - 1 and zp.max() <= qmax
    np.testing.assert_allclose(scale, expected, rtol=2**-22)
    bound = scale / 2 * (1 + F32_REL) + F32_REL * np.abs(x64) + F32_ABS
    assert np.all(np.abs(np.asarray(dequantize(q), np.float64) - x64) <= bound)


def check_mx(x, q, element):
    """MX (OCP v1.0 6.3): X = 2^(floor(log2 amax) - emax_elem), clamped to E8M0's
    [2^-127, 2^127]. Then amax/X lies in [2^emax, 2^(emax+1)): up to 512 for E4M3 and 8
    for E2M1, above max_finite (448, 6), so the spec lets the largest elements saturate:
    their error is X*(|y| - max) < X*(2^(emax+1) - max) = 64X (E4M3) or 2X (E2M1),
    at most 12.5% / 25% of the block max. Everything else: the element rounding bound."""
    _, _, max_finite = ELEMENT[element]
    amax = group_reduce(q, np.abs(x), np.max).astype(np.float64)
    code = per_group(q, q.scale)
    assert q.scale.dtype == np.uint8
    with np.errstate(divide="ignore"):
        _, e = np.frexp(amax)  # amax = f * 2^e, f in [0.5, 1): floor(log2 amax) = e - 1
    expected_exp = np.where(amax >= F32_ABS, e - 1 - EMAX[element], -127)
    np.testing.assert_array_equal(code, np.clip(expected_exp, -127, 127) + 127)
    X = np.ldexp(1.0, (code - 127).astype(int))
    y = x.astype(np.float64) / X
    assert np.all(np.abs(y) < 2.0 ** (EMAX[element] + 1))
    bound = float_element_error(y, element) * X + F32_ABS
    assert np.all(np.abs(np.asarray(dequantize(q), np.float64) - x) <= bound)


def check_nvfp4(x, q):
    """NVFP4: G = amax/(448*6) (float32), block scale s = e4m3(amax_b/6/G), step S = s*G.
    e4m3 rounding of s: |s - t| <= max(2^-4 t, 2^-10) (3 mantissa bits; subnormal step
    2^-9). With s >= t(1 - 2^-4) the block max maps to |y| <= 6/(1 - 2^-4) = 6.4, so
    saturation adds at most 0.4*S; when t is e4m3-subnormal, s may be smaller and more
    saturates (still |y| - 6 per element). A block whose s rounds to 0 stores zeros
    (error |x| <= 6 * 2^-10 * G)."""
    x64 = x.astype(np.float64)
    amax_tensor = float(np.abs(x).max())
    G = float(q.tensor_scale)
    assert q.tensor_scale.dtype == np.float32 and q.tensor_scale.shape == ()
    quotient = np.float32(amax_tensor) / np.float32(2688.0)  # correctly rounded (issue 9)
    assert (quotient if quotient >= F32_ABS else 1.0) == G
    assert q.scale.dtype == ml_dtypes.float8_e4m3fn
    s = per_group(q, np.asarray(q.scale).astype(np.float64))
    t = group_reduce(q, np.abs(x), np.max).astype(np.float64) / 6.0 / G
    assert np.all(np.abs(s - t) <= np.maximum(2**-4 * t, 2**-10) * (1 + 2**-20))
    S = s * G
    got = np.asarray(dequantize(q), np.float64)
    zero_step = S == 0
    assert np.all(got[zero_step] == 0) and np.all(np.abs(x64[zero_step]) <= 6 * 2**-10 * G)
    y = np.divide(x64, S, out=np.zeros_like(x64), where=~zero_step)
    normal_scale = t >= 2**-6
    assert np.all(np.abs(y[normal_scale]) <= 6.0 / (1 - 2**-4) * (1 + 2**-20))
    bound = float_element_error(y, "e2m1") * S + F32_REL * np.abs(x64) + F32_ABS
    assert np.all(np.abs(got - x64)[~zero_step] <= bound[~zero_step])


# (format, quantize kwargs, checker) -- every granularity a caller can ask for.
CONFIGS = [
    ("bf16", {}, lambda x, q: check_cast(x, q, "bfloat16")),
    ("fp16", {}, lambda x, q: check_cast(x, q, "float16")),
    ("fp8_e4m3", {"axis": -1}, lambda x, q: check_fp8(x, q, "e4m3")),
    ("fp8_e4m3", {"axis": 0, "group_size": 2}, lambda x, q: check_fp8(x, q, "e4m3")),
    ("fp8_e4m3", {"axis": None}, lambda x, q: check_fp8(x, q, "e4m3")),
    ("fp8_e5m2", {"axis": -1, "group_size": 16}, lambda x, q: check_fp8(x, q, "e5m2")),
    ("int8", {"axis": -1}, lambda x, q: check_int(x, q, 8, True)),
    ("int8", {"axis": None}, lambda x, q: check_int(x, q, 8, True)),
    (
        "int8",
        {"axis": -1, "group_size": 5, "symmetric": False},
        lambda x, q: check_int(x, q, 8, False),
    ),
    ("int4", {"axis": -1}, lambda x, q: check_int(x, q, 4, True)),
    ("int4", {"axis": -1, "group_size": 16}, lambda x, q: check_int(x, q, 4, True)),
    (
        "int4",
        {"axis": 0, "group_size": 2, "symmetric": False},
        lambda x, q: check_int(x, q, 4, False),
    ),
    ("int4", {"axis": None, "symmetric": False}, lambda x, q: check_int(x, q, 4, False)),
    ("mxfp8", {"axis": -1}, lambda x, q: check_mx(x, q, "e4m3")),
    ("mxfp8", {"axis": 0}, lambda x, q: check_mx(x, q, "e4m3")),
    ("mxfp4", {"axis": -1}, lambda x, q: check_mx(x, q, "e2m1")),
    ("mxfp4", {"axis": 0}, lambda x, q: check_mx(x, q, "e2m1")),
    ("nvfp4", {"axis": -1}, check_nvfp4),
    ("nvfp4", {"axis": 0}, check_nvfp4),
]


def config_id(config):
    fmt, kwargs, _ = config
    return fmt + "".join(f"-{key}={value}" for key, value in kwargs.items())


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("config", CONFIGS, ids=[config_id(c) for c in CONFIGS])
def test_error_bound_per_element(config, shape):
    fmt, kwargs, check = config
    for name, x in cases(shape).items():
        q = quantize(x, fmt, **kwargs)
        try:
            check(x, q)
        except AssertionError as err:
            raise AssertionError(f"{fmt} {kwargs} {shape} data={name}: {err}") from err


def test_error_bound_on_1d_odd_length():
    """A lone vector of odd length: packing pads, the last block is partial."""
    for name, x in cases((67,), seed=2).items():
        try:
            check_int(x, quantize(x, "int4", axis=-1, group_size=16), 4, True)
            check_mx(x, quantize(x, "mxfp4", axis=-1), "e2m1")
            check_nvfp4(x, quantize(x, "nvfp4", axis=0))
            check_fp8(x, quantize(x, "fp8_e4m3", axis=None), "e4m3")
        except AssertionError as err:
            raise AssertionError(f"(67,) data={name}: {err}") from err


def test_error_bound_on_5d_kv_like_tensor():
    """ndim 5 (layers, batch, heads, tokens, head_dim) per token and per channel."""
    x = cases((2, 1, 3, 7, 40), seed=1)["student_t_df2"]
    for axis in (-1, 3):
        check_fp8(x, quantize(x, "fp8_e4m3", axis=axis), "e4m3")
        check_int(x, quantize(x, "int8", axis=axis), 8, True)
        check_mx(x, quantize(x, "mxfp8", axis=axis), "e4m3")
        check_nvfp4(x, quantize(x, "nvfp4", axis=axis))


def test_fp16_saturates_instead_of_overflowing():
    # IEEE binary16 max finite is 65504; a plain cast would give inf.
    q = quantize(np.array([1e30, -7e4, 65504.0, 1.0], np.float32), "fp16")
    np.testing.assert_array_equal(np.asarray(dequantize(q)), [65504.0, -65504.0, 65504.0, 1.0])


# Relative error bound at the block max 1e38 (= 1.1755 * 2^126), derived per format:
NEAR_MAX_BOUND = {
    # amax / (amax / 448) = 448 (to float32 rounding), which is on the E4M3 grid: only the
    # float32 roundings of the scale and of the product remain.
    "fp8_e4m3": F32_REL,
    # asymmetric, [lo, hi] = [-1e38, 1e38] onto 255 (15) steps: |error| <= scale / 2 =
    # 2e38 / 255 / 2, i.e. 1/255 (1/15) of 1e38, plus float32 slack.
    "int8": 1 / 255 + F32_REL,
    "int4": 1 / 15 + F32_REL,
    # MX: X = 2^(126 - emax); y = 1e38 / X = 1.1755 * 2^emax = 300.9 (E4M3) or 4.70 (E2M1),
    # below max finite (448, 6): no saturation, only element rounding 2^-(m+1) |y|.
    "mxfp8": 2.0**-4,
    "mxfp4": 2.0**-2,
    # nvfp4: G = amax / 2688, so the tensor's max block gets s = e4m3(448) = 448 and y = 6,
    # both on their grids: float32 slack only.
    "nvfp4": F32_REL,
}


@pytest.mark.parametrize("fmt", list(NEAR_MAX_BOUND))
def test_near_float32_max_stays_finite(fmt):
    # 1e38 is within float32 (max 3.4e38): scales, divisions and products must not overflow.
    x = np.array([[1e38, -1e38] + [1.0] * 30] * 2, np.float32)
    kwargs = {"symmetric": False} if fmt.startswith("int") else {}
    got = np.asarray(dequantize(quantize(x, fmt, **kwargs)), np.float64)
    assert np.isfinite(got).all()
    error = np.abs(got[:, :2] - x[:, :2]) / 1e38
    assert np.all(error <= NEAR_MAX_BOUND[fmt]), (fmt, error.max())


@pytest.mark.parametrize(
    ("fmt", "element", "power"), [("mxfp8", "e4m3", -122), ("mxfp4", "e2m1", -126)]
)
def test_mx_lowest_scale_code_zero(fmt, element, power):
    # amax in [2^p, 2^(p+1)) gives floor(log2 amax) - emax = p - 8 (E4M3) or p - 2 (E2M1),
    # below -127: E8M0 clamps to code 0 = 2^-127, a float32 subnormal that XLA:CPU would
    # flush; the (normal) elements must still come back within the bound.
    x = (np.random.default_rng(4).uniform(1, 2, size=(2, 32)) * 2.0**power).astype(np.float32)
    q = quantize(x, fmt, axis=-1)
    np.testing.assert_array_equal(np.asarray(q.scale), 0)
    check_mx(x, q, element)
    assert np.all(np.asarray(dequantize(q)) > 0)
