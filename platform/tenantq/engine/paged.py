"""Device half of the paged KV pool: per-layer page arrays in the plan's formats, inside jit.

Each layer's keys and values live in pages of `page_tokens` tokens, in the format the plan's
KV part gives that layer, with their scales beside them. Writes quantize; `read` always
dequantizes from the pool (the fresh projections are never attended to directly). Tensors
scaled per channel wait in a bf16 residual page until the page fills; per-token tensors are
quantized at write time, and so are tensors with calibrated static (tensor/head) scales, which
clip at the format's range and count what they clip (`clip_counts`: elements clipped, tokens
written). The first `sink_tokens` tokens of quantized tensors keep a bf16 copy. Page/token
scales (and int2 zero points) are stored as the plan's `kv.scale_dtype` says; a write rounds
the scale to that dtype first and quantizes with the rounded scale, so what `read` multiplies
by is the scale the codes were made with.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from tenantq.numerics import (
    QArray,
    compute_scale_zero_point,
    dequantize,
    get_format,
    nvfp4_tensor_scale,
    quantize,
    quantize_with_scale_zero_point,
)
from tenantq.numerics.elements import e8m0_code_at_least, scale_by_e8m0
from tenantq.quant.plan import KVTensorSpec
from tenantq.storage.kv import LayerKVStorage, kv_quant_args

# A token-scaled nvfp4 page fixes its float32 tensor scale when its first tokens are written
# (later tokens cannot change it without requantizing the page): amax of those tokens times
# this headroom, so a later token up to 16x larger still fits the E4M3 block scales. E4M3
# keeps its 2^-3 relative step down to 2^-6, so the headroom costs no precision above that.
NVFP4_TOKEN_HEADROOM = 16.0


def _bits_dtype(dtype):
    """Storage dtype: 8/16-bit floats are held as their bit patterns (uint8/uint16), since
    XLA:CPU scatters into small float arrays by converting the whole array (~100x slower)."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
        return jnp.dtype(f"uint{8 * dtype.itemsize}")
    return dtype


def _to_bits(x):
    bits = _bits_dtype(x.dtype)
    return x if bits == x.dtype else jax.lax.bitcast_convert_type(x, bits)


def _from_bits(a, dtype):
    dtype = jnp.dtype(dtype)
    return a if a.dtype == dtype else jax.lax.bitcast_convert_type(a, dtype)


