"""Each layer's KV arrays on one chip: formats, axes, page geometry and storage dtype.

The engine's paged pool allocates from `LayerKVStorage.arrays`, and the capacity planner
counts bytes from the same description, so planner and engine agree to the byte by
construction. The storage dtype of unquantized KV (bf16 in serving, float32 in the parity
engine) is part of it. Pure Python: no JAX at import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tenantq.model.checks import check_positive_int
from tenantq.model.config import ModelConfig
from tenantq.quant.plan import KVTensorSpec, LayerKV, QuantPlan
from tenantq.storage.tp import kv_heads_per_chip


def kv_quant_args(spec: KVTensorSpec, head_dim: int) -> dict[str, Any]:
    """The codec's (axis, group_size) for one page [page_tokens, kv_heads, head_dim] of a KV
    tensor: channel reduces over the page's tokens, token over head_dim in the format's
    groups (int4 128, int2 32 as KIVI), static axes one group per (token, head) row, with
    the calibrated per-head/per-tensor scale broadcast into it."""
    if spec.static:
        return {"axis": -1, "group_size": head_dim}
    return {"axis": spec.axis_index}


# Unquantized KV (bf16-format pages, residual windows, sink copies) is stored in one of these.
KV_STORE_DTYPES = {"bfloat16": 2, "float32": 4}  # name -> bytes per element
_SCALE_DTYPES = {"float32": "float32", "e8m0": "uint8", "e4m3": "float8_e4m3fn"}
# A plan's `kv.scale_dtype` -> (stored dtype, bytes) of page/token scales and int2 zero points
# (E8M0 is held as its uint8 biased exponent, OCP Microscaling v1.0 sec. 5.4.1).
KV_SCALE_STORAGE = {"float32": ("float32", 4), "bf16": ("bfloat16", 2), "e8m0": ("uint8", 1)}


@dataclass(frozen=True)
class KVArray:
    """One array of one KV tensor: `shape` per page (per="page") or per sequence slot."""

    name: str  # pages | scales | zero_points | tensor_scale | static_scale | static_zero_point
    #            | residual | sinks
    per: str  # "page" | "slot" | "layer" (static: once per layer, whatever the pool's size)
    shape: tuple[int, ...]
    dtype: str  # logical dtype (the engine may hold 8/16-bit floats as their bit patterns)
    itemsize: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class LayerKVStorage:
    """One layer's KV storage on one chip: formats and axes, page geometry, storage dtype.

    A page holds keys `[page_tokens, kv_heads, head_dim]` and values of the same shape in the
    plan's formats (axis "channel": scales over the page's tokens, so the newest, partial
    page waits in a per-slot residual window of the storage dtype; "token": scales over
    head_dim, quantized at write time; "tensor"/"head": calibrated static scales held once
    per layer, `(1,)` or `(1, 1, kv_heads, 1)` so the head axis stays at index 2, and no
    scale bytes in the page). Page/token scales of fp8/int formats, and int2's zero point per
    scale, are stored as the plan's `kv.scale_dtype` says (float32, bf16 or E8M0); static
    scales and zero points are float32. A quantized tensor keeps an unquantized copy of its
    first `sink_tokens` tokens per slot. `arrays` is what the pool allocates; every byte
    figure is read from it.
    """

    layer: int
    kv: LayerKV
    page_tokens: int
    kv_heads: int  # on this chip
    head_dim: int
    sink_tokens: int
    store_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.store_dtype not in KV_STORE_DTYPES:
            raise ValueError(
                f"KV store dtype {self.store_dtype!r} is not modelled; valid: "
                f"{', '.join(KV_STORE_DTYPES)}"
            )
        for name in ("page_tokens", "kv_heads", "head_dim"):
            check_positive_int(name, getattr(self, name))

    @property
    def tensors(self) -> tuple[tuple[str, KVTensorSpec], tuple[str, KVTensorSpec]]:
        return (("keys", self.kv.keys), ("values", self.kv.values))

    @property
    def page_shape(self) -> tuple[int, int, int]:
        return (self.page_tokens, self.kv_heads, self.head_dim)

    def arrays(self, spec: KVTensorSpec) -> tuple[KVArray, ...]:
        """The arrays the pool holds for one tensor (keys or values) of this layer."""
        from tenantq.numerics import get_format, resolve_layout

        store = (self.store_dtype, KV_STORE_DTYPES[self.store_dtype])
        h, d = self.kv_heads, self.head_dim
        if not spec.quantized:
            return (KVArray("pages", "page", self.page_shape, *store),)
        fmt = get_format(spec.format)
        lay = resolve_layout(self.page_shape, fmt, **kv_quant_args(spec, d))
        data = ("uint8", 1) if fmt.packed else (fmt.element_dtype, fmt.element_bits // 8)
        out = [KVArray("pages", "page", lay.data_shape, *data)]
        if spec.static:
            shape = (1,) if spec.axis == "tensor" else (1, 1, h, 1)
            out.append(KVArray("static_scale", "layer", shape, "float32", 4))
            if fmt.asymmetric_only:
                out.append(KVArray("static_zero_point", "layer", shape, "float32", 4))
            # [elements clipped, tokens written] since the pool was built (replicated)
            out.append(KVArray("clip_counts", "layer", (2,), "int32", 4))
        elif lay.scale_shape is not None:
            stored = spec.stored_scale_dtype
            if stored is None:  # the format's own block scales (MX E8M0, nvfp4 E4M3)
                scale = (_SCALE_DTYPES[fmt.scale_dtype], fmt.scale_bytes)
            else:
                scale = KV_SCALE_STORAGE[stored]
            out.append(KVArray("scales", "page", lay.scale_shape, *scale))
            if fmt.asymmetric_only:  # int2: E8M0 is refused by the plan (symmetric only)
                out.append(KVArray("zero_points", "page", lay.scale_shape, *scale))
        if fmt.has_tensor_scale:
            out.append(KVArray("tensor_scale", "page", (), "float32", 4))
        if spec.needs_residual:
            out.append(KVArray("residual", "slot", self.page_shape, *store))
        if self.sink_tokens:
            out.append(KVArray("sinks", "slot", (self.sink_tokens, h, d), *store))
        return tuple(out)

    def byte_lines(self) -> tuple[str, ...]:
        """One line per array of this layer: what it holds and its bytes per page, per
        sequence slot or (static scales) per layer, e.g. "K scales: 1 per layer, 4 B, static"."""
        what = {
            "pages": "elements", "scales": "scales", "zero_points": "zero points",
            "tensor_scale": "tensor scale", "static_scale": "scales",
            "static_zero_point": "zero points", "clip_counts": "clip counters",
            "residual": "residual window",
            "sinks": "sink tokens",
        }  # fmt: skip
        out = []
        for name, spec in self.tensors:
            tag = "K" if name == "keys" else "V"
            for a in self.arrays(spec):
                count = math.prod(a.shape)
                if a.name == "clip_counts":
                    line = f"{tag} {what[a.name]}: 2 x 4 B (int32) = 8 B per layer, static"
                elif a.per == "layer":
                    unit = "layer" if spec.axis == "tensor" else "KV head per layer"
                    line = f"{tag} {what[a.name]}: 1 per {unit}, {a.nbytes:,} B, static"
                else:
                    per = "page" if a.per == "page" else "sequence slot"
                    line = (
                        f"{tag} {what[a.name]}: {count:,} x {a.itemsize} B ({a.dtype}) = "
                        f"{a.nbytes:,} B per {per}"
                    )
                out.append(line)
        return tuple(out)

    def _sum(self, names: tuple[str, ...]) -> int:
        return sum(a.nbytes for _, s in self.tensors for a in self.arrays(s) if a.name in names)

    @property
    def page_data_bytes(self) -> int:
        """Element bytes of one page, keys and values (packed nibbles as stored)."""
        return self._sum(("pages",))

    @property
    def page_scale_bytes(self) -> int:
        """Scale bytes of one page (block/group scales, int2 zero points, nvfp4's tensor
        scale)."""
        return self._sum(("scales", "zero_points", "tensor_scale"))

    @property
    def static_bytes(self) -> int:
        """Once per layer: static (tensor/head) scales, zero points and clip counters."""
        return self._sum(("static_scale", "static_zero_point", "clip_counts"))

    @property
    def page_bytes(self) -> int:
        return self.page_data_bytes + self.page_scale_bytes

    @property
    def residual_bytes(self) -> int:
        """Per sequence slot: the residual windows of per-channel quantized tensors."""
        return self._sum(("residual",))

    @property
    def sink_bytes(self) -> int:
        """Per sequence slot: the unquantized copy of the first tokens of quantized tensors."""
        return self._sum(("sinks",))

    @property
    def slot_bytes(self) -> int:
        return self.residual_bytes + self.sink_bytes

    def bytes_row(self, num_pages: int, num_slots: int) -> dict[str, Any]:
        """This layer's report row for a pool of `num_pages` pages and `num_slots` slots."""
        return layer_bytes_row(
            self,
            num_pages,
            data_bytes=num_pages * self.page_data_bytes,
            scale_bytes=num_pages * self.page_scale_bytes,
            residual_bytes=num_slots * self.residual_bytes,
            sink_bytes=num_slots * self.sink_bytes,
            static_bytes=self.static_bytes,
        )


