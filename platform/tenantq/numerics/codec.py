"""`quantize` and `dequantize`: float32 in, `QArray` out, and back, for every format.

Quantization is two steps, as in qwix: `compute_scale_zero_point` derives the scales (and
zero points) a format prescribes from a tensor or from given statistics (calibrated amax,
a clipping search, static scales); `quantize_with_scale_zero_point` divides, rounds,
saturates and encodes with given scales. `quantize` is exactly their composition, and
every other quantizer in tenantq (GPTQ, AWQ, the KV pool's writes) calls these two, so a
format's arithmetic is written once. Each runs under one jax.jit per layout.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tenantq.numerics import elements
from tenantq.numerics.formats import FormatSpec, get_format
from tenantq.numerics.layout import Layout, resolve_layout
from tenantq.numerics.packing import (
    _pack2_jit,
    _unpack2_jit,
    pack_nibbles,
    sign_extend_int4,
    unpack_nibbles,
)
from tenantq.numerics.qarray import QArray

_TINY = np.float32(np.finfo(np.float32).tiny)  # smallest normal float32; XLA:CPU flushes below
_NAN = np.float32(np.nan)
NVFP4_ELEMENT_MAX = 6.0  # E2M1 largest magnitude
NVFP4_SCALE_MAX = 448.0  # E4M3 largest magnitude


class NVFP4Scale(NamedTuple):
    """nvfp4's two-level scale: E4M3 `block` scales (one per 16) times a float32 `tensor` G.

    `tensor` is a scalar for a whole tensor; it may be any shape that broadcasts against
    `block` (the KV pool gives each token its page's G).
    """

    block: jax.Array
    tensor: jax.Array


def quantize(
    x, fmt: str | FormatSpec, *, axis: int | None = -1, group_size=None, symmetric=True
) -> QArray:
    """Store `x` (numpy or jax, any float dtype; computed in float32) in format `fmt`.

    axis=None: one scale per tensor; axis=k: scales reduce over axis k, one per slice of
    the other axes; group_size=g: groups of g consecutive elements along axis k, a partial
    last group scaled over its real elements. MX formats use blocks of 32 along `axis`,
    nvfp4 blocks of 16 (plus a float32 tensor scale); int4 groups 128 by default.
    Casts (bf16, fp16) ignore `axis` and saturate at the format's largest finite value.
    Exactly `quantize_with_scale_zero_point(x, fmt, *compute_scale_zero_point(x, fmt))`.

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
    x = _float_input(x, spec)
    layout = resolve_layout(x.shape, spec, axis=axis, group_size=group_size, symmetric=symmetric)
    return _quantize_jit(x, layout)


def compute_scale_zero_point(
    x,
    fmt: str | FormatSpec,
    *,
    axis: int | None = -1,
    group_size=None,
    symmetric=True,
    amax=None,
    amin=None,
    tensor_scale=None,
):
    """The (scale, zero_point) `quantize(x, fmt, ...)` would store, as stored.

    scale: float32 for fp8/int (amax / max_finite, or (hi - lo) / levels asymmetric, a
    true IEEE division); uint8 E8M0 codes for MX; an `NVFP4Scale(block, tensor)` for
    nvfp4; None for casts. zero_point: int8 for asymmetric int, else None. Shapes follow
    the layout (one entry per group; (1,)*ndim for axis=None).

    amax / amin, if given, replace the statistics measured from x and broadcast to the
    scale's shape: symmetric formats read amax as the group's max |x| (>= 0); asymmetric
    int reads amax as the group's max and amin as its min (either may be given alone).
    For nvfp4, amax is each block's max |x|, and the tensor scale is
    G = max(amax) / (448 * 6) (the tensor's amax when amax was measured) unless
    `tensor_scale` (nvfp4 only: a float32 G, broadcastable to the block scales) fixes it;
    the block scales are then e4m3(amax / 6 / G).
    """
    spec = get_format(fmt)
    x = _float_input(x, spec)
    layout = resolve_layout(x.shape, spec, axis=axis, group_size=group_size, symmetric=symmetric)
    amax, amin, tensor_scale = _given_statistics(layout, amax, amin, tensor_scale)
    return _scales_jit(x, layout, amax, amin, tensor_scale)


def quantize_with_scale_zero_point(
    x, fmt: str | FormatSpec, scale, zero_point=None, *, axis: int | None = -1, group_size=None
) -> QArray:
    """Store `x` in `fmt` with given scales: elements = round(x / scale) (+ zero_point),
    round half to even, clipped to the format's range (symmetric int [-qmax, qmax],
    asymmetric [-qmax - 1, qmax]; fp8, MX and E2M1 saturate at +-max_finite).

    `scale` (and `zero_point`) are what `compute_scale_zero_point` returns for the same
    fmt/axis/group_size, or anything broadcastable to the scale's shape (a static
    per-tensor or per-head scale): float32 for fp8/int, uint8 E8M0 codes for MX, an
    `NVFP4Scale` (or a (block, tensor) pair) for nvfp4. Inside jit a group whose scale is
    NaN (E8M0 0xFF) stores zeros, which is how `quantize` marks non-finite groups; eager
    calls reject non-positive or non-finite scales and the code 0xFF.
    """
    spec = get_format(fmt)
    x = _float_input(x, spec)
    symmetric = zero_point is None
    if not symmetric and not spec.is_int:
        raise ValueError(f"{spec.name}: zero_point exists only for int8, int4 and int2; pass None")
    layout = resolve_layout(x.shape, spec, axis=axis, group_size=group_size, symmetric=symmetric)
    scale, zero_point = _given_scales(layout, scale, zero_point)
    return _quantize_with_jit(x, layout, scale, zero_point)


def nvfp4_tensor_scale(amax) -> jax.Array:
    """nvfp4's float32 tensor scale G = amax / (448 * 6), or 1 where that is not a normal
    positive float32 (zero or tiny amax; also inf/NaN amax, which callers mark as bad)."""
    amax = jnp.asarray(amax, jnp.float32)
    return _or_one(_true_divide(amax, NVFP4_SCALE_MAX * NVFP4_ELEMENT_MAX))


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


# --- argument checks (eager only; inside jit nothing can raise) ---------------------------


def _float_input(x, spec: FormatSpec) -> jax.Array:
    """x as a float jax array; eagerly, ValueError on a non-float dtype or inf/NaN."""
    if not isinstance(x, jax.Array):  # numpy (any float dtype, ml_dtypes included) or lists
        x = np.asarray(x)
        if jnp.issubdtype(x.dtype, jnp.floating):
            with np.errstate(over="ignore"):  # float64 beyond float32 -> inf, reported below
                x = x.astype(np.float32)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"quantize to {spec.name}: x must be a float array, got {x.dtype}")
    x = jnp.asarray(x)
    if not isinstance(x, jax.core.Tracer):
        n_bad = int(x.size - jnp.count_nonzero(jnp.isfinite(x.astype(jnp.float32))))
        if n_bad:
            raise ValueError(
                f"quantize to {spec.name}: {n_bad} of {x.size} input elements are not "
                f"finite (inf or NaN in float32); quantize only finite tensors"
            )
    return x