@dataclasses.dataclass(frozen=True)
class PagedLayout:
    """Static, hashable description of the pool; `CacheLayout` for the runner's step.

    `layers` is each layer's `LayerKVStorage` (formats, axes, page geometry, storage dtype:
    the description the capacity planner counts from); the arrays are allocated from it.
    The `table` a step receives is int32 [B, 2 + max_pages]: column 0 the sequence's slot
    (residual and sink buffers), column 1 its length after this step, then its block table.
    Padding rows carry slot `max_seqs` and page `num_pages` (out of range: never written).
    """

    num_pages: int
    max_seqs: int
    max_pages: int  # block-table width: pages one sequence may hold
    layers: tuple[LayerKVStorage, ...]
    dtype: str  # compute dtype of what `read` returns

    def __post_init__(self) -> None:
        geometry = {(s.page_tokens, s.kv_heads, s.head_dim, s.sink_tokens, s.store_dtype)
                    for s in self.layers}  # fmt: skip
        if len(geometry) != 1:
            raise ValueError(f"every layer of one pool shares its page geometry, got {geometry}")

    # ---------------------------------------------------------------- geometry (every layer's)
    @property
    def page_tokens(self) -> int:
        return self.layers[0].page_tokens

    @property
    def kv_heads(self) -> int:
        return self.layers[0].kv_heads

    @property
    def head_dim(self) -> int:
        return self.layers[0].head_dim

    @property
    def sink_tokens(self) -> int:
        return self.layers[0].sink_tokens

    @property
    def store_dtype(self) -> str:
        """Unquantized KV storage (bf16-format pages, residuals, sinks): bfloat16; float32
        in a float32 engine (the parity mode), so its cache adds no rounding of its own."""
        return self.layers[0].store_dtype

    # ---------------------------------------------------------------- state
    def page_struct(self, spec: KVTensorSpec) -> QArray:
        """Shapes/dtypes of one quantized page (a QArray of ShapeDtypeStructs)."""
        return _page_struct((self.page_tokens, self.kv_heads, self.head_dim), spec)

    def tensor_state(self, storage: LayerKVStorage, spec: KVTensorSpec) -> dict[str, jax.Array]:
        """Arrays of one tensor of one layer, as `storage.arrays` lists them; every array
        has the KV-head axis at index 2 (the per-page tensor scale, a per-tensor static scale
        and the clip counters have none: replicated). Static scales start at 1; the pool
        writes the calibrated ones."""
        out = {}
        struct = self.page_struct(spec) if spec.quantized else None
        for a in storage.arrays(spec):
            count = {"page": (self.num_pages,), "slot": (self.max_seqs,), "layer": ()}[a.per]
            shape = (*count, *a.shape)
            if struct is not None and a.name in ("pages", "scales"):
                real = struct.data if a.name == "pages" else struct.scale
                # a stored bf16/E8M0 scale replaces the codec's float32: same shape
                dtype = a.dtype if a.name == "pages" or spec.stored_scale_dtype in (
                    None, "float32") else real.dtype  # fmt: skip
                if (tuple(real.shape), jnp.dtype(real.dtype)) != (a.shape, jnp.dtype(dtype)):
                    raise AssertionError(
                        f"{spec.format} {a.name}: the quantizer stores {real.shape} "
                        f"{real.dtype}, the KV storage description says {a.shape} {a.dtype}"
                    )
            fill = jnp.ones if a.name in ("tensor_scale", "static_scale") else jnp.zeros
            out[a.name] = fill(shape, _bits_dtype(a.dtype))
        return out

    def init_state(self) -> tuple[dict[str, dict[str, jax.Array]], ...]:
        return tuple(
            {name: self.tensor_state(lay, spec) for name, spec in lay.tensors}
            for lay in self.layers
        )

    # ---------------------------------------------------------------- jit side
    def write(self, state, layer, table, positions, valid, keys, values):
        k_spec, v_spec = self.layers[layer].kv.keys, self.layers[layer].kv.values
        new = {
            "keys": self._write_tensor(state[layer]["keys"], k_spec, table, positions, valid, keys),
            "values": self._write_tensor(
                state[layer]["values"], v_spec, table, positions, valid, values
            ),
        }
        return state[:layer] + (new,) + state[layer + 1 :]

    def read(self, state, layer, table, kv_tokens):
        k_spec, v_spec = self.layers[layer].kv.keys, self.layers[layer].kv.values
        n_read = -(-kv_tokens // self.page_tokens)
        keys = self._read_tensor(state[layer]["keys"], k_spec, table, n_read)
        values = self._read_tensor(state[layer]["values"], v_spec, table, n_read)
        key_pos = jnp.broadcast_to(
            jnp.arange(n_read * self.page_tokens, dtype=jnp.int32), keys.shape[:2]
        )
        return keys, values, key_pos

    # ---------------------------------------------------------------- writes
    def _write_tensor(self, arrays, spec, table, positions, valid, x):
        p, n = self.page_tokens, self.num_pages
        slots, blocks = table[:, 0], table[:, 2:]
        x = x.astype(self.store_dtype)
        page_idx = jnp.clip(positions // p, 0, self.max_pages - 1)
        page = jnp.where(valid, jnp.take_along_axis(blocks, page_idx, axis=1), n)
        offset = positions % p
        arrays = dict(arrays)
        if spec.quantized and self.sink_tokens:
            at = jnp.where(valid & (positions < self.sink_tokens), positions, self.sink_tokens)
            rows = jnp.broadcast_to(slots[:, None], at.shape)
            arrays["sinks"] = arrays["sinks"].at[rows, at].set(_to_bits(x), mode="drop")
        if not spec.quantized:
            arrays["pages"] = arrays["pages"].at[page, offset].set(_to_bits(x), mode="drop")
        elif spec.static:
            arrays.update(self._write_static(arrays, spec, page, offset, valid, x))
        elif spec.needs_residual:
            arrays.update(self._write_channel(arrays, spec, table, positions, valid, x))
        else:
            arrays.update(self._write_token(arrays, spec, page, offset, valid, x))
        return arrays

    def _write_token(self, arrays, spec, page, offset, valid, x):
        """Per-token scales: quantize the new tokens now, scatter them into their pages."""
        x = x.astype(jnp.float32)
        out = {}
        if spec.format == "nvfp4":
            data, scale, tensor_scale = self._nvfp4_tokens(arrays, page, offset, valid, x)
            out["tensor_scale"] = tensor_scale
        else:
            q, scale, zero_point = _quantize_stored(x, spec, axis=-1)
            data = q.data
            if zero_point is not None:  # int2
                out["zero_points"] = (
                    arrays["zero_points"].at[page, offset].set(zero_point, mode="drop")
                )
        out["pages"] = arrays["pages"].at[page, offset].set(_to_bits(data), mode="drop")
        out["scales"] = arrays["scales"].at[page, offset].set(_to_bits(scale), mode="drop")
        return out

    def _static_scale(self, arrays):
        """The calibrated scale (and int2 zero point) as [1, 1, heads or 1, 1] float32."""
        scale = arrays["static_scale"].reshape(1, 1, -1, 1)
        zp = arrays.get("static_zero_point")
        return scale, None if zp is None else zp.reshape(1, 1, -1, 1)

    def _write_static(self, arrays, spec, page, offset, valid, x):
        """Static scales: quantize with the calibrated scale now, clip at the format's range
        and count the clipped elements of real tokens (|x| > scale * max_finite; for int2,
        x outside [(0 - zp) * scale, (3 - zp) * scale])."""
        fmt = get_format(spec.format)
        x = x.astype(jnp.float32)
        scale, zp = self._static_scale(arrays)
        if zp is None:
            over = jnp.abs(x) > scale * fmt.max_finite
        else:
            over = (x < (0.0 - zp) * scale) | (x > (fmt.max_finite - zp) * scale)
        real = valid[:, :, None, None]
        clipped = jnp.sum(over & real, dtype=jnp.int32)
        tokens = jnp.sum(valid, dtype=jnp.int32)
        q = quantize_with_scale_zero_point(
            x, spec.format, scale, zp, **kv_quant_args(spec, self.head_dim)
        )
        return {
            "pages": arrays["pages"].at[page, offset].set(_to_bits(q.data), mode="drop"),
            "clip_counts": arrays["clip_counts"] + jnp.stack([clipped, tokens]),
        }

    def _nvfp4_tokens(self, arrays, page, offset, valid, x):
        """nvfp4 per token with one tensor scale per page, fixed when the page is opened."""
        n = self.num_pages
        token_amax = jnp.where(valid, jnp.max(jnp.abs(x), axis=(2, 3)), 0.0)
        page_amax = jnp.zeros((n,), jnp.float32).at[page].max(token_amax, mode="drop")
        opens = (valid & (offset == 0)).astype(jnp.int32)
        opened = jnp.zeros((n,), jnp.int32).at[page].max(opens, mode="drop")
        fresh = nvfp4_tensor_scale(page_amax * NVFP4_TOKEN_HEADROOM)
        tensor_scale = jnp.where(opened > 0, fresh, arrays["tensor_scale"])
        g = tensor_scale[jnp.clip(page, 0, n - 1)][..., None, None]  # [B, S, 1, 1]
        scale, _ = compute_scale_zero_point(x, "nvfp4", axis=-1, tensor_scale=g)
        q = quantize_with_scale_zero_point(x, "nvfp4", scale, axis=-1)
        return q.data, q.scale, tensor_scale

    def _write_channel(self, arrays, spec, table, positions, valid, x):
        """Per-channel scales: assemble the touched pages (residual + new tokens); quantize
        those that are now full into the pool, keep the newest partial page as residual."""
        p, n = self.page_tokens, self.num_pages
        b, s = positions.shape
        slots, end, blocks = table[:, 0], table[:, 1], table[:, 2:]
        span = (s + p - 2) // p + 1  # pages a run of s tokens can touch
        start = positions[:, 0]
        base = (start // p) * p
        residual = arrays["residual"][jnp.clip(slots, 0, self.max_seqs - 1)]
        residual = _from_bits(residual, self.store_dtype).astype(jnp.float32)
        x = x.astype(jnp.float32)  # bf16 values, exactly
        window = jnp.zeros((b, span * p, *x.shape[2:]), jnp.float32)
        window = window.at[:, :p].set(residual)
        at = jnp.where(valid, positions - base[:, None], span * p)
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], at.shape)
        window = window.at[rows, at].set(x, mode="drop")
        pages = window.reshape(b * span, p, *x.shape[2:])
        q, scale, zero_point = jax.vmap(lambda page: _quantize_stored(page, spec, axis=0))(pages)
        j = jnp.arange(span)[None, :]
        full = base[:, None] + (j + 1) * p <= end[:, None]
        first = base[:, None] // p + j
        block = jnp.take_along_axis(blocks, jnp.clip(first, 0, self.max_pages - 1), axis=1)
        target = jnp.where(full, block, n).reshape(-1)
        out = {
            "pages": arrays["pages"].at[target].set(_to_bits(q.data), mode="drop"),
            "scales": arrays["scales"].at[target].set(_to_bits(scale), mode="drop"),
        }
        if zero_point is not None:  # int2
            out["zero_points"] = arrays["zero_points"].at[target].set(zero_point, mode="drop")
        if q.tensor_scale is not None:
            out["tensor_scale"] = arrays["tensor_scale"].at[target].set(q.tensor_scale, mode="drop")
        newest = jnp.clip((end - base) // p, 0, span - 1)
        kept = window.reshape(b, span, p, *x.shape[2:])[jnp.arange(b), newest]
        written = jnp.where(valid.any(axis=1), slots, self.max_seqs)
        kept = _to_bits(kept.astype(self.store_dtype))
        out["residual"] = arrays["residual"].at[written].set(kept, mode="drop")
        return out

    # ---------------------------------------------------------------- reads
    def _read_tensor(self, arrays, spec, table, n_read):
        p = self.page_tokens
        slots = jnp.clip(table[:, 0], 0, self.max_seqs - 1)
        end = table[:, 1]
        pages = jnp.clip(table[:, 2 : 2 + n_read], 0, self.num_pages - 1)  # [B, n_read]
        b = pages.shape[0]
        if spec.quantized:
            struct = self.page_struct(spec)
            ts = arrays.get("tensor_scale")
            zps = arrays.get("zero_points")
            if spec.static:
                scale, zp = self._static_scale(arrays)
                scale = jnp.broadcast_to(scale[0], struct.scale.shape)
                zp = None if zp is None else jnp.broadcast_to(zp[0], struct.scale.shape)

            def one_page(i):
                if spec.static:
                    page_scale, page_zp = scale, zp
                else:
                    page_scale = _load_scale(arrays["scales"][i], spec, struct.scale.dtype)
                    page_zp = None if zps is None else _load_scale(zps[i], spec, "float32")
                q = QArray(
                    _from_bits(arrays["pages"][i], struct.data.dtype), page_scale, page_zp,
                    None if ts is None else ts[i], struct.shape, struct.fmt, struct.axis,
                    struct.group_size,
                )  # fmt: skip
                return dequantize(q)

            values = jax.vmap(one_page)(pages.reshape(-1))
        else:
            values = _from_bits(arrays["pages"][pages.reshape(-1)], self.store_dtype)
        values = values.reshape(b, n_read * p, self.kv_heads, self.head_dim)
        values = values.astype(self.dtype)
        t = jnp.arange(n_read * p)
        if spec.needs_residual:
            residual = _from_bits(arrays["residual"][slots][:, t % p], self.store_dtype)
            residual = residual.astype(self.dtype)
            in_residual = t[None, :] >= ((end // p) * p)[:, None]
            values = jnp.where(in_residual[..., None, None], residual, values)
        if spec.quantized and self.sink_tokens:
            sinks = arrays["sinks"][slots][:, jnp.minimum(t, self.sink_tokens - 1)]
            sinks = _from_bits(sinks, self.store_dtype)
            in_sink = (t < self.sink_tokens)[None, :, None, None]
            values = jnp.where(in_sink, sinks.astype(self.dtype), values)
        return values


def _quantize_stored(x, spec: KVTensorSpec, *, axis: int):
    """`quantize(x, spec.format, axis=axis)` with the scale (and int2 zero point) rounded to
    the plan's scale dtype before the elements are made: (QArray, stored scale, stored zero
    point or None), stored as the pool holds them (bf16 as bit patterns, E8M0 as codes).

    bf16 rounds to nearest (relative error <= 2^-8); the int2 zero point is recomputed for
    the rounded scale (zp' = bf16(zp * s / s'), so it still marks the group's minimum).
    E8M0 rounds the scale up to a power of two (OCP MX v1.0 sec. 5.4.1), so no element clips
    and a step grows by less than 2x."""
    stored = spec.stored_scale_dtype
    if stored in (None, "float32"):
        q = quantize(x, spec.format, axis=axis)
        return q, q.scale, q.zero_point
    scale, zero_point = compute_scale_zero_point(x, spec.format, axis=axis)
    if stored == "bf16":
        kept = scale.astype(jnp.bfloat16)
        rounded = kept.astype(jnp.float32)
        stored_scale = _to_bits(kept)
        if zero_point is not None:
            zp = (zero_point * scale / rounded).astype(jnp.bfloat16)
            zero_point = zp.astype(jnp.float32)
            stored_zp = _to_bits(zp)
    else:  # e8m0 (symmetric formats only: the plan refuses it for int2)
        stored_scale = e8m0_code_at_least(scale)
        rounded = scale_by_e8m0(jnp.ones(scale.shape, jnp.float32), stored_scale)
    q = quantize_with_scale_zero_point(x, spec.format, rounded, zero_point, axis=axis)
    return q, stored_scale, None if zero_point is None else stored_zp


def _load_scale(stored, spec: KVTensorSpec, dtype):
    """A page's stored scales (or int2 zero points) as `dtype` values (`_quantize_stored`'s
    inverse): float32 as they are, bf16 from its bit pattern, E8M0 as 2^(code - 127)."""
    how = spec.stored_scale_dtype
    if how in (None, "float32"):
        return _from_bits(stored, dtype)
    if how == "bf16":
        return _from_bits(stored, jnp.bfloat16).astype(jnp.float32)
    return scale_by_e8m0(jnp.ones(stored.shape, jnp.float32), stored)


@functools.lru_cache(maxsize=256)
def _page_struct(shape: tuple[int, ...], spec: KVTensorSpec) -> QArray:
    page = jax.ShapeDtypeStruct(shape, "float32")
    args = kv_quant_args(spec, shape[-1])
    return jax.eval_shape(lambda x: quantize(x, spec.format, **args), page)


def layout_nbytes(state) -> list[dict[str, int]]:
    """Per layer: bytes of page data, page scales (int2 zero points included), residual
    windows, sinks and static scales (true sizes: packed data is already uint8, so every
    array's size times itemsize is its storage); static bytes include the clip counters."""

    def nbytes(a) -> int:
        return int(math.prod(a.shape)) * np.dtype(a.dtype).itemsize

    rows = []
    for per_layer in state:
        row = {"data_bytes": 0, "scale_bytes": 0, "residual_bytes": 0, "sink_bytes": 0}
        row["static_bytes"] = 0
        for arrays in per_layer.values():
            row["data_bytes"] += nbytes(arrays["pages"])
            for name in ("scales", "zero_points", "tensor_scale"):
                if name in arrays:
                    row["scale_bytes"] += nbytes(arrays[name])
            for name in ("static_scale", "static_zero_point", "clip_counts"):
                if name in arrays:
                    row["static_bytes"] += nbytes(arrays[name])
            row["residual_bytes"] += nbytes(arrays["residual"]) if "residual" in arrays else 0
            row["sink_bytes"] += nbytes(arrays["sinks"]) if "sinks" in arrays else 0
        rows.append(row)
    return rows
