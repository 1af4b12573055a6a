"""`quantize` and `dequantize`: float32 in, `QArray` out, and back, for every format.

Each format family is one small function over groups: reduce the group (amax, or min/max
for zero points), derive the scale the format prescribes, divide, saturate, encode. The
work runs under one jax.jit per layout, so a call from eager code and the same call
inside a caller's jit compute the same thing, and eager calls compile once per layout.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from tenantq.numerics import elements
from tenantq.numerics.formats import FormatSpec, get_format
from tenantq.numerics.layout import Layout, resolve_layout
from tenantq.numerics.packing import pack_nibbles, sign_extend_int4, unpack_nibbles
from tenantq.numerics.qarray import QArray

_TINY = np.float32(np.finfo(np.float32).tiny)  # smallest normal float32; XLA:CPU flushes below
_NAN = np.float32(np.nan)
NVFP4_ELEMENT_MAX = 6.0  # E2M1 largest magnitude
NVFP4_SCALE_MAX = 448.0  # E4M3 largest magnitude


def quantize(
    x, fmt: str | FormatSpec, *, axis: int | None = -1, group_size=None, symmetric=True
) -> QArray:
    """Store `x` (numpy or jax, any float dtype; computed in float32) in format `fmt`.

    axis=None: one scale per tensor; axis=k: scales reduce over axis k, one per slice of
    the other axes; group_size=g: groups of g consecutive elements along axis k, a partial
    last group scaled over its real elements. MX formats use blocks of 32 along `axis`,
    nvfp4 blocks of 16 (plus a float32 tensor scale); int4 groups 128 by default.
    Casts (bf16, fp16) ignore `axis` and saturate at the format's largest finite value.

    Non-finite input: an eager call raises ValueError naming the format and the count of
    inf/NaN elements. Inside jit nothing can raise; instead every group that contains an
    inf or NaN gets a NaN scale (E8M0 code 0xFF; for nvfp4 the tensor scale is NaN) and
    zero elements, so the whole group (for nvfp4 the whole tensor) dequantizes to NaN.
    Casts clip inf to +-max_finite and keep NaN.

    A float32 scale that would be subnormal (fp8/int group amax below ~1e-36, nvfp4
    tensor amax below ~3e-35; XLA:CPU flushes subnormals to zero) is stored as 1, so
    such groups round to zero. MX scales clamp at E8M0's 2^-127 instead.
    """
    spec = get_format(fmt)
    if not isinstance(x, jax.Array):  # numpy (any float dtype, ml_dtypes included) or lists
        x = np.asarray(x)
        if jnp.issubdtype(x.dtype, jnp.floating):
            with np.errstate(over="ignore"):  # float64 beyond float32 -> inf, reported below
                x = x.astype(np.float32)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"quantize to {spec.name}: x must be a float array, got {x.dtype}")
    x = jnp.asarray(x)
    layout = resolve_layout(x.shape, spec, axis=axis, group_size=group_size, symmetric=symmetric)
    if not isinstance(x, jax.core.Tracer):
        n_bad = int(x.size - jnp.count_nonzero(jnp.isfinite(x.astype(jnp.float32))))
        if n_bad:
            raise ValueError(
                f"quantize to {spec.name}: {n_bad} of {x.size} input elements are not "
                f"finite (inf or NaN in float32); quantize only finite tensors"
            )
    return _quantize_jit(x, layout)


def dequantize(q: QArray) -> jax.Array:
    """The float32 values `q` stands for, in its logical shape."""
    return _dequantize_jit(q.data, q.scale, q.zero_point, q.tensor_scale, layout_of(q))


def layout_of(q: QArray) -> Layout:
    """The Layout a QArray was quantized with, read from its static fields."""
    spec = get_format(q.fmt)
    symmetric = q.zero_point is None
    if spec.scale_dtype is None:
        return Layout(spec, q.shape, None, None, 1, 1, True)
    if q.axis is None:
        return Layout(spec, q.shape, None, None, math.prod(q.shape), 1, symmetric)
    return Layout.along_axis(spec, q.shape, q.axis, q.group_size, symmetric)


def scale_float32(q: QArray) -> np.ndarray | None:
    """Each group's multiplicative scale as a host float32 array (None for casts).

    For nvfp4 this is block scale times tensor scale; asymmetric ints also need the
    zero point. For inspection and tests, not for kernels.
    """
    if q.scale is None:
        return None
    family = get_format(q.fmt).family
    if family == "mx":
        return elements.e8m0_to_float32(q.scale)
    scale = np.asarray(q.scale).astype(np.float32)
    if family == "nvfp4":
        scale = scale * np.float32(q.tensor_scale)
    return scale


# --- grouping ---------------------------------------------------------------------------


def _group_reduce(x: jax.Array, layout: Layout, reduce) -> jax.Array:
    """reduce(x) over each group; the result has the scale's shape (ndim preserved)."""
    if layout.axis is None:
        return reduce(x, axis=None).reshape((1,) * x.ndim)
    k, g, n = layout.axis, layout.group_length, layout.n_groups
    moved = jnp.moveaxis(x, k, -1)
    pad = n * g - moved.shape[-1]
    if pad:  # zeros change neither amax nor min(.,0)/max(.,0), nor finiteness
        moved = jnp.pad(moved, [(0, 0)] * (moved.ndim - 1) + [(0, pad)])
    grouped = moved.reshape(moved.shape[:-1] + (n, g))
    return jnp.moveaxis(reduce(grouped, axis=-1), -1, k)