def _check_broadcasts(array, layout: Layout, what: str) -> None:
    """ValueError naming `what` unless its shape broadcasts to the layout's scale shape."""
    shape = layout.scale_shape
    try:
        fits = np.broadcast_shapes(tuple(array.shape), shape) == shape
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(
            f"{layout.spec.name}: {what} has shape {tuple(array.shape)}; it must broadcast "
            f"to the scale shape {shape} (one per group)"
        )


def _broadcast_to_scale(value, layout: Layout, what: str, dtype) -> jax.Array:
    """`value` as `dtype`, broadcast to the layout's scale shape, or a ValueError naming it."""
    array = jnp.asarray(value)
    _check_broadcasts(array, layout, what)
    return jnp.broadcast_to(array.astype(dtype), layout.scale_shape)


def _eager(array) -> bool:
    return array is not None and not isinstance(array, jax.core.Tracer)


def _given_statistics(layout: Layout, amax, amin, tensor_scale):
    spec = layout.spec
    if spec.scale_dtype is None and (amax is not None or amin is not None):
        raise ValueError(f"{spec.name} is a plain cast with no scale; pass amax=None, amin=None")
    if amin is not None and layout.symmetric:
        raise ValueError(
            f"{spec.name}: amin applies to asymmetric int only (symmetric=False); "
            f"a symmetric scale reads amax = max |x|"
        )
    if tensor_scale is not None and spec.family != "nvfp4":
        raise ValueError(f"{spec.name}: tensor_scale applies to nvfp4 only; pass None")
    if amax is not None:
        amax = _broadcast_to_scale(amax, layout, "amax", jnp.float32)
        if _eager(amax) and layout.symmetric and not bool(jnp.all(amax >= 0)):
            raise ValueError(f"{spec.name}: amax is max |x| per group and must be >= 0")
    if amin is not None:
        amin = _broadcast_to_scale(amin, layout, "amin", jnp.float32)
    for name, value in (("amax", amax), ("amin", amin)):
        if _eager(value) and not bool(jnp.all(jnp.isfinite(value))):
            raise ValueError(f"{spec.name}: {name} must be finite in every group")
    if tensor_scale is not None:
        tensor_scale = jnp.asarray(tensor_scale, jnp.float32)
        _check_broadcasts(tensor_scale, layout, "tensor_scale")
        _check_positive(tensor_scale, spec, "tensor_scale")
    return amax, amin, tensor_scale


