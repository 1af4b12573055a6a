"""layout.py, qarray.py and the package's lazy names, by arithmetic and without quantizing
(fast enough for `make mutation TARGETS=numerics-layout`): each Layout field and byte count
worked out by hand (two 4-bit or four 2-bit codes a byte, float32 scales 4 B, E8M0/E4M3
scales 1 B, int8 zero points 1 B, int2 float32 zero points 4 B, nvfp4's tensor scale 4 B),
every argument error word for word, and QArray's pytree split (arrays are children, the
layout is static aux data).
"""

from __future__ import annotations

import dataclasses

import jax
import ml_dtypes
import numpy as np
import pytest

import tenantq.numerics as numerics
from tenantq.numerics import FORMATS, Layout, QArray, effective_bits, resolve_layout, storage_nbytes
from tenantq.numerics.layout import packed_length


def test_packed_length_rounds_up():
    assert [packed_length(n) for n in (1, 2, 5, 8)] == [1, 1, 3, 4]  # two per byte
    assert [packed_length(n, 4) for n in (1, 4, 5, 9)] == [1, 1, 2, 3]  # int2: four


@pytest.mark.parametrize(
    ("shape", "fmt", "kwargs", "want"),
    [
        # (axis, group_size, group_length, n_groups, symmetric)
        ((2, 7), "int8", {}, (1, None, 7, 1, True)),  # whole last axis: one group
        ((2, 7), "int8", {"group_size": 3}, (1, 3, 3, 3, True)),  # 3 + 3 + 1
        ((2, 7), "int8", {"group_size": 7}, (1, 7, 7, 1, True)),
        ((2, 7), "int8", {"group_size": 9}, (1, 9, 7, 1, True)),  # one group: no padding
        ((2, 7), "int4", {}, (1, 128, 7, 1, True)),  # int4's default group 128
        ((2, 300), "int4", {"axis": -1}, (1, 128, 128, 3, True)),
        ((2, 7), "int4", {"axis": -2, "symmetric": False}, (0, 128, 2, 1, False)),
        ((2, 7), "int2", {}, (1, 32, 7, 1, False)),  # KIVI: always asymmetric
        ((2, 7), "int2", {"symmetric": True}, (1, 32, 7, 1, False)),
        ((2, 70), "mxfp4", {"group_size": 32}, (1, 32, 32, 3, True)),
        ((40, 3), "nvfp4", {"axis": 0}, (0, 16, 16, 3, True)),
        ((2, 7), "fp8_e4m3", {"axis": None}, (None, None, 14, 1, True)),
        ((2, 7), "int8", {"axis": None, "symmetric": False}, (None, None, 14, 1, False)),
        ((2, 7), "bf16", {"axis": 0}, (None, None, 1, 1, True)),  # casts: no axis at all
        ((2, 7), "int8", {"axis": np.int64(0), "group_size": np.int32(2)}, (0, 2, 2, 1, True)),
        ((), "int8", {"axis": None}, (None, None, 1, 1, True)),  # 0-d, one scale
    ],
)
def test_resolve_layout_fields(shape, fmt, kwargs, want):
    layout = resolve_layout(shape, fmt, **kwargs)
    assert layout.spec is FORMATS[fmt] and layout.shape == shape
    got = (layout.axis, layout.group_size, layout.group_length, layout.n_groups, layout.symmetric)
    assert got == want
    assert all(type(v) is int for v in got[:4] if v is not None)


@pytest.mark.parametrize(
    ("shape", "fmt", "kwargs", "parts"),
    [
        # (data shape, scale shape, data B, scale B, zero point B, tensor scale B)
        ((2, 7), "bf16", {}, ((2, 7), None, 28, 0, 0, 0)),
        ((2, 7), "fp16", {}, ((2, 7), None, 28, 0, 0, 0)),
        ((2, 7), "fp8_e5m2", {}, ((2, 7), (2, 1), 14, 8, 0, 0)),
        ((2, 7), "int8", {"axis": 0, "group_size": 1}, ((2, 7), (2, 7), 14, 56, 0, 0)),
        ((2, 7), "int8", {"axis": None, "symmetric": False}, ((2, 7), (1, 1), 14, 4, 1, 0)),
        ((2, 7), "int4", {"group_size": 2, "symmetric": False}, ((2, 4), (2, 4), 8, 32, 8, 0)),
        ((2, 9), "int2", {}, ((2, 3), (2, 1), 6, 8, 8, 0)),
        ((3, 64), "mxfp8", {}, ((3, 64), (3, 2), 192, 6, 0, 0)),
        ((3, 64), "mxfp4", {}, ((3, 32), (3, 2), 96, 6, 0, 0)),
        ((2, 33), "nvfp4", {}, ((2, 17), (2, 3), 34, 6, 0, 4)),
    ],
)
def test_layout_shapes_and_bytes_by_hand(shape, fmt, kwargs, parts):
    layout = resolve_layout(shape, fmt, **kwargs)
    data_shape, scale_shape, data_b, scale_b, zp_b, ts_b = parts
    assert (layout.data_shape, layout.scale_shape) == (data_shape, scale_shape)
    got = (layout.data_nbytes, layout.scale_nbytes, layout.zero_point_nbytes)
    assert got + (layout.tensor_scale_nbytes,) == (data_b, scale_b, zp_b, ts_b)
    total = data_b + scale_b + zp_b + ts_b
    assert layout.nbytes == total == storage_nbytes(shape, fmt, **kwargs)
    numel = int(np.prod(shape))
    assert effective_bits(shape, fmt, **kwargs) == 8.0 * total / numel


