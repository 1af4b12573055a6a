"""elements.py and formats.py against the published figures (fast enough for `make mutation
TARGETS=numerics-formats`): the E2M1 code table and its round-half-to-even midpoints (OCP MX
v1.0 sec. 5.3.3: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6, bit 3 the sign), E8M0 scales 2^(code -
127) with 0xFF NaN (sec. 5.4.1), the exponent-bit helpers on float32 (bias 127, normals from
2^-126), and every FormatSpec field typed in from the OCP FP8, MX and NVFP4 specs and KIVI.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from tenantq.numerics import FORMATS, FormatSpec, get_format
from tenantq.numerics import elements as el

TINY = float(np.finfo(np.float32).tiny)  # 2^-126


def f32(values) -> jnp.ndarray:
    return jnp.asarray(np.asarray(values, np.float32))


# --- E2M1 ---------------------------------------------------------------------------------


def test_e2m1_table_and_exact_values():
    assert el.E2M1_VALUES == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    values = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    codes = el.encode_e2m1(f32(values + [-v for v in values[1:]]))
    assert codes.dtype == jnp.uint8
    assert codes.tolist() == list(range(8)) + list(range(9, 16))
    assert el.decode_e2m1(jnp.arange(16, dtype=jnp.uint8)).tolist() == values + [-v for v in values]


def test_e2m1_midpoints_round_half_to_even():
    # Each tie goes to the code with mantissa bit 0: 0.25 -> 0, 0.75 -> 1.0 (code 2),
    # 1.25 -> 1.0, 1.75 -> 2.0 (code 4), 2.5 -> 2.0, 3.5 -> 4.0 (code 6), 5 -> 4.0.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    assert el.encode_e2m1(f32(ties)).tolist() == [0, 2, 2, 4, 4, 6, 6]
    assert el.encode_e2m1(f32([-t for t in ties])).tolist() == [8, 10, 10, 12, 12, 14, 14]
    # One float32 ulp either side of each tie rounds to the nearer value.
    above = np.nextafter(np.float32(ties), np.float32(10))
    below = np.nextafter(np.float32(ties), np.float32(0))
    assert el.encode_e2m1(jnp.asarray(above)).tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert el.encode_e2m1(jnp.asarray(below)).tolist() == [0, 1, 2, 3, 4, 5, 6]


def test_e2m1_saturates_and_keeps_the_sign_of_zero():
    # beyond 6 -> code 7 (6); -0.0 and small negatives -> the -0 code 8
    got = el.encode_e2m1(f32([7.0, 1e30, -100.0, -0.0, -0.1, 0.1])).tolist()
    assert got == [7, 7, 15, 8, 8, 0]


def test_e2m1_decode_reads_only_the_low_nibble():
    # 0x1F & 0xF = 15 (-6), 0x19 & 0xF = 9 (-0.5), 0xF7 & 0xF = 7 (6)
    assert el.decode_e2m1(jnp.asarray(np.uint8([0x1F, 0x19, 0xF7]))).tolist() == [-6, -0.5, 6]
    assert el.decode_e2m1(jnp.asarray(np.uint8([3]))).dtype == jnp.float32


def test_saturating_cast_clips_before_the_cast():
    # ml_dtypes casts 1000 to E4M3FN as NaN; clipped first it is 448. 17 ties to 16.
    got = el.saturating_cast(f32([1000, -1000, 17]), "float8_e4m3fn", 448.0)
    assert got.dtype == jnp.float8_e4m3fn and got.astype(jnp.float32).tolist() == [448, -448, 16]
    got = el.saturating_cast(f32([1e6, -7e4]), "float16", 65504.0)
    assert got.dtype == jnp.float16 and got.tolist() == [65504, -65504]


# --- E8M0 and float32 exponent bits ---------------------------------------------------


def test_e8m0_constants():
    assert (el.E8M0_BIAS, el.E8M0_NAN) == (127, 255)


def test_floor_log2_reads_the_exponent_field():
    x = f32([1, 0.75, 3e38, 0, TINY, 1e-40, np.inf, np.nan, 1.5 * TINY, 8, 7.99])
    got = el.floor_log2(x)
    assert got.dtype == jnp.int32
    # 0 and subnormals -> -127 (exponent field 0); inf/NaN -> 128 (field 255)
    assert got.tolist() == [0, -1, 127, -127, -126, -127, 128, 128, -126, 3, 2]


def test_pow2_builds_powers_of_two_from_bits():
    got = el.pow2(jnp.asarray([-126, 127, 0, -1, 3]))
    assert got.dtype == jnp.float32
    assert got.tolist() == [TINY, 2.0**127, 1.0, 0.5, 8.0]


def test_scale_by_e8m0_every_kind_of_code():
    # code 0: 2^-127 applied as 0.5 * 2^-126 (4 * 2^-127 = 2^-125); code 1: 2^-126;
    # 127: 1; 128: 2; 254: 2^127 (4 * 2^127 overflows to inf); 255: NaN.
    values = f32([4, 4, 4, 3, 1, 4])
    codes = jnp.asarray(np.uint8([0, 1, 127, 128, 254, 255]))
    got = el.scale_by_e8m0(values, codes).tolist()
    assert got[:5] == [2.0**-125, 2.0**-124, 4.0, 6.0, 2.0**127]
    assert np.isnan(got[5])
    assert el.scale_by_e8m0(f32([4]), jnp.asarray(np.uint8([254]))).tolist() == [np.inf]


def test_e8m0_code_at_least_edges():
    # 0 and subnormals -> code 0 (2^-127); 2^-126 -> 1; 1.5 * 2^-126 -> 2^-125 (code 2);
    # 2^127 -> 254; 1.5 * 2^127 would need 2^128: clamped to 254.
    x = f32([0.0, 1e-40, TINY, 1.5 * TINY, 2.0**127, 1.5 * 2.0**127])
    assert el.e8m0_code_at_least(x).tolist() == [0, 0, 1, 2, 254, 254]
    assert el.e8m0_code_at_least(2.0).tolist() == 128  # a Python float, as callers pass


def test_e8m0_to_float32_on_the_host():
    got = el.e8m0_to_float32(np.uint8([0, 1, 127, 128, 254]))
    assert got.dtype == np.float32
    assert got.tolist() == [2.0**-127, 2.0**-126, 1.0, 2.0, 2.0**127]
    with np.errstate(all="raise"):  # 2^128 is never formed: no overflow on the way to NaN
        nan = el.e8m0_to_float32(np.uint8([255, 254, 255]))
    assert np.isnan(nan[[0, 2]]).all() and nan[1] == 2.0**127 and nan.dtype == np.float32


# --- FormatSpec and the catalogue -------------------------------------------------------

# name: (element dtype, bits, block, scale dtype, max finite, packed, default group,
# tensor scale, family, asymmetric only). OCP FP8 (E4M3FN 448, E5M2 57344), IEEE fp16 65504,
# bf16 max (2 - 2^-7) * 2^127, OCP MX v1.0 (blocks of 32, E8M0), NVFP4 (16, E4M3, FP32
# tensor scale), int4 groups of 128, KIVI int2 groups of 32 (Liu et al. 2024).
PUBLISHED = {
    "bf16": ("bfloat16", 16, None, None, (2 - 2**-7) * 2.0**127, False, None, False, "cast", False),
    "fp16": ("float16", 16, None, None, 65504.0, False, None, False, "cast", False),
    "fp8_e4m3": ("float8_e4m3fn", 8, None, "float32", 448.0, False, None, False, "float", False),
    "fp8_e5m2": ("float8_e5m2", 8, None, "float32", 57344.0, False, None, False, "float", False),
    "int8": ("int8", 8, None, "float32", 127.0, False, None, False, "int", False),
    "int4": ("int4", 4, None, "float32", 7.0, True, 128, False, "int", False),
    "mxfp8": ("float8_e4m3fn", 8, 32, "e8m0", 448.0, False, None, False, "mx", False),
    "mxfp4": ("float4_e2m1fn", 4, 32, "e8m0", 6.0, True, None, False, "mx", False),
    "nvfp4": ("float4_e2m1fn", 4, 16, "e4m3", 6.0, True, None, True, "nvfp4", False),
    "int2": ("uint8", 2, None, "float32", 3.0, True, 32, False, "int", True),
}
FIELDS = (
    "element_dtype", "element_bits", "block_size", "scale_dtype", "max_finite", "packed",
    "default_group_size", "has_tensor_scale", "family", "asymmetric_only",
)  # fmt: skip


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_every_spec_carries_the_published_figures(name):
    spec = FORMATS[name]
    assert spec.name == name
    assert tuple(getattr(spec, f) for f in FIELDS) == PUBLISHED[name]


def test_derived_properties_per_format():
    # (is_int, elements per byte, scale bytes, zero point bytes, symmetric codes, asymmetric)
    want = {
        "bf16": (False, 1, 0, 1, None),
        "fp8_e4m3": (False, 1, 4, 1, None),
        "int8": (True, 1, 4, 1, ((-127, 127), (-128, 127))),
        "int4": (True, 2, 4, 1, ((-7, 7), (-8, 7))),
        "mxfp8": (False, 1, 1, 1, None),
        "mxfp4": (False, 2, 1, 1, None),
        "nvfp4": (False, 2, 1, 1, None),
        "int2": (True, 4, 4, 4, ((0, 3), (0, 3))),
    }
    for name, (is_int, per_byte, scale_bytes, zp_bytes, codes) in want.items():
        spec = FORMATS[name]
        got = (spec.is_int, spec.elements_per_byte, spec.scale_bytes, spec.zero_point_bytes)
        assert got == (is_int, per_byte, scale_bytes, zp_bytes), name
        if codes is not None:
            assert (spec.int_codes(True), spec.int_codes(False)) == codes, name
            assert all(type(c) is int for c in spec.int_codes(False))


def test_formatspec_defaults_and_frozen():
    spec = FormatSpec("x", "int8", 8, None, None, 1.0, False)
    assert (spec.default_group_size, spec.has_tensor_scale, spec.family) == (None, False, "cast")
    assert spec.asymmetric_only is False and not spec.is_int
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.max_finite = 2.0


def test_get_format_by_name_or_spec_and_unknown_names():
    assert get_format("int4") is FORMATS["int4"]
    assert get_format(FORMATS["nvfp4"]) is FORMATS["nvfp4"]
    valid = "bf16, fp16, fp8_e4m3, fp8_e5m2, int8, int4, mxfp8, mxfp4, nvfp4, int2"
    with pytest.raises(ValueError) as err:
        get_format("int3")
    assert str(err.value) == f"unknown number format 'int3'; valid formats: {valid}"
    assert err.value.__suppress_context__ and err.value.__cause__ is None
    with pytest.raises(ValueError) as err:
        get_format(["int8"])  # unhashable: a TypeError inside, the same one-line error
    assert str(err.value) == f"unknown number format ['int8']; valid formats: {valid}"