def _check_positive(value, spec: FormatSpec, what: str, *, zero_ok=False) -> None:
    if not _eager(value):
        return
    value = jnp.asarray(value).astype(jnp.float32)
    ok = jnp.isfinite(value) & ((value >= 0) if zero_ok else (value > 0))
    if not bool(jnp.all(ok)):
        allowed = "finite and >= 0" if zero_ok else "positive and finite"
        raise ValueError(f"{spec.name}: every {what} must be {allowed}")


def _given_scales(layout: Layout, scale, zero_point):
    spec = layout.spec
    family = spec.family
    if family == "cast":
        if scale is not None:
            raise ValueError(f"{spec.name} is a plain cast with no scale; pass scale=None")
        return None, None
    if scale is None:
        raise ValueError(f"{spec.name} needs a scale; get one from compute_scale_zero_point")
    if family == "nvfp4":
        if not (isinstance(scale, tuple) and len(scale) == 2):
            raise ValueError(
                "nvfp4 needs scale=NVFP4Scale(block, tensor) (E4M3 block scales and a "
                "float32 tensor scale), as compute_scale_zero_point returns"
            )
        block = jnp.asarray(scale[0])
        if block.dtype != jnp.float8_e4m3fn:
            _check_positive(block, spec, "block scale", zero_ok=True)
            block = elements.saturating_cast(
                block.astype(jnp.float32), "float8_e4m3fn", NVFP4_SCALE_MAX
            )
        block = _broadcast_to_scale(block, layout, "block scale", jnp.float8_e4m3fn)
        tensor = jnp.asarray(scale[1], jnp.float32)
        _check_broadcasts(tensor, layout, "tensor scale")
        _check_positive(tensor, spec, "tensor scale")
        return NVFP4Scale(block, tensor), None
    if family == "mx":
        codes = jnp.asarray(scale)
        if not jnp.issubdtype(codes.dtype, jnp.integer):
            raise ValueError(
                f"{spec.name}: scale must be E8M0 codes (uint8, scale 2^(code-127)), "
                f"got {codes.dtype}"
            )
        if _eager(codes) and not bool(jnp.all((codes >= 0) & (codes < elements.E8M0_NAN))):
            raise ValueError(f"{spec.name}: E8M0 scale codes must lie in [0, 254] (255 is NaN)")
        return _broadcast_to_scale(codes, layout, "scale", jnp.uint8), None
    _check_positive(scale, spec, "scale")
    scale = _broadcast_to_scale(scale, layout, "scale", jnp.float32)
    if spec.asymmetric_only:
        if zero_point is None:
            raise ValueError(
                f"{spec.name} is asymmetric: pass zero_point (float32, one per scale) as "
                "compute_scale_zero_point returns it"
            )
        zp = jnp.asarray(zero_point, jnp.float32)
        if _eager(zp) and not bool(jnp.all(jnp.isfinite(zp))):
            raise ValueError(f"{spec.name}: every zero_point must be finite")
        return scale, _broadcast_to_scale(zp, layout, "zero_point", jnp.float32)
    if zero_point is not None:
        qmax = int(spec.max_finite)
        zp = jnp.asarray(zero_point)
        if _eager(zp) and not bool(jnp.all((zp >= -qmax - 1) & (zp <= qmax))):
            raise ValueError(f"{spec.name}: zero_point must be an integer in [{-qmax - 1}, {qmax}]")
        zero_point = _broadcast_to_scale(zp, layout, "zero_point", jnp.int8)
    return scale, zero_point


