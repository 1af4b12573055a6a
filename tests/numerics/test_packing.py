"""4-bit packing against hand-written bytes, and the E2M1 codec against ml_dtypes.

Layout (DESIGN.md, pinned): along the last axis, element 2i in the low nibble of byte i,
element 2i+1 in the high nibble; int4 in two's complement; odd lengths padded with 0.

The packing helpers' bad-input errors, word for word (found unpinned by `make mutation
TARGETS=numerics-packing`): each names what was wrong and what is allowed (DESIGN.md: int4
values in [-8, 7], E2M1 codes in 0..15, two values per packed uint8 byte along the last axis).
"""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tenantq.numerics import pack_fp4, pack_int4, quantize, unpack_fp4, unpack_int4
from tenantq.numerics.elements import decode_e2m1, encode_e2m1
from tenantq.numerics.packing import pack_nibbles, unpack_nibbles


def test_int4_hand_written_bytes():
    # -8 = 0b1000 (low), 7 = 0b0111 (high) -> 0x78; -1 = 0b1111 (low), 0 (high) -> 0x0F.
    packed = np.asarray(pack_int4(np.array([-8, 7, -1, 0])))
    assert packed.dtype == np.uint8
    np.testing.assert_array_equal(packed, [0x78, 0x0F])


def test_int4_odd_length_pads_a_zero_nibble():
    # [1, -2, 3]: 1 | (-2 = 0xE) << 4 = 0xE1; 3 | pad 0 << 4 = 0x03.
    packed = np.asarray(pack_int4(np.array([1, -2, 3], np.int8)))
    np.testing.assert_array_equal(packed, [0xE1, 0x03])
    np.testing.assert_array_equal(np.asarray(unpack_int4(packed, 3)), [1, -2, 3])


def test_int4_all_16_codes_round_trip_and_sign_extend():
    values = np.arange(-8, 8, dtype=np.int8)
    packed = np.asarray(pack_int4(values))
    # byte i holds (2i, 2i+1): low nibble = value & 0xF, high nibble = next value & 0xF.
    expected = [
        (int(a) & 0xF) | ((int(b) & 0xF) << 4)
        for a, b in zip(values[::2], values[1::2], strict=True)
    ]
    np.testing.assert_array_equal(packed, expected)
    unpacked = np.asarray(unpack_int4(packed, 16))
    assert unpacked.dtype == np.int8
    np.testing.assert_array_equal(unpacked, values)


def test_fp4_all_16_codes_round_trip():
    codes = np.arange(16, dtype=np.uint8)
    packed = np.asarray(pack_fp4(codes))
    np.testing.assert_array_equal(packed, [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE])
    np.testing.assert_array_equal(np.asarray(unpack_fp4(packed, 16)), codes)


def test_packing_runs_along_the_last_axis_of_nd_arrays():
    values = np.arange(2 * 3 * 5).reshape(2, 3, 5) % 16 - 8
    packed = np.asarray(pack_int4(values))
    assert packed.shape == (2, 3, 3)
    assert packed[1, 2, 0] == ((values[1, 2, 0] & 0xF) | ((values[1, 2, 1] & 0xF) << 4))
    assert packed[1, 2, 2] == (values[1, 2, 4] & 0xF)  # odd tail: high nibble is padding
    np.testing.assert_array_equal(np.asarray(unpack_int4(packed, 5)), values)