def layer_bytes_row(
    layer: LayerKVStorage,
    num_pages: int,
    *,
    data_bytes: int,
    scale_bytes: int,
    residual_bytes: int,
    sink_bytes: int,
    static_bytes: int = 0,
) -> dict[str, Any]:
    """The one per-layer KV report row (planner: counted; engine: read from its arrays)."""
    pages_bytes = data_bytes + scale_bytes
    return {
        "layer": layer.layer,
        "key_format": layer.kv.key_format,
        "key_axis": layer.kv.key_axis,
        "value_format": layer.kv.value_format,
        "value_axis": layer.kv.value_axis,
        "pages": num_pages,
        "page_bytes": layer.page_bytes,
        "data_bytes": data_bytes,
        "scale_bytes": scale_bytes,
        "pages_bytes": pages_bytes,
        "residual_bytes": residual_bytes,
        "sink_bytes": sink_bytes,
        "static_bytes": static_bytes,
        "total_bytes": pages_bytes + residual_bytes + sink_bytes + static_bytes,
    }


def kv_storage(
    config: ModelConfig,
    plan: QuantPlan,
    page_tokens: int,
    tp: int = 1,
    *,
    store_dtype: str = "bfloat16",
) -> tuple[LayerKVStorage, ...]:
    """Every layer's KV storage on one of `tp` chips (the KV heads are split across chips)."""
    check_positive_int("page_tokens", page_tokens)
    heads = kv_heads_per_chip(config, tp)
    return tuple(
        LayerKVStorage(
            layer=i,
            kv=kv,
            page_tokens=page_tokens,
            kv_heads=heads,
            head_dim=config.head_dim,
            sink_tokens=plan.kv.sink_tokens,
            store_dtype=store_dtype,
        )
        for i, kv in enumerate(plan.kv_layers(config))
    )