# --- grouping and exact arithmetic -------------------------------------------------------


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


def _true_divide(numerator, denominator) -> jax.Array:
    """numerator / denominator, correctly rounded (IEEE) even under jit.

    XLA's algebraic simplifier rewrites a division by a broadcast (a constant such as
    qmax, or one scale per group) into a multiplication by its reciprocal, which is off
    by one ulp for about half of all inputs (21 / 7 gives 3.0000002). A divisor selected
    per element by a data-dependent predicate is no broadcast, so the division stays;
    where the numerator is NaN the quotient is NaN with either divisor, so the select
    changes no result, and it fuses into the division without materialising anything.
    """
    numerator = jnp.asarray(numerator, jnp.float32)
    denominator = jnp.asarray(denominator, jnp.float32)
    shape = jnp.broadcast_shapes(numerator.shape, denominator.shape)
    numerator = jnp.broadcast_to(numerator, shape)
    return numerator / jnp.where(jnp.isnan(numerator), jnp.float32(1.0), denominator)


def _amax(x: jax.Array, layout: Layout) -> jax.Array:
    return _group_reduce(jnp.abs(x), layout, jnp.max)  # NaN propagates, inf stays inf


def _usable(scale: jax.Array) -> jax.Array:
    return jnp.isfinite(scale) & (scale >= _TINY)


def _or_one(scale: jax.Array) -> jax.Array:
    return jnp.where(_usable(scale), scale, jnp.float32(1.0))


def _element_emax(spec: FormatSpec) -> int:
    """Exponent of the element format's largest power of two: 8 for E4M3, 2 for E2M1."""
    return math.floor(math.log2(spec.max_finite))


# --- step 1: scales, one function per family ------------------------------------------------


def _scales_float_or_symmetric_int(x, layout, amax):
    """fp8 and symmetric int: scale = amax / max_finite (448, 57344, 127 or 7) per group."""
    amax = _amax(x, layout) if amax is None else amax
    scale = _or_one(_true_divide(amax, layout.spec.max_finite))
    return jnp.where(jnp.isfinite(amax), scale, _NAN), None


def _scales_asymmetric_int(x, layout, amax, amin):
    """Asymmetric int: [lo, hi] = [min(x, 0), max(x, 0)] onto [qmin, qmax]; int8 zero point."""
    qmax = layout.spec.max_finite  # 127 or 7
    qmin = -qmax - 1
    lo = jnp.minimum(_group_reduce(x, layout, jnp.min) if amin is None else amin, 0.0)
    hi = jnp.maximum(_group_reduce(x, layout, jnp.max) if amax is None else amax, 0.0)
    bad = ~(jnp.isfinite(lo) & jnp.isfinite(hi))
    levels = qmax - qmin  # 255 or 15
    span = hi - lo
    # hi - lo overflows float32 only for |x| near 3.4e38; split the division there.
    scale = jnp.where(
        jnp.isfinite(span),
        _true_divide(span, levels),
        _true_divide(hi, levels) - _true_divide(lo, levels),
    )
    scale = _or_one(scale)
    lo = jnp.where(bad, 0.0, lo)
    zp = jnp.clip(jnp.round(qmin - _true_divide(lo, scale)), qmin, qmax)
    return jnp.where(bad, _NAN, scale), zp.astype(jnp.int8)