def test_storage_nbytes_and_effective_bits_of_common_layouts():
    # int4, groups of 128 along 256: 4 * 128 data B + 4 * 2 float32 scales = 544 B, 4.25 bits
    assert storage_nbytes((4, 256), "int4") == 544
    assert effective_bits((4, 256), "int4") == 4.25
    # mxfp4: 32 elements in 16 B + one E8M0 byte = 17 B = 4.25 bits
    assert storage_nbytes([1, 32], "mxfp4") == 17 and effective_bits((1, 32), "mxfp4") == 4.25
    # int2 (KIVI): 32 codes in 8 B + float32 scale + float32 zero point = 16 B = 4 bits
    assert effective_bits((1, 32), "int2") == 4.0
    # nvfp4: 16 elements in 8 B + one E4M3 byte + the 4 B tensor scale = 13 B
    assert storage_nbytes((1, 16), "nvfp4") == 13
    assert effective_bits((2, 4), "int8", axis=None, symmetric=False) == 8.0 * 13 / 8
    assert effective_bits((np.int64(2), 4), "bf16", axis=0, group_size=None) == 16.0


def test_layout_along_axis_directly():
    spec = FORMATS["int8"]
    assert Layout.along_axis(spec, (4, 10), 1, None, True).n_groups == 1
    assert Layout.along_axis(spec, (4, 10), 0, 3, False) == Layout(spec, (4, 10), 0, 3, 3, 2, False)


X = (2, 3)
CAST_ONLY = "is a plain cast with no scale"
BAD = [
    ((), "int8", {"axis": -1}, "int8: a 0-d tensor has no axis -1; pass axis=None"),
    ((), "int4", {"axis": None}, "int4 packs along the last axis and needs ndim >= 1; got 0-d"),
    ((0, 3), "int8", {}, "int8: cannot quantize an empty tensor of shape (0, 3)"),
    ((3, 0), "fp8_e4m3", {}, "fp8_e4m3: cannot quantize an empty tensor of shape (3, 0)"),
    (X, "int8", {"group_size": True}, "int8: group_size must be a positive int or None, got True"),
    (X, "int8", {"group_size": 0}, "int8: group_size must be a positive int or None, got 0"),
    (X, "int8", {"group_size": "4"}, "int8: group_size must be a positive int or None, got '4'"),
    (X, "int4", {"group_size": 2.0}, "int4: group_size must be a positive int or None, got 2.0"),
    (X, "int8", {"axis": True},
     "int8: axis=True is out of range for a 2-d tensor of shape (2, 3); pass an int in [-2, 1] "
     "or None"),
    (X, "int8", {"axis": 2},
     "int8: axis=2 is out of range for a 2-d tensor of shape (2, 3); pass an int in [-2, 1] "
     "or None"),
    (X, "int8", {"axis": -3},
     "int8: axis=-3 is out of range for a 2-d tensor of shape (2, 3); pass an int in [-2, 1] "
     "or None"),
    (X, "int8", {"axis": 1.0},
     "int8: axis=1.0 is out of range for a 2-d tensor of shape (2, 3); pass an int in [-2, 1] "
     "or None"),
    (X, "mxfp4", {"axis": None},
     "mxfp4 scales blocks of 32 along an axis; axis=None (one scale per tensor) is not "
     "allowed, pass axis=-1 or another axis"),
    (X, "int8", {"axis": None, "group_size": 4},
     "int8: group_size=4 needs an axis to group along; pass axis=k or group_size=None for one "
     "scale per tensor"),
    (X, "mxfp8", {"group_size": 16},
     "mxfp8 fixes its block at 32 elements; pass group_size=None or 32, not 16"),
    (X, "bf16", {"group_size": 2}, "bf16 is a plain cast with no scale; pass group_size=None"),
    (X, "fp8_e4m3", {"symmetric": False},
     "fp8_e4m3: symmetric=False (zero points) exists only for int8, int4 and int2"),
    (X, "bf16", {"symmetric": False},
     "bf16: symmetric=False (zero points) exists only for int8, int4 and int2"),
]  # fmt: skip


