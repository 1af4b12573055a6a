"""True storage bytes: each format's formula by hand, and `storage_nbytes` (arithmetic,
no arrays, used by the capacity planner) equal to `quantize(...).nbytes` byte for byte.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tenantq.numerics import FORMATS, effective_bits, quantize, storage_nbytes


def ceil_div(a, b):
    return -(-a // b)


def formula_nbytes(shape, fmt, axis, group):
    """The byte count written out per format (DESIGN.md: packing, scales, zero points).

    Scales: one per group along `axis` for every slice of the other axes.
    """
    numel = math.prod(shape)
    packed = math.prod(shape[:-1]) * ceil_div(shape[-1], 2)  # two 4-bit values per byte
    if axis is None:
        n_scales = 1
    else:
        n_scales = numel // shape[axis] * ceil_div(shape[axis], group or shape[axis])
    return {
        "bf16": 2 * numel,
        "fp16": 2 * numel,
        "fp8_e4m3": numel + 4 * n_scales,  # float32 scales
        "fp8_e5m2": numel + 4 * n_scales,
        "int8": numel + 4 * n_scales,
        "int4": packed + 4 * n_scales,
        # four 2-bit codes per byte; a float32 scale and a float32 zero point per group
        "int2": math.prod(shape[:-1]) * ceil_div(shape[-1], 4) + 8 * n_scales,
        "mxfp8": numel + n_scales,  # one E8M0 byte per block of 32
        "mxfp4": packed + n_scales,
        "nvfp4": packed + n_scales + 4,  # one E4M3 byte per 16, one float32 per tensor
    }[fmt]


@pytest.mark.parametrize("shape", [(7,), (130, 6), (2, 1, 4, 5, 17)], ids=str)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_nbytes_matches_the_format_formula(fmt, shape):
    spec = FORMATS[fmt]
    axis = 0 if spec.scale_dtype else None
    group = spec.block_size or spec.default_group_size  # int4 defaults to 128
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    q = quantize(x, fmt, axis=axis)
    expected = formula_nbytes(shape, fmt, axis, group)
    assert q.nbytes == expected
    assert storage_nbytes(shape, fmt, axis=axis) == expected


def test_zero_points_add_one_byte_per_group():
    # int8 asymmetric, groups of 16 along 40 -> 3 groups per row, 5 rows: 15 scales.
    x = np.random.default_rng(1).standard_normal((5, 40)).astype(np.float32)
    q = quantize(x, "int8", axis=-1, group_size=16, symmetric=False)
    assert q.nbytes == 200 + 15 * 4 + 15 * 1


@pytest.mark.parametrize(
    ("fmt", "kwargs", "bits"),
    [
        ("mxfp8", {}, 8.25),  # 8 + 8/32 (OCP MX v1.0)
        ("mxfp4", {}, 4.25),  # 4 + 8/32
        ("nvfp4", {}, 4.5 + 32 / (256 * 64)),  # 4 + 8/16, plus 32 bits per tensor
        ("int4", {"axis": 0}, 4.25),  # 4 + 32/128 (float32 scale per 128)
        ("int8", {"axis": 0}, 8 + 32 / 256),  # per-channel over 256 rows
        ("bf16", {}, 16.0),
    ],
)
def test_effective_bits(fmt, kwargs, bits):
    assert effective_bits((256, 64), fmt, **kwargs) == pytest.approx(bits, rel=1e-12)


def test_engine_int4_weight_layout():
    # Linear weights stored [in, out], groups of 128 along `in`: one scale column per
    # output channel, data packed along `out` (the last axis).
    w = np.random.default_rng(2).standard_normal((300, 10)).astype(np.float32)
    q = quantize(w, "int4", axis=0, group_size=128)
    assert q.data.shape == (300, 5) and q.data.dtype == np.uint8
    assert q.scale.shape == (3, 10) and q.group_size == 128 and q.axis == 0
    assert q.nbytes == 300 * 5 + 3 * 10 * 4


def test_kv_layouts_per_token_and_per_channel():
    k = np.random.default_rng(3).standard_normal((2, 6, 4, 8)).astype(np.float32)  # b,t,h,d
    per_token = quantize(k, "fp8_e4m3", axis=-1)
    per_channel = quantize(k, "fp8_e4m3", axis=1)
    assert per_token.scale.shape == (2, 6, 4, 1)
    assert per_channel.scale.shape == (2, 1, 4, 8)
    assert quantize(k, "int8", axis=None).scale.shape == (1, 1, 1, 1)
    assert quantize(k, "mxfp4", axis=-1).scale.shape == (2, 6, 4, 1)
    assert quantize(k, "nvfp4", axis=1).scale.shape == (2, 1, 4, 8)


FORMAT_NAMES = st.sampled_from(sorted(FORMATS))


@st.composite
def quantize_settings(draw):
    fmt = draw(FORMAT_NAMES)
    spec = FORMATS[fmt]
    shape = tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=5)))
    if math.prod(shape) > 4000:
        shape = shape[:2]
    axes = list(range(-len(shape), len(shape)))
    if spec.block_size is None:
        axes.append(None)
    axis = draw(st.sampled_from(axes))
    group_size = None
    if axis is not None and spec.block_size is None and spec.scale_dtype is not None:
        group_size = draw(st.sampled_from([None, 1, 3, 16, 128]))
    symmetric = draw(st.booleans()) if spec.is_int else True
    return shape, fmt, {"axis": axis, "group_size": group_size, "symmetric": symmetric}


@settings(max_examples=6, deadline=None)
@given(quantize_settings())
def test_storage_nbytes_equals_quantize_nbytes(case):
    shape, fmt, kwargs = case
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    q = quantize(x, fmt, **kwargs)
    assert storage_nbytes(shape, fmt, **kwargs) == q.nbytes
    # The stored arrays' own sizes agree with the layout the docstring pins.
    # Packed formats hold 8 // element_bits values per byte along the last axis (2 for the
    # 4-bit formats, 4 for int2); the others one per element.
    per_byte = FORMATS[fmt].elements_per_byte
    assert q.data.shape == shape[:-1] + (ceil_div(shape[-1], per_byte),)
    if q.scale is not None:
        assert q.scale.ndim == len(shape)


@settings(max_examples=60, deadline=None)
@given(quantize_settings())
def test_storage_nbytes_equals_traced_quantize_nbytes(case):
    # Many more settings at tracing cost: jax.eval_shape runs the real quantize code and
    # returns a QArray whose leaves carry the exact shapes and dtypes it would store.
    shape, fmt, kwargs = case
    q = jax.eval_shape(lambda x: quantize(x, fmt, **kwargs), jax.ShapeDtypeStruct(shape, "float32"))
    assert storage_nbytes(shape, fmt, **kwargs) == q.nbytes


@pytest.mark.parametrize(("fmt", "stored"), [("int2", 3), ("int4", 5), ("int8", 9)])
def test_packed_data_shape_of_nine_values(fmt, stored):
    # 9 values along the last axis: int2 packs 4 per byte (3 bytes), int4 2 (5), int8 1 (9).
    q = quantize(np.linspace(-1, 1, 18, dtype=np.float32).reshape(2, 9), fmt, axis=-1)
    assert q.data.shape == (2, stored)