def _scales_int2(x, layout, amax, amin):
    """int2 (KIVI, Liu et al. 2024): [lo, hi] = [min(x), max(x)] of the group onto codes
    0..3, scale = (hi - lo) / 3, float32 zero point -lo / scale (0 need not be in range, so
    a channel of keys that is all positive keeps its 4 levels)."""
    lo = _group_reduce(x, layout, jnp.min) if amin is None else amin
    hi = _group_reduce(x, layout, jnp.max) if amax is None else amax
    bad = ~(jnp.isfinite(lo) & jnp.isfinite(hi))
    span = hi - lo
    scale = jnp.where(
        jnp.isfinite(span), _true_divide(span, 3.0), _true_divide(hi, 3.0) - _true_divide(lo, 3.0)
    )
    scale = _or_one(scale)
    zp = -_true_divide(jnp.where(bad, 0.0, lo), scale)
    return jnp.where(bad, _NAN, scale), zp


def _scales_mx(x, layout, amax):
    """OCP MX v1.0 section 6.3: X = 2^(floor(log2(amax)) - emax_elem), stored as its E8M0
    code floor(log2 amax) - emax + 127 clamped to [0, 254]; an all-zero block takes the
    lowest scale 2^-127 (log2(0) = -inf, clamped); 0xFF is NaN."""
    amax = _amax(x, layout) if amax is None else amax
    exponent = jnp.clip(elements.floor_log2(amax) - _element_emax(layout.spec), -127, 127)
    code = jnp.where(jnp.isfinite(amax), exponent + elements.E8M0_BIAS, elements.E8M0_NAN)
    return code.astype(jnp.uint8), None


def _scales_nvfp4(x, layout, amax, tensor_scale):
    """NVFP4: tensor scale G = amax_tensor / (448 * 6); block scale s = e4m3(amax_b / 6 / G).
    A zero tensor takes G = 1; a zero block s = 0. Non-finite data: G is NaN."""
    amax = _amax(x, layout) if amax is None else amax
    if tensor_scale is None:
        amax_tensor = jnp.max(amax)  # max over blocks = max |x|; NaN propagates
        stored = jnp.where(jnp.isfinite(amax_tensor), nvfp4_tensor_scale(amax_tensor), _NAN)
        tensor_scale = nvfp4_tensor_scale(amax_tensor)
    else:
        stored = tensor_scale
    target = _true_divide(_true_divide(amax, NVFP4_ELEMENT_MAX), tensor_scale)
    block = elements.saturating_cast(target, "float8_e4m3fn", NVFP4_SCALE_MAX)
    return NVFP4Scale(block, stored), None


def _scales_impl(x, layout: Layout, amax=None, amin=None, tensor_scale=None):
    x = x.astype(jnp.float32)
    family = layout.spec.family
    if family == "cast":
        return None, None
    if layout.spec.asymmetric_only:
        return _scales_int2(x, layout, amax, amin)
    if family == "float" or (family == "int" and layout.symmetric):
        return _scales_float_or_symmetric_int(x, layout, amax)
    if family == "int":
        return _scales_asymmetric_int(x, layout, amax, amin)
    if family == "mx":
        return _scales_mx(x, layout, amax)
    return _scales_nvfp4(x, layout, amax, tensor_scale)


# --- step 2: elements with given scales, one function per family ----------------------------


def _encode_elements(y, spec: FormatSpec):
    """Scaled float32 values -> stored elements (saturating; packed E2M1 for fp4)."""
    if spec.element_dtype == "float4_e2m1fn":
        return pack_nibbles(elements.encode_e2m1(y))
    return elements.saturating_cast(y, spec.element_dtype, spec.max_finite)


def _decode_elements(data, layout: Layout):
    if layout.spec.element_dtype == "float4_e2m1fn":
        return elements.decode_e2m1(unpack_nibbles(data, layout.shape[-1]))
    return data.astype(jnp.float32)


def _elements_float(x, layout, scale):
    """fp8: x / scale, saturated at +-max_finite, cast (round to nearest even)."""
    bad = _expand(jnp.isnan(scale), layout)
    y = jnp.where(bad, 0.0, _true_divide(x, _expand(scale, layout)))
    return elements.saturating_cast(y, layout.spec.element_dtype, layout.spec.max_finite)