@settings(max_examples=10, deadline=None)
@given(
    hnp.arrays(
        np.int8, hnp.array_shapes(min_dims=1, max_dims=3, max_side=9), elements=st.integers(-8, 7)
    )
)
def test_int4_round_trip_any_shape(values):
    packed = pack_int4(values)
    assert packed.shape == values.shape[:-1] + ((values.shape[-1] + 1) // 2,)
    np.testing.assert_array_equal(np.asarray(unpack_int4(packed, values.shape[-1])), values)


def test_pack_and_unpack_reject_bad_input():
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4(np.array([8]))
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack_fp4(np.array([16]))
    with pytest.raises(ValueError, match="n=5 values need a last axis of 3"):
        unpack_int4(np.zeros(2, np.uint8), 5)


def test_pack_int4_under_jit():
    fn = jax.jit(lambda v: unpack_int4(pack_int4(v), 5))
    values = np.array([[-8, 7, -1, 0, 5]], np.int8)
    np.testing.assert_array_equal(np.asarray(fn(values)), values)


def test_int4_quantized_data_uses_the_pinned_layout():
    # int4 symmetric, one group: scale = 7/7 = 1, so x itself is the stored integer.
    x = np.array([[-7.0, 7.0, -1.0, 0.0, 3.0]], np.float32)
    q = quantize(x, "int4", axis=-1)
    np.testing.assert_array_equal(np.asarray(q.data), [[0x79, 0x0F, 0x03]])


def test_mxfp4_quantized_data_uses_e2m1_codes():
    # Block max 6 -> X = 2^(2-2) = 1; 6 = code 7, -0.5 = code 9 (sign bit 3 | 1), 1.5 = 3.
    x = np.array([6.0, -0.5, 1.5], np.float32)
    q = quantize(x, "mxfp4", axis=-1)
    np.testing.assert_array_equal(np.asarray(q.data), [0x97, 0x03])
    np.testing.assert_array_equal(np.asarray(q.scale), [127])


# --- E2M1 codec vs ml_dtypes (independent implementation of the same spec) ---------------

E2M1_TIES = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def reference_e2m1(values):
    return np.asarray(values, np.float32).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)


def test_e2m1_decode_matches_ml_dtypes_for_all_codes():
    codes = np.arange(16, dtype=np.uint8)
    np.testing.assert_array_equal(
        np.asarray(decode_e2m1(codes)), codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    )


def test_e2m1_encode_ties_go_to_even_mantissa():
    # OCP MX v1.0: round to nearest, ties to even. 0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
    # 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4; beyond 6 saturates to 6.
    ties = np.concatenate([E2M1_TIES, -E2M1_TIES, [7.0, 100.0, -9.0]]).astype(np.float32)
    got = np.asarray(decode_e2m1(encode_e2m1(ties)))
    np.testing.assert_array_equal(got, [0, 1, 1, 2, 2, 4, 4, 0, -1, -1, -2, -2, -4, -4, 6, 6, -6])
    np.testing.assert_array_equal(got, reference_e2m1(ties))


@settings(max_examples=15, deadline=None)
@given(hnp.arrays(np.float32, 64, elements=st.floats(-8, 8, width=32)))
def test_e2m1_encode_matches_ml_dtypes(values):
    np.testing.assert_array_equal(
        np.asarray(decode_e2m1(encode_e2m1(values))), reference_e2m1(values)
    )


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: pack_int4([-9, 7]), "int4 values must lie in [-8, 7]; got min -9, max 7"),
        (lambda: pack_fp4([0, 16]), "fp4 codes must lie in [0, 15]; got min 0, max 16"),
        (lambda: pack_nibbles(np.uint8(3)), "packing needs at least one axis; got a 0-d array"),
        (
            lambda: unpack_nibbles(np.zeros(2, np.int8), 4),
            "packed data must be uint8, got int8",
        ),
        (  # 5 values need ceil(5 / 2) = 3 bytes
            lambda: unpack_int4(np.zeros(2, np.uint8), 5),
            "n=5 values need a last axis of 3 packed bytes; got last axis 2",
        ),
        (
            lambda: unpack_nibbles(np.uint8(7), 2),
            "n=2 values need a last axis of 1 packed bytes; got a 0-d array",
        ),
    ],
)
def test_bad_packing_input_is_one_exact_line(call, message):
    with pytest.raises(ValueError) as err:
        call()
    assert str(err.value) == message
