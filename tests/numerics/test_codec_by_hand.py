"""codec.py on tiny arrays with every expected code worked out by hand (fast enough for `make
mutation TARGETS=numerics-codec`): int round half to even and saturation at +-qmax, the
asymmetric [min(x, 0), max(x, 0)] -> [qmin, qmax] map, KIVI's int2 [min, max] / 3, OCP MX v1.0
sec. 6.3 scales (2^(floor(log2 amax) - emax), E8M0 codes 0..254, 0xFF NaN), NVFP4's two-level
scale (G = amax / (448 * 6), block = e4m3(amax_b / 6 / G)), fp8 casts rounding ties to even.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tenantq.numerics import (
    codec,
    compute_scale_zero_point,
    dequantize,
    layout_of,
    nvfp4_tensor_scale,
    quantize,
    quantize_with_scale_zero_point,
    resolve_layout,
    scale_float32,
)
from tenantq.numerics.packing import unpack_fp4, unpack_int2, unpack_int4

TINY = np.finfo(np.float32).tiny  # 2^-126, the smallest normal float32
E4M3 = ml_dtypes.float8_e4m3fn


def f32(values) -> np.ndarray:
    return np.asarray(values, np.float32)


def host(array) -> np.ndarray:
    return np.asarray(array)


# --- int: round half to even, saturation, asymmetric map ---------------------------------


def test_int8_ties_round_half_to_even_at_scale_one():
    # issue 15, survivor 1: amax 127 gives scale 127 / 127 = 1, so the codes are round(x):
    # 2.5 -> 2, -2.5 -> -2, 0.5 -> 0 (half to even), never floor(x + 0.5) = 3, -2, 1.
    q = quantize(f32([[127, 2.5, -2.5, 0.5]]), "int8")
    assert q.data.dtype == np.int8 and host(q.data).tolist() == [[127, 2, -2, 0]]
    assert host(q.scale).tolist() == [[1.0]] and q.zero_point is None
    assert host(dequantize(q)).tolist() == [[127, 2, -2, 0]]


def test_int4_codes_and_dequantize_at_scale_one():
    # amax 7 -> scale 7 / 7 = 1; 2.5 -> 2, -3.5 -> -4 (half to even); packed two per byte.
    q = quantize(f32([[7, 2.5, -3.5, 0.5, -7]]), "int4")
    assert q.data.dtype == np.uint8 and q.data.shape == (1, 3)
    assert host(unpack_int4(q.data, 5)).tolist() == [[7, 2, -4, 0, -7]]
    assert host(dequantize(q)).tolist() == [[7, 2, -4, 0, -7]]


def test_int8_scale_is_amax_over_127_per_row_by_default():
    # Default axis=-1: one scale per row; 254 / 127 = 2 and 381 / 127 = 3 exactly.
    q = quantize(f32([[254, -3, 1, 0], [-381, 6, 4.5, 1.5]]), "int8")
    assert host(q.scale).tolist() == [[2.0], [3.0]]
    # -3 / 2 = -1.5 -> -2; 1 / 2 = 0.5 -> 0; 6 / 3 = 2; 4.5 / 3 = 1.5 -> 2; 1.5 / 3 = 0.5 -> 0
    assert host(q.data).tolist() == [[127, -2, 0, 0], [-127, 2, 2, 0]]
    assert host(dequantize(q)).tolist() == [[254, -4, 0, 0], [-381, 6, 6, 0]]


def test_int8_asymmetric_scale_zero_point_and_codes():
    # lo = -51, hi = 204: scale (204 + 51) / 255 = 1, zero point round(-128 + 51) = -77.
    q = quantize(f32([[-51, 204, 0.5, 1.5]]), "int8", symmetric=False)
    assert host(q.scale).tolist() == [[1.0]] and host(q.zero_point).tolist() == [[-77]]
    assert q.zero_point.dtype == np.int8
    # 0.5 -> 0 - 77; 1.5 -> 2 - 77 (half to even)
    assert host(q.data).tolist() == [[-128, 127, -77, -75]]
    assert host(dequantize(q)).tolist() == [[-51, 204, 0, 2]]


def test_int_asymmetric_range_always_holds_zero():
    # All positive: lo = min(10, 0) = 0, so scale 255 / 255 = 1 and the zero point -128.
    scale, zp = compute_scale_zero_point(f32([[10, 255]]), "int8", symmetric=False)
    assert host(scale).tolist() == [[1.0]] and host(zp).tolist() == [[-128]]
    # All negative: hi = max(-15, 0) = 0; int4 levels 15: scale 1, zp round(-8 + 15) = 7.
    scale, zp = compute_scale_zero_point(f32([[-15, -3]]), "int4", symmetric=False)
    assert host(scale).tolist() == [[1.0]] and host(zp).tolist() == [[7]]
    q = quantize(f32([[-15, -3]]), "int4", symmetric=False)
    assert host(unpack_int4(q.data, 2)).tolist() == [[-8, 4]]  # -15 + 7, -3 + 7


def test_int_asymmetric_span_beyond_float32_max_is_split():
    # hi - lo = 6e38 overflows float32: scale = hi / 255 - lo / 255 instead.
    x = f32([[-3e38, 3e38]])
    scale, zp = compute_scale_zero_point(x, "int8", symmetric=False)
    want = np.float32(3e38) / np.float32(255) * np.float32(2)
    assert host(scale).tolist() == [[want]]
    # zero point round(-128 + 3e38 / scale) = round(-128 + 127.5) = round(-0.5) = 0
    assert host(zp).tolist() == [[0]]
    assert np.isfinite(host(dequantize(quantize(x, "int8", symmetric=False)))).all()


def test_int_zero_tensor_and_tiny_scale():
    # amax 0 gives scale 0 / 127, not a usable scale: stored as 1, every code 0.
    q = quantize(f32([[0, 0]]), "int8")
    assert host(q.scale).tolist() == [[1.0]] and host(q.data).tolist() == [[0, 0]]
    # amax 127 * 2^-126: scale exactly 2^-126, the smallest normal, is kept (>= tiny).
    q = quantize(f32([[127 * TINY, -TINY]]), "int8")
    assert host(q.scale).tolist() == [[TINY]] and host(q.data).tolist() == [[127, -1]]
    # amax 1e-37: 1e-37 / 127 is subnormal (XLA:CPU flushes it): stored as 1, codes 0.
    q = quantize(f32([[1e-37, -1e-37]]), "int8")
    assert host(q.scale).tolist() == [[1.0]] and host(q.data).tolist() == [[0, 0]]
    # asymmetric: a zero group has span 0 -> scale 1, zero point round(-128 - 0) = -128
    scale, zp = compute_scale_zero_point(f32([[0, 0]]), "int8", symmetric=False)
    assert host(scale).tolist() == [[1.0]] and host(zp).tolist() == [[-128]]


def test_given_int_scale_saturates_at_the_grid():
    # Symmetric int8 grid [-127, 127], asymmetric [-128, 127] with the zero point added
    # before clipping; a float zero point given to int8 is cast to int8.
    x = f32([[300, -300, 3.5]])
    q = quantize_with_scale_zero_point(x, "int8", f32([[1.0]]))
    assert host(q.data).tolist() == [[127, -127, 4]]
    q = quantize_with_scale_zero_point(x, "int8", f32([[1.0]]), np.int8(-2))
    assert host(q.data).tolist() == [[127, -128, 2]] and host(q.zero_point).tolist() == [[-2]]
    assert host(dequantize(q)).tolist() == [[129, -126, 4]]
    # int4 asymmetric grid [-8, 7]: -300 + 3 clips to -8 (a -9 would wrap to nibble 7)
    q = quantize_with_scale_zero_point(f32([[-300, 300]]), "int4", f32([[1.0]]), np.int8(3))
    assert host(unpack_int4(q.data, 2)).tolist() == [[-8, 7]]


def test_group_size_scales_each_group_and_the_partial_last_one():
    # Groups of 3 along the last axis of 7: [0:3], [3:6], [6:7]; amax 127, 254, 381.
    x = f32([[127, 1, -1, -254, 2, 2, -381]])
    q = quantize(x, "int8", group_size=3)
    assert q.group_size == 3 and host(q.scale).tolist() == [[1.0, 2.0, 3.0]]
    assert host(q.data).tolist() == [[127, 1, -1, -127, 1, 1, -127]]
    assert host(dequantize(q)).tolist() == [[127, 1, -1, -254, 2, 2, -381]]
    # Asymmetric partial group [-381]: lo = -381, hi = max(-381, 0) = 0 (the zero padding of
    # the partial group changes neither); scale 381 / 255, zero point 127.
    scale, zp = compute_scale_zero_point(x, "int8", group_size=3, symmetric=False)
    assert host(scale)[0, 2] == np.float32(381) / np.float32(255)
    # round(-128 - lo / scale): -128 + 1 * 255 / 128 -> -126; -128 + 254 * 255 / 256 -> 125;
    # -128 + 381 * 255 / 381 = 127
    assert host(zp).tolist() == [[-126, 125, 127]]


def test_given_scales_follow_the_axis_and_group_size_asked_for():
    # The same scales quantize() derives (amax 127, 254, 381 per group of 3 -> 1, 2, 3).
    x = f32([[127, 1, -1, -254, 2, 2, -381]])
    q = quantize_with_scale_zero_point(x, "int8", f32([[1, 2, 3]]), group_size=3)
    assert q.group_size == 3 and host(q.data).tolist() == [[127, 1, -1, -127, 1, 1, -127]]
    q = quantize_with_scale_zero_point(f32([[127, 2], [-4, 254]]), "int8", f32([[1, 2]]), axis=0)
    assert q.axis == 0 and host(q.data).tolist() == [[127, 1], [-4, 127]]


def test_groups_along_axis_zero_and_one_scale_per_tensor():
    x = f32([[127, 2], [-4, 254], [127, -508]])
    q = quantize(x, "int8", axis=0, group_size=2)  # groups [0:2], [2:3] down each column
    assert q.axis == 0 and host(q.scale).tolist() == [[1.0, 2.0], [1.0, 4.0]]
    assert host(q.data).tolist() == [[127, 1], [-4, 127], [127, -127]]
    q = quantize(x, "int8", axis=None)  # one scale, 508 / 127 = 4
    assert q.axis is None and host(q.scale).tolist() == [[4.0]]
    # 31.75 -> 32, 0.5 -> 0 and 63.5 -> 64 (half to even)
    assert host(q.data).tolist() == [[32, 0], [-1, 64], [32, -127]]
    q = quantize(x, "int8", axis=0)  # whole columns: amax 127, 508
    assert host(q.scale).tolist() == [[1.0, 4.0]]
    scale, _ = compute_scale_zero_point(x, "int8", axis=0, group_size=2)
    assert host(scale).tolist() == [[1.0, 2.0], [1.0, 4.0]]
    scale, _ = compute_scale_zero_point(x, "int8", axis=None)
    assert host(scale).tolist() == [[4.0]]


# --- int2 (KIVI) -------------------------------------------------------------------------


def test_int2_scale_zero_point_and_codes():
    # lo 1, hi 10: scale (10 - 1) / 3 = 3, zero point -1 / 3; codes round(x / 3 - 1 / 3).
    x = f32([[1, 4, 7, 10, 5.5, 2.5]])
    scale, zp = compute_scale_zero_point(x, "int2")
    assert host(scale).tolist() == [[3.0]]
    assert host(zp).tolist() == [[-(np.float32(1) / np.float32(3))]]
    q = quantize(x, "int2")
    # 5.5 / 3 - 1/3 = 1.5 -> 2 and 2.5 / 3 - 1/3 = 0.5 -> 0 (ties to even, up to an ulp)
    assert host(unpack_int2(q.data, 6)).tolist() == [[0, 1, 2, 3, 2, 0]]
    got = host(dequantize(q))
    np.testing.assert_allclose(got, [[1, 4, 7, 10, 7, 1]], rtol=0, atol=4 * np.spacing(10.0))
    # codes beyond 0..3 clip: a given scale 1, zero point 0 maps -2 -> 0 and 9 -> 3
    q = quantize_with_scale_zero_point(f32([[-2, 9, 1.5]]), "int2", 1.0, 0.0)
    assert host(unpack_int2(q.data, 3)).tolist() == [[0, 3, 2]]


def test_int2_given_statistics_replace_the_measured_ones():
    # A calibrated [amin, amax] = [-2, 7] for data in [1, 4]: scale 9 / 3 = 3, zp 2 / 3.
    x = f32([[1, 4]])
    scale, zp = compute_scale_zero_point(x, "int2", amax=7.0, amin=-2.0)
    assert host(scale).tolist() == [[3.0]]
    assert host(zp).tolist() == [[np.float32(2) / np.float32(3)]]
    scale, zp = compute_scale_zero_point(x, "int2", amax=10.0)  # amin measured: 1
    assert host(scale).tolist() == [[3.0]]


def test_int2_span_beyond_float32_max_is_split():
    scale, zp = compute_scale_zero_point(f32([[-3e38, 3e38]]), "int2")
    want = np.float32(3e38) / np.float32(3) * np.float32(2)
    assert host(scale).tolist() == [[want]]
    assert host(zp).tolist() == [[np.float32(3e38) / want]]


# --- fp8: amax / max_finite, ties to even, saturation ---------------------------------


@pytest.mark.parametrize(
    ("fmt", "top", "x", "want"),
    [
        # E4M3 (3 mantissa bits): in [16, 32) the step is 2, so 17 is a tie -> 16 (even).
        ("fp8_e4m3", 448.0, [448, 17, -19, 0.3], [448, 16, -20, 0.3125]),
        # E5M2 (2 mantissa bits): in [16, 32) the step is 4: 18 -> 16, 22 -> 24.
        ("fp8_e5m2", 57344.0, [57344, 18, -22, 0.3], [57344, 16, -24, 0.3125]),
    ],
)
def test_fp8_scale_one_codes(fmt, top, x, want):
    q = quantize(f32([x]), fmt)  # amax = max_finite -> scale 1
    assert host(q.scale).tolist() == [[1.0]]
    assert host(q.data).astype(np.float32).tolist() == [want]
    assert host(dequantize(q)).tolist() == [want]
    # A given scale 1 saturates beyond the range: +-max_finite, never NaN or inf.
    q = quantize_with_scale_zero_point(f32([[1e6, -1e6]]), fmt, f32([[1.0]]))
    assert host(q.data).astype(np.float32).tolist() == [[top, -top]]


def test_fp8_scale_is_amax_over_448():
    q = quantize(f32([[896, -1, 0]]), "fp8_e4m3")  # scale 896 / 448 = 2
    assert host(q.scale).tolist() == [[2.0]]
    assert host(q.data).astype(np.float32).tolist() == [[448, -0.5, 0]]
    assert host(scale_float32(q)).tolist() == [[2.0]]
    assert host(dequantize(q)).tolist() == [[896, -1, 0]]  # codes times the scale 2


def test_scales_along_the_first_of_three_axes():
    # shape (2, 1, 3), axis 0: one scale per (1, 3) position, amax down axis 0 / 127
    x = f32([[[127, -254, 381]], [[-1, 2, 3]]])
    q = quantize(x, "int8", axis=0)
    assert q.scale.shape == (1, 1, 3) and host(q.scale).tolist() == [[[1.0, 2.0, 3.0]]]
    assert host(q.data).tolist() == [[[127, -127, 127]], [[-1, 1, 1]]]


def test_packed_formats_unpack_along_the_last_of_three_axes():
    # shape (1, 2, 32): the last axis (32 values) is packed, not axis 1 (2 values).
    x = np.zeros((1, 2, 32), np.float32)
    x[0, :, :4] = [[6, -3, 1, 0.5], [4, 2, -6, 1.5]]  # mxfp4 at code 127 (scale 1): exact
    x[0, :, 31] = [-1, 3]
    assert host(dequantize(quantize(x, "mxfp4"))).tolist() == x.tolist()
    q = quantize(x, "nvfp4")  # G = 6 / 2688; first blocks e4m3(6 / 6 / G) = 448: step 1
    assert host(dequantize(q))[..., :16].tolist() == x[..., :16].tolist()
    y = np.round(x)  # int4 at amax 6 -> scale 6 / 7; codes round(y * 7 / 6)
    q = quantize(y, "int4", axis=-1)
    assert q.data.shape == (1, 2, 16)
    codes = host(unpack_int4(q.data, 32))
    assert codes[0, :, :4].tolist() == [[7, -4, 1, 0], [5, 2, -7, 2]]
    want = codes.astype(np.float32) * (np.float32(6) / np.float32(7))  # code times scale
    np.testing.assert_array_equal(host(dequantize(q)), want)
    q = quantize(y, "int2")  # four codes to a byte along the last axis
    assert host(unpack_int2(q.data, 32)).shape == (1, 2, 32) and q.data.shape == (1, 2, 8)
    # rows span [-3, 6] and [-6, 4]: steps 9 / 3 and 10 / 3, so within half of 10 / 3
    got = host(dequantize(q))
    assert got.shape == (1, 2, 32) and np.abs(got - y).max() <= 10 / 6 + 1e-5


# --- MX: OCP MX v1.0 sec. 6.3 ----------------------------------------------------------


def test_mx_scale_codes_and_elements():
    x = f32([[1.0] + [0.5] * 30 + [-0.75]])
    # mxfp8: floor(log2 1) - 8 = -8 -> code 119; elements x * 2^8 (E4M3)
    q = quantize(x, "mxfp8")
    assert q.scale.dtype == np.uint8 and host(q.scale).tolist() == [[119]]
    data = host(q.data).astype(np.float32)
    assert data[0, :2].tolist() == [256, 128] and data[0, -1] == -192
    assert host(scale_float32(q)).tolist() == [[2.0**-8]]
    np.testing.assert_array_equal(host(dequantize(q)), x)
    # mxfp4: floor(log2 1) - 2 = -2 -> code 125; elements x * 4 = 4, 2, -3 (E2M1 codes 6, 4, 13)
    q = quantize(x, "mxfp4")
    assert host(q.scale).tolist() == [[125]]
    codes = host(unpack_fp4(q.data, 32))
    assert codes[0, :2].tolist() == [6, 4] and codes[0, -1] == 13
    np.testing.assert_array_equal(host(dequantize(q)), x)


def test_mx_scale_takes_the_floor_of_log2_amax():
    # amax 7.9: floor(log2 7.9) = 2 -> mxfp4 code 127 + 2 - 2 = 127; 7.9 saturates at 6.
    x = f32([[7.9, 1.2] + [0] * 30])
    q = quantize(x, "mxfp4")
    assert host(q.scale).tolist() == [[127]]
    assert host(dequantize(q))[0, :2].tolist() == [6.0, 1.0]
    # mxfp8 at the top of float32: floor(log2 3e38) = 127 -> code 127 + 127 - 8 = 246
    assert host(quantize(f32([[3e38] * 32]), "mxfp8").scale).tolist() == [[246]]


def test_given_amax_replaces_the_measured_one():
    x = np.ones((1, 16), np.float32)
    # MX: floor(log2 4) - 8 = -6 -> code 121 (the data's own amax 1 would give 119)
    scale, _ = compute_scale_zero_point(np.ones((1, 32), np.float32), "mxfp8", amax=4.0)
    assert host(scale).tolist() == [[121]]
    # nvfp4: G = 12 / 2688 (the data's would be 1 / 2688); block e4m3(12 / 6 / G) = 448
    scale, _ = compute_scale_zero_point(x, "nvfp4", amax=12.0)
    assert host(scale.tensor).tolist() == np.float32(12) / np.float32(2688)
    assert host(scale.block).astype(np.float32).tolist() == [[448.0]]
    scale, _ = compute_scale_zero_point(x, "nvfp4", amax=3.0, tensor_scale=0.5)
    assert host(scale.block).astype(np.float32).tolist() == [[1.0]]  # 3 / 6 / 0.5
    # asymmetric int8 [amin, amax] = [-1, 2]: scale 3 / 255, zp round(-128 + 85) = -43
    scale, zp = compute_scale_zero_point(x, "int8", symmetric=False, amax=2.0, amin=-1.0)
    assert host(scale).tolist() == [[np.float32(3) / np.float32(255)]]
    assert host(zp).tolist() == [[-43]]
    scale, zp = compute_scale_zero_point(x, "int8", symmetric=False, amin=-254.0)  # hi 1
    assert host(scale).tolist() == [[1.0]] and host(zp).tolist() == [[126]]


def test_mx_zero_block_takes_code_zero_and_decodes_to_zero():
    q = quantize(np.zeros((1, 32), np.float32), "mxfp8")
    assert host(q.scale).tolist() == [[0]]  # log2(0) clamps to 2^-127
    assert host(dequantize(q)).tolist() == [[0.0] * 32]
    assert host(scale_float32(q))[0, 0] == np.float32(2.0**-127)


def test_mx_given_extreme_codes_scale_exactly():
    # code 0 = 2^-127: 2^-120 * 2^127 = 128 (E4M3), back 128 * 2^-127 = 2^-120
    x = f32([[2.0**-120] + [0.0] * 31])
    q = quantize_with_scale_zero_point(x, "mxfp8", np.uint8(0))
    assert host(q.data).astype(np.float32)[0, 0] == 128.0
    assert q.scale.dtype == np.uint8  # given codes are stored as E8M0 bytes
    assert quantize_with_scale_zero_point(x, "mxfp8", np.int32(3)).scale.dtype == np.uint8
    assert host(dequantize(q))[0, 0] == np.float32(2.0**-120)
    # code 254 = 2^127: 3e38 * 2^-127 = 1.763 -> E4M3 1.75, applied as 2^-126 * 0.5
    x = f32([[3e38, -(2.0**127)] + [0.0] * 30])
    q = quantize_with_scale_zero_point(x, "mxfp8", np.uint8(254))
    assert host(q.data).astype(np.float32)[0, :2].tolist() == [1.75, -1.0]
    assert host(dequantize(q))[0, :2].tolist() == [1.75 * 2.0**127, -(2.0**127)]
    # code 253 = 2^126 still scales in one step: 1.5 * 2^126 * 2^-126 = 1.5
    q = quantize_with_scale_zero_point(f32([[1.5 * 2.0**126] + [0.0] * 31]), "mxfp8", np.uint8(253))
    assert host(q.data).astype(np.float32)[0, 0] == 1.5
    # code 127 = 1: beyond 448 saturates (mxfp8) and beyond 6 (mxfp4)
    big = f32([[1000, -1000] + [0.0] * 30])
    q = quantize_with_scale_zero_point(big, "mxfp8", np.uint8(127))
    assert host(q.data).astype(np.float32)[0, :2].tolist() == [448, -448]
    q = quantize_with_scale_zero_point(big, "mxfp4", np.uint8(127))
    assert host(unpack_fp4(q.data, 32))[0, :2].tolist() == [7, 15]


# --- nvfp4: two-level scale ---------------------------------------------------------------


def test_nvfp4_scales_codes_and_values():
    # Tensor amax 2688 = 448 * 6 -> G = 1. Block 0 amax 2688: s = e4m3(2688 / 6) = 448;
    # block 1 amax 6: s = 1. -1000 / 448 = 2.23 -> E2M1 2 (code 4 | sign 8 = 12).
    # 1.25 is the tie between 1 (code 2, even) and 1.5: -> 1; -0.25 -> -0 (code 8).
    x = np.zeros((1, 32), np.float32)
    x[0, :2] = [2688, -1000]
    x[0, 16:19] = [6, -0.25, 1.25]
    q = quantize(x, "nvfp4")
    assert q.scale.dtype == E4M3 and host(q.scale).astype(np.float32).tolist() == [[448, 1]]
    assert host(q.tensor_scale).tolist() == 1.0 and q.tensor_scale.dtype == np.float32
    codes = host(unpack_fp4(q.data, 32))[0]
    assert codes[:3].tolist() == [7, 12, 0] and codes[16:20].tolist() == [7, 8, 2, 0]
    got = host(dequantize(q))[0]
    assert got[:2].tolist() == [2688, -896] and got[16:19].tolist() == [6, 0, 1]
    assert host(scale_float32(q)).tolist() == [[448, 1]]


def test_nvfp4_tensor_scale_and_zero_blocks():
    # G = 5376 / 2688 = 2; block amax 5376 / 6 / 2 = 448; a zero block gets s = 0 and zeros.
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = -5376
    q = quantize(x, "nvfp4")
    assert host(q.tensor_scale).tolist() == 2.0
    assert host(q.scale).astype(np.float32).tolist() == [[448, 0]]
    assert host(unpack_fp4(q.data, 32))[0, [0, 1, 16]].tolist() == [15, 0, 0]
    assert host(dequantize(q))[0, 0] == -5376 and not host(dequantize(q))[0, 1:].any()
    assert host(scale_float32(q)).tolist() == [[896, 0]]
    # nvfp4_tensor_scale: amax / 2688, or 1 for 0, subnormal results, inf and NaN
    got = host(nvfp4_tensor_scale(f32([2688, 5376, 0, 1e-36, np.inf, np.nan])))
    assert got.tolist() == [1.0, 2.0, 1.0, 1.0, 1.0, 1.0]
    # An all-zero tensor: G = 1, every block 0
    q = quantize(np.zeros((1, 16), np.float32), "nvfp4")
    assert host(q.tensor_scale).tolist() == 1.0 and host(q.scale).astype(float).tolist() == [[0]]


def test_nvfp4_steps_below_one():
    # amax 0.6: G = 0.6 / 2688, block e4m3(0.6 / 6 / G) = 448, step 448 G = 0.1 (float32):
    # 0.6 / 0.1 -> 6 (code 7), 0.15 / 0.1 = 1.5 (code 3), -0.05 / 0.1 = -0.5 (code 9)
    q = quantize(f32([[0.6, 0.15, -0.05] + [0.0] * 13]), "nvfp4")
    assert host(q.scale).astype(np.float32).tolist() == [[448.0]]
    assert host(unpack_fp4(q.data, 16))[0, :3].tolist() == [7, 3, 9]


def test_nvfp4_given_tensor_scale_is_stored_and_block_scales_follow_it():
    x = np.zeros((1, 16), np.float32)
    x[0, 0] = 24.0
    scale, zp = compute_scale_zero_point(x, "nvfp4", tensor_scale=np.float32(0.5))
    assert zp is None and host(scale.tensor).tolist() == 0.5
    one, _ = compute_scale_zero_point(x, "nvfp4", tensor_scale=1)  # an int: stored float32
    assert one.tensor.dtype == np.float32 and host(one.tensor).tolist() == 1.0
    assert host(scale.block).astype(np.float32).tolist() == [[8.0]]  # 24 / 6 / 0.5
    q = quantize_with_scale_zero_point(x, "nvfp4", scale)
    assert host(q.tensor_scale).tolist() == 0.5 and host(dequantize(q))[0, 0] == 24.0
    # A float32 block scale is cast to E4M3 saturating at 448 (not NaN); 0 is allowed.
    q = quantize_with_scale_zero_point(x, "nvfp4", (f32([[1000.0]]), np.float32(1)))
    assert host(q.scale).astype(np.float32).tolist() == [[448.0]]
    q = quantize_with_scale_zero_point(x, "nvfp4", (f32([[0.0]]), np.float32(1)))
    assert host(dequantize(q)).tolist() == [[0.0] * 16]
    assert not host(q.data).any()  # a block with step 0 stores zero codes, not x's
    # block 4 * G 1: 24 / 4 = 6, E2M1 code 7
    q = quantize_with_scale_zero_point(x, "nvfp4", (np.full((1, 1), 4, E4M3), np.float32(1)))
    assert host(unpack_fp4(q.data, 16))[0, 0] == 7 and host(dequantize(q))[0, 0] == 24.0
    # A tensor scale given as a Python int is stored as float32, as documented.
    q = quantize_with_scale_zero_point(x, "nvfp4", (np.full((1, 1), 4, E4M3), 1))
    assert q.tensor_scale.dtype == np.float32 and host(q.tensor_scale).tolist() == 1.0


# --- non-finite groups under jit -----------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "kwargs"),
    [("int8", {}), ("fp8_e4m3", {}), ("int8", {"symmetric": False}), ("int2", {})],
)
def test_under_jit_a_non_finite_group_gets_a_nan_scale_and_zero_codes(fmt, kwargs):
    x = f32([[np.inf, 1, 2, 3], [127, 1, 2, 3]])
    q = jax.jit(lambda v: quantize(v, fmt, group_size=2, **kwargs))(x)
    scale = host(q.scale)
    assert np.isnan(scale[0, 0]) and np.isfinite(scale[0, 1]) and np.isfinite(scale[1]).all()
    got = host(dequantize(q))
    assert np.isnan(got[0, :2]).all() and np.isfinite(got[0, 2:]).all()
    clean = host(dequantize(quantize(x[1:], fmt, group_size=2, **kwargs)))
    np.testing.assert_array_equal(got[1:], clean)
    if fmt in ("int8", "fp8_e4m3") and not kwargs:  # documented: zero elements
        assert host(q.data).astype(np.float32)[0, :2].tolist() == [0, 0]
    if kwargs:  # asymmetric: the bad group's zero point is round(-128 - 0) = -128
        assert host(q.zero_point)[0, 0] == -128
    if fmt == "int2":
        assert host(unpack_int2(q.data, 4))[0, :2].tolist() == [0, 0]
        assert host(q.zero_point)[0, 0] == 0


def test_under_jit_mx_and_nvfp4_mark_non_finite_data():
    x = np.ones((1, 64), np.float32)
    x[0, 3] = np.nan
    q = jax.jit(lambda v: quantize(v, "mxfp8"))(x)
    assert host(q.scale).tolist() == [[255, 119]]
    assert not host(q.data).astype(np.float32)[0, :32].any()
    got = host(dequantize(q))
    assert np.isnan(got[0, :32]).all() and got[0, 32:].tolist() == [1.0] * 32
    q = jax.jit(lambda v: quantize(v, "nvfp4"))(x)
    assert np.isnan(host(q.tensor_scale)) and np.isnan(host(dequantize(q))).all()
    assert not host(q.data).any()  # a NaN tensor scale stores zeros everywhere


def test_true_divide_is_correctly_rounded_under_jit():
    # XLA turns a / 7 into a * (1/7): 21 * (1/7) = 3.0000002; the true quotient is 3.
    got = jax.jit(lambda a: codec._true_divide(a, jnp.float32(7)))(jnp.float32(21))
    assert got.tolist() == 3.0
    got = jax.jit(codec._true_divide)(jnp.float32(21), f32([7, 3]))
    assert got.shape == (2,) and got.tolist() == [3.0, 7.0]
    got = jax.jit(codec._true_divide)(f32([np.nan, 6]), f32([0, 3]))
    assert np.isnan(got[0]) and got[1] == 2.0


# --- static structure: layout_of, scale_float32, defaults -------------------------------


@pytest.mark.parametrize(
    ("fmt", "kwargs"),
    [
        ("bf16", {}),
        ("int8", {"axis": None}),
        ("int8", {"axis": None, "symmetric": False}),
        ("int4", {"axis": 0, "group_size": 2, "symmetric": False}),
        ("mxfp4", {}),
        ("int2", {}),
    ],
)
def test_layout_of_reads_back_the_layout_quantize_used(fmt, kwargs):
    x = np.ones((3, 32), np.float32)
    q = quantize(x, fmt, **kwargs)
    assert layout_of(q) == resolve_layout(x.shape, fmt, **kwargs)


def test_scale_float32_per_family():
    x = f32([[254, 1, 2, 3]])
    assert scale_float32(quantize(x, "fp16")) is None
    got = scale_float32(quantize(x, "int8"))
    assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.tolist() == [[2.0]]


def test_default_axis_is_the_last_one():
    x = np.ones((2, 3), np.float32)
    assert quantize(x, "int8").scale.shape == (2, 1)
    scale, zp = compute_scale_zero_point(x, "int8")
    assert scale.shape == (2, 1) and zp is None
    scale, zp = compute_scale_zero_point(x, "int8", symmetric=False)
    assert scale.shape == (2, 1) and zp.shape == (2, 1)
    q = quantize_with_scale_zero_point(x, "int8", np.ones((2, 1), np.float32))
    assert q.axis == 1 and q.group_size is None
    q = quantize_with_scale_zero_point(x, "int4", np.ones((2, 1), np.float32))
    assert q.group_size == 128  # int4's default group (one partial group of 3 here)
    assert quantize(x, "fp16").scale is None
    assert compute_scale_zero_point(x, "bf16") == (None, None)


def test_casts_saturate_and_ignore_the_axis():
    q = quantize(f32([[1e6, -70000, 1.5]]), "fp16")
    assert q.data.dtype == np.float16 and host(q.data).tolist() == [[65504, -65504, 1.5]]
    assert q.axis is None and q.zero_point is None and q.tensor_scale is None
    assert host(dequantize(q)).dtype == np.float32
    q = quantize(f32([[3.0, 1.00390625]]), "bf16")  # 1 + 2^-8 is a bf16 tie -> 1
    assert host(dequantize(q)).tolist() == [[3.0, 1.0]]