def _elements_int(x, layout, scale, zero_point):
    """int8/int4: round half to even, add the zero point, clip, cast (and pack int4).
    int2: round(x / scale + zero_point) half to even, clipped to 0..3, four per byte."""
    spec = layout.spec
    if spec.asymmetric_only:
        q = jnp.round(_true_divide(x, _expand(scale, layout)) + _expand(zero_point, layout))
        q = jnp.where(_expand(jnp.isnan(scale), layout), 0.0, q)
        return _pack2_jit(jnp.clip(q, 0, spec.max_finite).astype(jnp.uint8))
    qmax = spec.max_finite  # 127 or 7
    # symmetric grids drop -128/-8 so that +-amax are both representable
    qmin = -qmax if zero_point is None else -qmax - 1
    q = jnp.round(_true_divide(x, _expand(scale, layout)))
    if zero_point is not None:
        q = q + _expand(zero_point, layout).astype(jnp.float32)
    q = jnp.where(_expand(jnp.isnan(scale), layout), 0.0, q)
    q = jnp.clip(q, qmin, qmax).astype(jnp.int8)
    return pack_nibbles(q.astype(jnp.uint8)) if spec.packed else q


def _elements_mx(x, layout, code):
    """x * 2^-(code - 127), exact; clipped to +-max_finite, encoded."""
    spec = layout.spec
    exponent = code.astype(jnp.int32) - elements.E8M0_BIAS
    # x * 2^-exponent in two exact steps when -exponent < -126 (code 254: 2^-127).
    inverse = elements.pow2(jnp.clip(-exponent, -126, 127))
    half = jnp.where(-exponent < -126, jnp.float32(0.5), jnp.float32(1.0))
    bad = _expand(code == elements.E8M0_NAN, layout)
    y = jnp.where(bad, 0.0, (x * _expand(inverse, layout)) * _expand(half, layout))
    return _encode_elements(jnp.clip(y, -spec.max_finite, spec.max_finite), spec)


def _elements_nvfp4(x, layout, scale: NVFP4Scale):
    """e2m1(x / (s * G)); a block with step 0 (or a NaN tensor scale) stores zeros."""
    step = _expand(scale.block.astype(jnp.float32) * scale.tensor, layout)
    safe_step = jnp.where(step > 0, step, 1.0)
    y = jnp.where(step > 0, _true_divide(x, safe_step), 0.0)
    return _encode_elements(y, layout.spec)


def _quantize_with_impl(x, layout: Layout, scale, zero_point) -> QArray:
    x = x.astype(jnp.float32)
    spec = layout.spec
    tensor_scale = None
    if spec.family == "cast":
        data = elements.saturating_cast(x, spec.element_dtype, spec.max_finite)
    elif spec.family == "float":
        data = _elements_float(x, layout, scale)
    elif spec.family == "int":
        data = _elements_int(x, layout, scale, zero_point)
    elif spec.family == "mx":
        data = _elements_mx(x, layout, scale)
    else:
        data = _elements_nvfp4(x, layout, scale)
        scale, tensor_scale = scale.block, scale.tensor
    return QArray(
        data, scale, zero_point, tensor_scale, layout.shape, spec.name, layout.axis,
        layout.group_size,
    )  # fmt: skip


def _quantize_impl(x, layout: Layout) -> QArray:
    scale, zero_point = _scales_impl(x, layout)
    return _quantize_with_impl(x, layout, scale, zero_point)


def _dequantize_impl(data, scale, zero_point, tensor_scale, layout: Layout):
    family = layout.spec.family
    if family == "cast":
        return data.astype(jnp.float32)
    if family == "float":
        return data.astype(jnp.float32) * _expand(scale, layout)
    if family == "int" and layout.spec.asymmetric_only:
        q = _unpack2_jit(data, layout.shape[-1]).astype(jnp.float32)
        return (q - _expand(zero_point, layout)) * _expand(scale, layout)
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
    step = scale.astype(jnp.float32) * tensor_scale  # same product as in _elements_nvfp4
    return values * _expand(step, layout)


_quantize_jit = jax.jit(_quantize_impl, static_argnums=1)
_scales_jit = jax.jit(_scales_impl, static_argnums=1)
_quantize_with_jit = jax.jit(_quantize_with_impl, static_argnums=1)
_dequantize_jit = jax.jit(_dequantize_impl, static_argnums=4)