def _expand(per_group: jax.Array, layout: Layout) -> jax.Array:
    """Per-group values broadcast back to (something broadcastable to) the logical shape."""
    if layout.axis is None or layout.n_groups == 1:
        return per_group
    k = layout.axis
    repeated = jnp.repeat(per_group, layout.group_length, axis=k)
    return jax.lax.slice_in_dim(repeated, 0, layout.shape[k], axis=k)


def _amax(x: jax.Array, layout: Layout) -> jax.Array:
    return _group_reduce(jnp.abs(x), layout, jnp.max)  # NaN propagates, inf stays inf


def _usable(scale: jax.Array) -> jax.Array:
    return jnp.isfinite(scale) & (scale >= _TINY)


# --- quantizers, one per family ----------------------------------------------------------


def _quantize_cast(x, layout):
    spec = layout.spec
    return elements.saturating_cast(x, spec.element_dtype, spec.max_finite), None, None, None


def _quantize_float(x, layout):
    """fp8: float32 scale = amax / max_finite per group; elements saturate before the cast."""
    spec = layout.spec
    amax = _amax(x, layout)
    bad = ~jnp.isfinite(amax)
    scale = amax / spec.max_finite
    scale = jnp.where(_usable(scale), scale, jnp.float32(1.0))
    y = jnp.where(_expand(bad, layout), 0.0, x / _expand(scale, layout))
    data = elements.saturating_cast(y, spec.element_dtype, spec.max_finite)
    return data, jnp.where(bad, _NAN, scale), None, None


def _quantize_int(x, layout):
    """int8/int4: round half to even, clip, cast; asymmetric adds an int8 zero point."""
    spec = layout.spec
    qmax = spec.max_finite  # 127 or 7
    if layout.symmetric:
        qmin = -qmax  # symmetric grids drop -128/-8 so that +-amax are both representable
        amax = _amax(x, layout)
        bad = ~jnp.isfinite(amax)
        scale = amax / qmax
        scale = jnp.where(_usable(scale), scale, jnp.float32(1.0))
        q = jnp.round(x / _expand(scale, layout))
        zero_point = None
    else:
        qmin = -qmax - 1
        lo = jnp.minimum(_group_reduce(x, layout, jnp.min), 0.0)
        hi = jnp.maximum(_group_reduce(x, layout, jnp.max), 0.0)
        bad = ~(jnp.isfinite(lo) & jnp.isfinite(hi))
        levels = qmax - qmin  # 255 or 15
        span = hi - lo
        # hi - lo overflows float32 only for |x| near 3.4e38; split the division there.
        scale = jnp.where(jnp.isfinite(span), span / levels, hi / levels - lo / levels)
        scale = jnp.where(_usable(scale), scale, jnp.float32(1.0))
        lo = jnp.where(bad, 0.0, lo)
        zp = jnp.clip(jnp.round(qmin - lo / scale), qmin, qmax)
        q = jnp.round(x / _expand(scale, layout)) + _expand(zp, layout)
        zero_point = zp.astype(jnp.int8)
    q = jnp.where(_expand(bad, layout), 0.0, q)
    q = jnp.clip(q, qmin, qmax).astype(jnp.int8)
    data = pack_nibbles(q.astype(jnp.uint8)) if spec.packed else q
    return data, jnp.where(bad, _NAN, scale), zero_point, None


def _element_emax(spec: FormatSpec) -> int:
    """Exponent of the element format's largest power of two: 8 for E4M3, 2 for E2M1."""
    return math.floor(math.log2(spec.max_finite))