@pytest.mark.parametrize(("shape", "fmt", "kwargs", "message"), BAD)
def test_bad_layout_arguments_are_one_exact_line(shape, fmt, kwargs, message):
    with pytest.raises(ValueError) as err:
        resolve_layout(shape, fmt, **kwargs)
    assert str(err.value) == message
    with pytest.raises(ValueError):  # storage_nbytes validates the same way
        storage_nbytes(shape, fmt, **kwargs)


def test_edges_accepted():
    assert resolve_layout(X, "int8", axis=-2).axis == 0 and resolve_layout(X, "int8", axis=1)
    assert resolve_layout(X, "mxfp8", group_size=32).group_size == 32
    assert resolve_layout(X, "int8", group_size=1).n_groups == 3


# --- QArray ---------------------------------------------------------------------------------


def _qarray(**changes) -> QArray:
    fields = {
        "data": np.zeros((2, 3), np.uint8),
        "scale": np.ones((2, 1), ml_dtypes.float8_e4m3fn),
        "zero_point": None,
        "tensor_scale": np.float32(1.0),
        "shape": (2, 5),
        "fmt": "nvfp4",
        "axis": 1,
        "group_size": 16,
    }
    return QArray(**{**fields, **changes})


def test_qarray_pytree_split():
    q = _qarray(zero_point=np.zeros((2, 1), np.int8))
    children, aux = q.tree_flatten()
    assert [c is getattr(q, f) for c, f in zip(children, ("data", "scale", "zero_point",
            "tensor_scale"), strict=True)] == [True] * 4  # fmt: skip
    assert aux == ((2, 5), "nvfp4", 1, 16)
    back = QArray.tree_unflatten(aux, children)
    assert isinstance(back, QArray)
    assert [getattr(back, f) is getattr(q, f) for f in ("data", "scale", "zero_point")] == [
        True
    ] * 3
    assert (back.shape, back.fmt, back.axis, back.group_size) == ((2, 5), "nvfp4", 1, 16)
    leaves, treedef = jax.tree_util.tree_flatten(_qarray())  # None children are no leaves
    assert len(leaves) == 3 and treedef.num_leaves == 3


def test_qarray_properties_and_true_bytes():
    q = _qarray()
    assert q.spec is FORMATS["nvfp4"] and q.ndim == 2 and q.size == 10
    # 6 packed data bytes + 2 E4M3 scales + a 4-byte float32 tensor scale
    assert q.nbytes == 12
    q = _qarray(fmt="int8", data=np.zeros((2, 5), np.int8), scale=np.ones((2, 1), np.float32),
                zero_point=np.zeros((2, 1), np.int8), tensor_scale=None)  # fmt: skip
    assert q.nbytes == 10 + 8 + 2
    q = _qarray(fmt="bf16", data=np.zeros((2, 5), ml_dtypes.bfloat16), scale=None,
                tensor_scale=None, axis=None, group_size=None)  # fmt: skip
    assert q.nbytes == 20 and q.size == 10
    plain = QArray(np.zeros(3, np.float16), None, None, None, (3,), "fp16")
    assert (plain.axis, plain.group_size) == (None, None) and plain.nbytes == 6


def test_qarray_repr():
    assert repr(_qarray()) == (
        "QArray(fmt='nvfp4', shape=(2, 5), axis=1, group_size=16, data=(2, 3):uint8, "
        "scale=(2, 1), asymmetric=False)"
    )
    q = _qarray(fmt="bf16", scale=None, zero_point=np.zeros(1, np.int8))
    assert repr(q) == (
        "QArray(fmt='bf16', shape=(2, 5), axis=1, group_size=16, data=(2, 3):uint8, "
        "scale=None, asymmetric=True)"
    )


def test_qarray_is_frozen_identity_compared_and_hashable():
    q, r = _qarray(), _qarray()
    assert q == q and q != r  # eq=False: identity, never an elementwise array comparison
    assert isinstance(hash(q), int)  # frozen without eq: the identity hash, no field hashing
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.fmt = "int8"


# --- the package's lazy names ---------------------------------------------------------------


def test_lazy_names_come_from_their_modules():
    from tenantq.numerics import codec, packing, qarray

    for name in ("pack_fp4", "pack_int4", "unpack_fp4", "unpack_int4"):
        assert getattr(numerics, name) is getattr(packing, name)
    assert numerics.QArray is qarray.QArray
    for name in (
        "NVFP4Scale", "compute_scale_zero_point", "dequantize", "layout_of",
        "nvfp4_tensor_scale", "quantize", "quantize_with_scale_zero_point", "scale_float32",
    ):  # fmt: skip
        assert getattr(numerics, name) is getattr(codec, name)
    assert sorted(numerics.__all__) == numerics.__all__ and len(numerics.__all__) == 20
    assert all(hasattr(numerics, name) for name in numerics.__all__)
    assert vars(numerics)["quantize"] is codec.quantize  # cached after the first look-up


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError) as err:
        numerics.quantise  # noqa: B018
    assert str(err.value) == "module 'tenantq.numerics' has no attribute 'quantise'"
