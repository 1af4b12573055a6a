"""QArray as a pytree through jit, eager == jit bit for bit, non-finite input, bad args,
and the format registry the rest of tenantq reads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tenantq.numerics import (
    FORMATS,
    QArray,
    dequantize,
    get_format,
    quantize,
    scale_float32,
)

NAMES = ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "mxfp8", "mxfp4", "nvfp4", "int2"]
X = np.random.default_rng(0).standard_t(3, size=(3, 5, 40)).astype(np.float32)


def kwargs_for(fmt):
    return {"axis": 1, "symmetric": False} if fmt.startswith("int") else {"axis": 1}


def bits(array):
    """The raw bytes of an array, so that -0/+0 and NaN payloads count as differences."""
    return np.ascontiguousarray(np.atleast_1d(np.asarray(array))).view(np.uint8)


def test_registry_has_exactly_the_pinned_names():
    assert list(FORMATS) == NAMES
    assert get_format("nvfp4") is FORMATS["nvfp4"]


def test_format_specs_carry_the_published_figures():
    # OCP 8-bit FP: E4M3FN max 448 (not e4m3fnuz's 240), E5M2 max 57344; IEEE fp16 65504.
    assert FORMATS["fp8_e4m3"].max_finite == 448.0
    assert FORMATS["fp8_e5m2"].max_finite == 57344.0
    assert FORMATS["fp16"].max_finite == 65504.0
    assert float(ml_dtypes.finfo(ml_dtypes.bfloat16).max) == FORMATS["bf16"].max_finite
    # OCP MX v1.0: blocks of 32 with an E8M0 scale; NVFP4: 16 with E4M3 and a tensor scale.
    mxfp4, nvfp4 = FORMATS["mxfp4"], FORMATS["nvfp4"]
    assert (mxfp4.block_size, mxfp4.scale_dtype, mxfp4.element_bits) == (32, "e8m0", 4)
    assert (nvfp4.block_size, nvfp4.scale_dtype, nvfp4.has_tensor_scale) == (16, "e4m3", True)
    assert FORMATS["int4"].default_group_size == 128 and FORMATS["int4"].packed
    assert [n for n, s in FORMATS.items() if s.scale_dtype is None] == ["bf16", "fp16"]
    assert [n for n, s in FORMATS.items() if s.packed] == ["int4", "mxfp4", "nvfp4", "int2"]
    with pytest.raises(dataclasses_frozen_error()):
        FORMATS["int8"].max_finite = 1.0


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_unknown_format_lists_the_valid_names():
    with pytest.raises(ValueError, match="unknown number format 'int3'.*int8, int4, mxfp8"):
        get_format("int3")
    with pytest.raises(ValueError, match="valid formats"):
        quantize(X, "fp4")


@pytest.mark.parametrize(
    ("fmt", "kwargs", "message"),
    [
        ("int8", {"group_size": 0}, "group_size must be a positive int or None, got 0"),
        ("int4", {"group_size": -3}, "group_size must be a positive int"),
        ("int8", {"group_size": 2.5}, "got 2.5"),
        ("int8", {"axis": 3}, r"axis=3 is out of range for a 3-d tensor .* \[-3, 2\]"),
        ("fp8_e4m3", {"axis": -4}, "axis=-4 is out of range"),
        ("mxfp4", {"axis": None}, "axis=None .* is not allowed, pass axis=-1"),
        ("nvfp4", {"axis": None}, "blocks of 16"),
        ("mxfp8", {"group_size": 16}, "fixes its block at 32 elements; pass group_size=None or 32"),
        ("nvfp4", {"group_size": 32}, "pass group_size=None or 16, not 32"),
        ("int8", {"axis": None, "group_size": 8}, "needs an axis to group along"),
        ("fp8_e4m3", {"symmetric": False}, "only for int8, int4 and int2"),
        ("bf16", {"group_size": 8}, "plain cast with no scale; pass group_size=None"),
    ],
)
def test_bad_arguments_say_what_is_wrong_and_what_is_right(fmt, kwargs, message):
    with pytest.raises(ValueError, match=message):
        quantize(X, fmt, **kwargs)


def test_non_float_and_empty_input_are_rejected():
    with pytest.raises(ValueError, match="must be a float array, got int32"):
        quantize(np.arange(4, dtype=np.int32), "int8")
    with pytest.raises(ValueError, match="empty tensor"):
        quantize(np.zeros((0, 4), np.float32), "int8")


def test_accepts_numpy_and_jax_inputs_of_any_float_dtype():
    # Values on the E4M3 grid are exact in every wider float type, so every input dtype
    # must give the same result.
    x8 = X.astype(ml_dtypes.float8_e4m3fn)
    reference = np.asarray(dequantize(quantize(x8.astype(np.float32), "int8")))
    assert reference.dtype == np.float32
    inputs = [x8, x8.astype(np.float16), x8.astype(np.float64), x8.astype(ml_dtypes.bfloat16)]
    inputs += [jnp.asarray(x8.astype(np.float16)), jnp.asarray(x8.astype(np.float32), jnp.bfloat16)]
    inputs += [x8.astype(np.float32).tolist()]
    for x in inputs:
        got = np.asarray(dequantize(quantize(x, "int8")))
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, reference)


@pytest.mark.parametrize("fmt", NAMES)
def test_non_finite_input_raises_eagerly_with_format_and_count(fmt):
    x = X.copy()
    x[0, 0, 0], x[1, 2, 3], x[2, 4, 39] = np.inf, np.nan, -np.inf
    with pytest.raises(ValueError, match=rf"quantize to {fmt}: 3 of 600 input elements"):
        quantize(x, fmt, axis=-1)
    # float64 input that overflows float32 counts as non-finite too.
    with pytest.raises(ValueError, match="1 of 2"):
        quantize(np.array([1e300, 1.0]), fmt, axis=-1)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8", "int4", "mxfp8", "mxfp4"])
def test_non_finite_under_jit_makes_only_its_group_nan(fmt):
    # Documented contract: a group holding inf/NaN gets a NaN scale, the others are intact.
    x = X.copy()
    x[0, 0, 0] = np.inf
    q = jax.jit(lambda v: quantize(v, fmt, axis=-1, group_size=None))(x)
    got = np.asarray(dequantize(q))
    first_group = slice(0, 32) if FORMATS[fmt].block_size else slice(0, 40)
    assert np.isnan(got[0, 0, first_group]).all()
    nan_count = first_group.stop - first_group.start
    assert np.isnan(got).sum() == nan_count
    clean = np.asarray(dequantize(quantize(X, fmt, axis=-1)))
    np.testing.assert_array_equal(got[1:], clean[1:])


def test_nvfp4_non_finite_under_jit_poisons_the_tensor_scale():
    x = X.copy()
    x[2, 1, 7] = np.nan
    q = jax.jit(lambda v: quantize(v, "nvfp4"))(x)
    assert np.isnan(np.asarray(q.tensor_scale))
    assert np.isnan(np.asarray(dequantize(q))).all()


@pytest.mark.parametrize("fmt", NAMES)
def test_jit_and_eager_give_identical_bits(fmt):
    kwargs = kwargs_for(fmt)
    eager = quantize(X, fmt, **kwargs)
    jitted = jax.jit(lambda v: quantize(v, fmt, **kwargs))(X)
    leaves_e, tree_e = jax.tree_util.tree_flatten(eager)
    leaves_j, tree_j = jax.tree_util.tree_flatten(jitted)
    assert tree_e == tree_j
    for a, b in zip(leaves_e, leaves_j, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(bits(a), bits(b))
    np.testing.assert_array_equal(bits(dequantize(eager)), bits(jax.jit(dequantize)(jitted)))


@pytest.mark.parametrize("fmt", ["int4", "nvfp4", "fp8_e4m3", "bf16"])
def test_qarray_is_a_pytree_that_crosses_jit(fmt):
    q = quantize(X, fmt, **kwargs_for(fmt))
    leaves, treedef = jax.tree_util.tree_flatten(q)
    expected_leaves = {"int4": 3, "nvfp4": 3, "fp8_e4m3": 2, "bf16": 1}[fmt]  # None: no leaf
    assert len(leaves) == expected_leaves
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert isinstance(rebuilt, QArray)
    assert (rebuilt.shape, rebuilt.fmt, rebuilt.axis, rebuilt.group_size) == (
        q.shape,
        q.fmt,
        q.axis,
        q.group_size,
    )

    @jax.jit
    def through(params):
        return params["w"], dequantize(params["w"]) * 2.0

    out_q, doubled = through({"w": q})
    assert isinstance(out_q, QArray) and out_q.fmt == fmt and out_q.shape == X.shape
    np.testing.assert_array_equal(np.asarray(doubled), 2.0 * np.asarray(dequantize(q)))
    # tree_map over the arrays keeps the static layout.
    copied = jax.tree_util.tree_map(lambda a: a + 0, q)
    np.testing.assert_array_equal(np.asarray(dequantize(copied)), np.asarray(dequantize(q)))


def test_static_layout_is_part_of_the_treedef():
    a = quantize(X, "int8", axis=-1)
    b = quantize(X, "int8", axis=0)
    assert jax.tree_util.tree_structure(a) != jax.tree_util.tree_structure(b)


def test_qarray_fields_and_scale_storage():
    q = quantize(X, "mxfp8", axis=-2)
    assert q.axis == 1 and q.group_size == 32 and q.shape == (3, 5, 40)
    assert q.scale.dtype == np.uint8 and q.scale.shape == (3, 1, 40)  # E8M0 biased exponents
    assert q.zero_point is None and q.tensor_scale is None
    # scale_float32 decodes 2^(code - 127).
    np.testing.assert_array_equal(
        scale_float32(q), np.ldexp(np.float32(1), np.asarray(q.scale).astype(int) - 127)
    )
    assert "mxfp8" in repr(q) and "(3, 1, 40)" in repr(q)
    assert quantize(X, "bf16").axis is None and quantize(X, "bf16").scale is None
    assert quantize(X, "int8", axis=None).scale.shape == (1, 1, 1)
