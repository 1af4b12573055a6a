"""The decoder's building blocks (Flax NNX) and the quantized matmul they share.

A weight is either a plain array or a `QArray`; both live in an `nnx.Param`, so the
quantized bytes are what the params tree holds and a format is part of the tree's
structure (a new format recompiles, a new value does not). Weight-only formats are
dequantized inside jit right before the matmul; W8A8 (Rule.activations) quantizes the
activations per token and multiplies the stored codes, rescaling the float32 product (W4A8:
int4 codes unpacked to the activations' 8-bit type first, exactly). A
static W8A8 weight (`StaticActQArray`) carries one calibrated activation scale instead, and
activations beyond it clip, as in serving engines' static input scales.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tenantq.model.config import ModelConfig
from tenantq.numerics import QArray, dequantize, quantize, quantize_with_scale_zero_point
from tenantq.numerics.packing import sign_extend_int4, unpack_nibbles


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False)
class StaticActQArray(QArray):
    """A W8A8 weight plus the static scale of its input activations: `act_scale`, float32
    shape (), one per tensor (x_codes = clip(round(x / act_scale))); counted in `nbytes`."""

    act_scale: jax.Array | None = None

    def tree_flatten(self):
        children, aux = super().tree_flatten()
        return (*children, self.act_scale), aux

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children[:4], *aux, act_scale=children[4])

    @classmethod
    def wrap(cls, q: QArray, act_scale) -> StaticActQArray:
        fields = {f.name: getattr(q, f.name) for f in dataclasses.fields(QArray)}
        return cls(**fields, act_scale=jnp.asarray(act_scale, jnp.float32).reshape(()))

    @classmethod
    def wrap_spec(cls, spec: QArray, act_scale_spec) -> StaticActQArray:
        """`spec` (a QArray of per-field sharding specs) as this node, for tree-prefix use."""
        fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(QArray)}
        return cls(**fields, act_scale=act_scale_spec)

    @property
    def nbytes(self) -> int:
        return super().nbytes + (0 if self.act_scale is None else int(self.act_scale.nbytes))


def param_value(p: nnx.Param):
    return p.get_value()


def _check_w8a8(path: str, w, contract_axis: int, activations: str | None) -> None:
    if activations is None:
        if getattr(w, "act_scale", None) is not None:
            raise ValueError(
                f"{path}: the weight carries a static activation scale but its plan runs it "
                "weight-only; quantize it under a plan whose rule sets activations"
            )
        return
    if not isinstance(w, QArray):
        raise ValueError(f"{path}: W8A8 needs a quantized weight, got a plain array")
    # W4A8: int4 groups along the contracted axis (a Linear's input, a tied head's hidden).
    grouped_w4 = w.fmt == "int4" and w.group_size is not None
    if w.axis != contract_axis or w.zero_point is not None or (w.group_size and not grouped_w4):
        raise ValueError(
            f"{path}: W8A8 needs one symmetric scale per output channel (axis "
            f"{contract_axis}, no groups); got axis={w.axis}, group_size={w.group_size}"
        )


def matmul(x: jax.Array, w, *, dtype, activations: str | None = None, transpose: bool = False):
    """x [..., in] @ w [in, out] (or w.T for a [out, in] weight), float32 accumulation.

    Returns float32. `w` may be a QArray; with `activations` ("int8" or "fp8_e4m3") the
    product runs on the low-precision codes of both operands (int4 weights as 8-bit codes):
    x is scaled per token, or by the weight's static `act_scale` (a `StaticActQArray`),
    clipping what lies beyond it.
    """
    contract = 1 if transpose else 0
    dims = (((x.ndim - 1,), (contract,)), ((), ()))
    if activations is not None:
        act_scale = getattr(w, "act_scale", None)
        if act_scale is None:
            xq = quantize(x.astype(jnp.float32), activations, axis=-1)  # one scale per token
        else:  # one static scale; round, then saturate at the format's range
            xq = quantize_with_scale_zero_point(
                x.astype(jnp.float32), activations, act_scale, axis=None
            )
        acc_type = jnp.int32 if activations == "int8" else jnp.float32
        wdata = w.data
        if w.fmt == "int4":  # W4A8: the packed nibbles as 8-bit codes (exact: -8..7)
            wdata = sign_extend_int4(unpack_nibbles(wdata, w.shape[-1])).astype(xq.data.dtype)
        if wdata.dtype != xq.data.dtype:  # e5m2 weights with e4m3 activations: exact upcast
            wdata = wdata.astype(jnp.bfloat16)
            xdata = xq.data.astype(jnp.bfloat16)
        else:
            xdata = xq.data
        if w.group_size is not None:  # W4A8 with groups along the input
            scale = w.scale
            if transpose:  # a tied head [out, in], groups along in: the product on its W^T
                wdata, scale = wdata.T, scale.T
            return _grouped_product(xdata, wdata, scale, w.group_size, acc_type) * xq.scale
        y = jax.lax.dot_general(xdata, wdata, dims, preferred_element_type=acc_type)
        w_scale = w.scale.reshape(-1)  # one per output channel
        return y.astype(jnp.float32) * xq.scale * w_scale
    wf = dequantize(w).astype(dtype) if isinstance(w, QArray) else w.astype(dtype)
    return jax.lax.dot_general(x.astype(dtype), wf, dims, preferred_element_type=jnp.float32)


def _grouped_product(xdata, wdata, w_scale, group, acc_type):
    """sum over groups g of (x codes_g . w codes_g) x w_scale_g, float32 [..., out], for
    codes [in, out] and scales [groups, out]: each group's partial sum is exact (int32, or
    float32 of fp8 x int4 codes), then rescaled. A partial last group is zero-padded (zeros
    add nothing to its sum). Leading axes are flattened first: one [M, G, g] x [G, g, out]
    dot (XLA:CPU ran the [B, 1, G, g] form of a decode step ~2x slower at 64 rows)."""
    lead = xdata.shape[:-1]
    xdata = xdata.reshape(-1, xdata.shape[-1])
    n_in = wdata.shape[0]
    groups = -(-n_in // group)
    pad = groups * group - n_in
    if pad:
        xdata = jnp.pad(xdata, [(0, 0)] * (xdata.ndim - 1) + [(0, pad)])
        wdata = jnp.pad(wdata, [(0, pad), (0, 0)])
    xg = xdata.reshape(*xdata.shape[:-1], groups, group)
    wg = wdata.reshape(groups, group, wdata.shape[-1])
    batch_axis = xg.ndim - 2
    dims = (((xg.ndim - 1,), (1,)), ((batch_axis,), (0,)))
    part = jax.lax.dot_general(xg, wg, dims, preferred_element_type=acc_type)  # [G, ..., out]
    scale = w_scale.astype(jnp.float32).reshape(groups, *([1] * (part.ndim - 2)), -1)
    return jnp.sum(part.astype(jnp.float32) * scale, axis=0).reshape(*lead, -1)


class Linear(nnx.Module):
    """y = x @ W (+ b), W stored [in, out] (plain or quantized), bias in full precision."""

    def __init__(self, path: str, weight, bias=None, *, dtype, activations: str | None = None):
        _check_w8a8(path, weight, 0, activations)
        self.path = path
        self.weight = nnx.Param(weight)
        self.bias = None if bias is None else nnx.Param(bias)
        self.dtype = dtype
        self.activations = activations

    def __call__(self, x: jax.Array) -> jax.Array:
        y = matmul(x, param_value(self.weight), dtype=self.dtype, activations=self.activations)
        if self.bias is not None:
            y = y + param_value(self.bias).astype(jnp.float32)
        return y.astype(self.dtype)


class Embedding(nnx.Module):
    """Token embedding [vocab, hidden]; a row gather dequantizes only the rows it reads.

    `attend` is the tied output head: logits = x @ E^T.
    """

    def __init__(self, weight, *, dtype, activations: str | None = None):
        _check_w8a8("embed", weight, 1, activations)
        self.weight = nnx.Param(weight)
        self.dtype = dtype
        self.activations = activations

    def __call__(self, ids: jax.Array) -> jax.Array:
        w = param_value(self.weight)
        flat = ids.reshape(-1)
        if isinstance(w, QArray):
            rows = QArray(
                w.data[flat],
                None if w.scale is None else _rows(w.scale, flat),
                None if w.zero_point is None else _rows(w.zero_point, flat),
                w.tensor_scale,
                (flat.shape[0], *w.shape[1:]),
                w.fmt,
                w.axis,
                w.group_size,
            )
            out = dequantize(rows)
        else:
            out = w[flat]
        return out.astype(self.dtype).reshape(*ids.shape, -1)

    def attend(self, x: jax.Array) -> jax.Array:
        w = param_value(self.weight)
        return matmul(x, w, dtype=self.dtype, activations=self.activations, transpose=True)


def _rows(scale: jax.Array, flat: jax.Array) -> jax.Array:
    # A per-tensor scale (leading dim 1) applies to every row; otherwise one row per token.
    return scale if scale.shape[0] == 1 else scale[flat]


class RMSNorm(nnx.Module):
    """x / rms(x) * w, reduced in float32 (Zhang & Sennrich 2019; Llama's RMSNorm)."""

    def __init__(self, weight, *, eps: float, dtype):
        self.weight = nnx.Param(weight)
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return xf.astype(self.dtype) * param_value(self.weight).astype(self.dtype)


# --- rotary position embedding -------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _inv_freq(head_dim: int, theta: float, scaling: tuple | None) -> np.ndarray:
    # RoFormer (Su et al. 2021): inv_freq_j = theta^(-2j/d), computed in float32 as HF does.
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)
    if scaling is None:
        return inv_freq
    cfg = dict(scaling)
    rope_type = cfg.get("rope_type", cfg.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type != "llama3":
        raise ValueError(f"rope_scaling type {rope_type!r} not supported; supported: llama3")
    # Llama 3.1 frequency scaling (Meta's llama-models reference, `apply_scaling`): long
    # wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    factor = float(cfg["factor"])
    low, high = float(cfg["low_freq_factor"]), float(cfg["high_freq_factor"])
    old_context = float(cfg["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    return _inv_freq(config.head_dim, config.rope_theta, config.rope_scaling_items)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate x [B, S, heads, d] by its positions [B, S] (HF's rotate_half layout:
    the first half of each head pairs with the second half)."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, S, d/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    xf = x.astype(jnp.float32)
    half = xf.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)