def _encode_elements(y, spec: FormatSpec):
    """Scaled float32 values -> stored elements (saturating; packed E2M1 for fp4)."""
    if spec.element_dtype == "float4_e2m1fn":
        return pack_nibbles(elements.encode_e2m1(y))
    return elements.saturating_cast(y, spec.element_dtype, spec.max_finite)


def _decode_elements(data, layout: Layout):
    if layout.spec.element_dtype == "float4_e2m1fn":
        return elements.decode_e2m1(unpack_nibbles(data, layout.shape[-1]))
    return data.astype(jnp.float32)


def _quantize_mx(x, layout):
    """OCP MX v1.0 section 6.3: X = 2^(floor(log2(amax)) - emax_elem), elements x / X.

    X is stored as its E8M0 code floor(log2 amax) - emax + 127, clamped to [0, 254]; an
    all-zero block takes the lowest scale 2^-127 (log2(0) = -inf, clamped), 0xFF is NaN.
    """
    spec = layout.spec
    amax = _amax(x, layout)
    bad = ~jnp.isfinite(amax)
    exponent = jnp.clip(elements.floor_log2(amax) - _element_emax(spec), -127, 127)
    # x * 2^-exponent is exact; -exponent <= 127 and >= -125 for any finite float32 amax.
    inverse = elements.pow2(jnp.clip(-exponent, -126, 127))
    y = jnp.where(_expand(bad, layout), 0.0, x * _expand(inverse, layout))
    code = jnp.where(bad, elements.E8M0_NAN, exponent + elements.E8M0_BIAS).astype(jnp.uint8)
    return _encode_elements(jnp.clip(y, -spec.max_finite, spec.max_finite), spec), code, None, None


def _quantize_nvfp4(x, layout):
    """NVFP4: tensor scale G = amax / (448 * 6); block scale s = e4m3(amax_block / 6 / G);
    elements e2m1(x / (s * G)). A zero tensor takes G = 1; a zero block s = 0 and zeros.
    """
    spec = layout.spec
    amax_tensor = jnp.max(jnp.abs(x))
    bad = ~jnp.isfinite(amax_tensor)
    tensor_scale = amax_tensor / (NVFP4_SCALE_MAX * NVFP4_ELEMENT_MAX)
    tensor_scale = jnp.where(_usable(tensor_scale), tensor_scale, jnp.float32(1.0))
    block_target = _amax(x, layout) / NVFP4_ELEMENT_MAX / tensor_scale
    block_scale = elements.saturating_cast(block_target, "float8_e4m3fn", NVFP4_SCALE_MAX)
    step = _expand(block_scale.astype(jnp.float32) * tensor_scale, layout)
    safe_step = jnp.where(step > 0, step, 1.0)
    y = jnp.where((step > 0) & ~bad, x / safe_step, 0.0)
    data = _encode_elements(y, spec)
    return data, block_scale, None, jnp.where(bad, _NAN, tensor_scale)


_QUANTIZERS = {
    "cast": _quantize_cast,
    "float": _quantize_float,
    "int": _quantize_int,
    "mx": _quantize_mx,
    "nvfp4": _quantize_nvfp4,
}


def _quantize_impl(x, layout: Layout) -> QArray:
    quantizer = _QUANTIZERS[layout.spec.family]
    data, scale, zero_point, tensor_scale = quantizer(x.astype(jnp.float32), layout)
    return QArray(
        data, scale, zero_point, tensor_scale, layout.shape, layout.spec.name, layout.axis,
        layout.group_size,
    )  # fmt: skip


def _dequantize_impl(data, scale, zero_point, tensor_scale, layout: Layout):
    family = layout.spec.family
    if family == "cast":
        return data.astype(jnp.float32)
    if family == "float":
        return data.astype(jnp.float32) * _expand(scale, layout)
    if family == "int":
        q = data
        if layout.spec.packed:
            q = sign_extend_int4(unpack_nibbles(data, layout.shape[-1]))
        q = q.astype(jnp.float32)
        if zero_point is not None:
            q = q - _expand(zero_point, layout).astype(jnp.float32)
        return q * _expand(scale, layout)
    values = _decode_elements(data, layout)
    if family == "mx":
        return elements.scale_by_e8m0(values, _expand(scale, layout))
    step = scale.astype(jnp.float32) * tensor_scale  # same product as in _quantize_nvfp4
    return values * _expand(step, layout)


_quantize_jit = jax.jit(_quantize_impl, static_argnums=1)
_dequantize_jit = jax.jit(_dequantize_impl, static_argnums=4)
