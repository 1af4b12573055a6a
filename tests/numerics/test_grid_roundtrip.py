"""Values already on a format's grid (with a scale the format reproduces exactly) must
come back bit for bit: any rounding, scale drift or packing slip shows up as a change.

Grids come from ml_dtypes (every finite code of the element type) and from integer
ranges, times powers of two so that the format's scale formula gives an exact scale.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from tenantq.numerics import dequantize, quantize

RNG = np.random.default_rng(7)


def all_finite_values(dtype) -> np.ndarray:
    """Every finite value of an 8-bit (or 4-bit, one per byte) ml_dtypes float type."""
    values = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)
    return np.unique(values[np.isfinite(values)])


def assert_round_trip(x, fmt, **kwargs):
    got = np.asarray(dequantize(quantize(x, fmt, **kwargs)))
    np.testing.assert_array_equal(got, x, err_msg=f"{fmt} {kwargs}")


@pytest.mark.parametrize(
    ("fmt", "dtype", "max_finite"),
    [("fp8_e4m3", ml_dtypes.float8_e4m3fn, 448.0), ("fp8_e5m2", ml_dtypes.float8_e5m2, 57344.0)],
)
@pytest.mark.parametrize("power", [-20, 0, 37])
def test_fp8_grid(fmt, dtype, max_finite, power):
    # scale = amax / max_finite = 2^power exactly when the max code is present.
    grid = all_finite_values(dtype)
    x = RNG.permutation(np.concatenate([grid, [max_finite]])).astype(np.float32)
    x = np.ldexp(x, power).astype(np.float32)
    assert_round_trip(x, fmt, axis=None)


@pytest.mark.parametrize("power", [-30, -3, 40])
def test_int8_and_int4_symmetric_grid(power):
    # scale = amax / qmax = 2^power exactly when +-qmax*2^power is in the group.
    for fmt, qmax in (("int8", 127), ("int4", 7)):
        k = RNG.integers(-qmax, qmax + 1, size=(4, 64))
        k[:, 0] = qmax
        assert_round_trip(np.ldexp(k, power).astype(np.float32), fmt, axis=-1, group_size=64)


def test_int_asymmetric_grid():
    # lo = -100s, hi = 155s: scale = 255s/255 = s and zero point round(-128+100) = -28,
    # so (k - zp) * s for k in [-128, 127] is reproduced exactly (int8; int4 alike).
    s = 2.0**-5
    for fmt, qmin, qmax, zp in (("int8", -128, 127, -28), ("int4", -8, 7, -3)):
        k = RNG.integers(qmin, qmax + 1, size=(3, 50))
        k[:, 0], k[:, 1] = qmin, qmax
        x = ((k - zp) * s).astype(np.float32)
        q = quantize(x, fmt, axis=-1, group_size=50, symmetric=False)
        np.testing.assert_array_equal(np.asarray(q.zero_point), zp)
        np.testing.assert_array_equal(np.asarray(dequantize(q)), x)


@pytest.mark.parametrize(("fmt", "dtype"), [("bf16", ml_dtypes.bfloat16), ("fp16", np.float16)])
def test_cast_grid(fmt, dtype):
    bits = RNG.integers(0, 2**16, size=500, dtype=np.uint16)
    x = bits.view(dtype).astype(np.float32)
    x = x[np.isfinite(x) & (np.abs(x) >= 2.0**-14)]  # XLA:CPU flushes float32 subnormals
    assert_round_trip(x, fmt)


@pytest.mark.parametrize(
    ("fmt", "dtype", "top"),
    [
        ("mxfp8", ml_dtypes.float8_e4m3fn, (256.0, 448.0)),
        ("mxfp4", ml_dtypes.float4_e2m1fn, (4.0, 6.0)),
    ],
)
def test_mx_grid(fmt, dtype, top):
    # A block whose max is in [2^emax, max_finite] gets X = 2^(emax - emax) * 2^p = 2^p,
    # so grid values times 2^p survive; each block gets its own power p.
    grid = all_finite_values(dtype)
    blocks = RNG.choice(grid, size=(6, 32)).astype(np.float32)
    blocks[:, 0] = RNG.choice(top, size=6) * RNG.choice([-1, 1], size=6)
    powers = np.array([-100, -7, 0, 3, 30, 90])[:, None]
    x = np.ldexp(blocks, powers).astype(np.float32).reshape(2, 3 * 32)
    assert_round_trip(x, fmt, axis=-1)


def test_nvfp4_grid():
    # Tensor scale G = 2688 * 2^-4 / 2688 = 2^-4 when one block max is 6 * 448 * 2^-4;
    # block b with max 6 * s_b * G has t = s_b exactly (s_b an e4m3 value), and
    # elements (E2M1 values) * s_b * G are reproduced.
    G = 2.0**-4
    e4m3 = all_finite_values(ml_dtypes.float8_e4m3fn)
    s_b = RNG.choice(e4m3[e4m3 > 0], size=8)
    s_b[0] = 448.0
    codes = RNG.choice(all_finite_values(ml_dtypes.float4_e2m1fn), size=(8, 16))
    codes[:, 3] = 6.0 * RNG.choice([-1, 1], size=8)
    x = (codes * s_b[:, None] * G).astype(np.float32).reshape(4, 32)
    assert_round_trip(x, "nvfp4", axis=-1)
