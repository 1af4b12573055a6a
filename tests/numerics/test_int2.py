"""int2: KIVI's asymmetric 2-bit code (scale + float32 zero point, codes 0..3, 4 per byte).

Bounds come from the step: a group [lo, hi] gets scale s = (hi - lo) / 3 and the grid
lo + k s (k = 0..3) covers it exactly, so round-to-nearest is off by at most s / 2 (plus the
float32 rounding of x / s + zp and (q - zp) s: a few ulps of max |x|).
"""

from __future__ import annotations

import numpy as np
import pytest

from tenantq.numerics import (
    compute_scale_zero_point,
    dequantize,
    get_format,
    quantize,
    quantize_with_scale_zero_point,
    storage_nbytes,
)
from tenantq.numerics.packing import pack_int2, unpack_int2


def test_pack_int2_hand_written_bytes() -> None:
    # element 4i + j in bits 2j..2j+1: [1, 2, 3, 0] -> 0b00_11_10_01 = 0x39; [3] + padding -> 3
    assert np.asarray(pack_int2(np.array([1, 2, 3, 0, 3]))).tolist() == [0x39, 0x03]
    codes = np.arange(4 * 7).reshape(7, 4) % 4
    assert np.array_equal(np.asarray(unpack_int2(pack_int2(codes), 4)), codes)
    with pytest.raises(ValueError, match=r"int2 codes must lie in \[0, 3\]"):
        pack_int2(np.array([4]))
    with pytest.raises(ValueError, match="need a last axis of 2 packed bytes"):
        unpack_int2(np.zeros(3, np.uint8), 5)


def _group_bounds(x: np.ndarray, group: int) -> np.ndarray:
    """Per element: s / 2 of its group of `group` along the last axis (numpy reference)."""
    g = x.reshape(*x.shape[:-1], -1, group)
    step = (g.max(-1) - g.min(-1)) / 3.0
    return np.repeat(step / 2.0, group, axis=-1).reshape(x.shape)


@pytest.mark.parametrize("offset", [0.0, 5.0, -40.0])
def test_round_trip_within_half_a_step_of_each_group(offset: float) -> None:
    # offset 5 / -40: groups that do not contain 0 keep all 4 levels (zero point outside 0..3)
    x = np.random.default_rng(1).standard_normal((6, 3, 64)).astype(np.float32) + offset
    q = quantize(x, "int2", axis=-1)  # groups of 32 (KIVI's G) along the last axis
    assert q.group_size == 32 and q.zero_point is not None and q.data.dtype == np.uint8
    assert q.data.shape == (6, 3, 16)  # 64 codes, 4 to a byte
    err = np.abs(np.asarray(dequantize(q)) - x)
    slack = 4 * np.finfo(np.float32).eps * (np.abs(x).max() + 1)
    assert np.all(err <= _group_bounds(x, 32) + slack)
    assert err.max() > 0.1 * _group_bounds(x, 32).max()  # really 2-bit, not lossless


def test_a_four_level_grid_is_exact_and_codes_span_0_to_3() -> None:
    x = np.array([[-1.0, 0.5, 2.0, 3.5] * 8], np.float32)  # lo -1, step 1.5: on the grid
    q = quantize(x, "int2", axis=-1)
    # (q - zp) * s with zp = 1 / 1.5 rounded to float32: within 2 ulps of 3.5, not bit-exact
    assert np.allclose(np.asarray(dequantize(q)), x, rtol=0, atol=2 * np.spacing(np.float32(3.5)))
    codes = np.asarray(unpack_int2(q.data, 32))
    assert codes[0, :4].tolist() == [0, 1, 2, 3]


def test_constant_group_is_exact() -> None:
    x = np.full((2, 32), 7.25, np.float32)
    assert np.array_equal(np.asarray(dequantize(quantize(x, "int2", axis=-1))), x)


def test_bytes_count_codes_scales_and_float32_zero_points() -> None:
    # [16, 8, 128] per token, groups of 32: 16*8*128/4 code bytes + 16*8*4 groups * (4 + 4)
    shape = (16, 8, 128)
    want = 16 * 8 * 128 // 4 + 16 * 8 * 4 * 8
    assert storage_nbytes(shape, "int2", axis=-1) == want
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    assert quantize(x, "int2", axis=-1).nbytes == want
    assert get_format("int2").elements_per_byte == 4


def test_given_scale_and_zero_point_compose_to_quantize() -> None:
    x = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    scale, zp = compute_scale_zero_point(x, "int2", axis=-1)
    q = quantize_with_scale_zero_point(x, "int2", scale, zp, axis=-1)
    ref = quantize(x, "int2", axis=-1)
    assert np.array_equal(np.asarray(q.data), np.asarray(ref.data))
    with pytest.raises(ValueError, match="int2 is asymmetric: pass zero_point"):
        quantize_with_scale_zero_point(x, "int2", scale, axis=-1)
    # static statistics: one [min, max] for the whole tensor, broadcast to every group
    lo, hi = float(x.min()), float(x.max())
    s, z = compute_scale_zero_point(x, "int2", axis=-1, amax=hi, amin=lo)
    assert np.allclose(np.asarray(s), (hi - lo) / 3) and np.allclose(np.asarray(z), -lo / s)
