"""tenantq.numerics: the number formats tenantq stores tensors in.

Specs (`FORMATS`, `get_format`), `quantize`/`dequantize` into a `QArray` pytree (and
its two steps, `compute_scale_zero_point` then `quantize_with_scale_zero_point`), the
4-bit packing every packed format shares, and exact storage byte counts
(`storage_nbytes`, `effective_bits`) that the capacity planner uses without arrays. The
specs and byte counts are pure Python; the JAX-side names load on first use, so the
planner (and a driver without accelerator libraries) never imports JAX.
"""

from __future__ import annotations

import importlib
from typing import Any

from tenantq.numerics.formats import FORMATS, FormatSpec, get_format
from tenantq.numerics.layout import Layout, effective_bits, resolve_layout, storage_nbytes

_LAZY = {
    "pack_fp4": "tenantq.numerics.packing",
    "pack_int4": "tenantq.numerics.packing",
    "unpack_fp4": "tenantq.numerics.packing",
    "unpack_int4": "tenantq.numerics.packing",
    "QArray": "tenantq.numerics.qarray",
    "NVFP4Scale": "tenantq.numerics.codec",
    "compute_scale_zero_point": "tenantq.numerics.codec",
    "dequantize": "tenantq.numerics.codec",
    "layout_of": "tenantq.numerics.codec",
    "nvfp4_tensor_scale": "tenantq.numerics.codec",
    "quantize": "tenantq.numerics.codec",
    "quantize_with_scale_zero_point": "tenantq.numerics.codec",
    "scale_float32": "tenantq.numerics.codec",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tenantq.numerics' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "FORMATS",
    "FormatSpec",
    "Layout",
    "NVFP4Scale",
    "QArray",
    "compute_scale_zero_point",
    "dequantize",
    "effective_bits",
    "get_format",
    "layout_of",
    "nvfp4_tensor_scale",
    "pack_fp4",
    "pack_int4",
    "quantize",
    "quantize_with_scale_zero_point",
    "resolve_layout",
    "scale_float32",
    "storage_nbytes",
    "unpack_fp4",
    "unpack_int4",
]
