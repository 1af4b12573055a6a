"""tenantq.numerics: the number formats tenantq stores tensors in.

Specs (`FORMATS`, `get_format`), `quantize`/`dequantize` into a `QArray` pytree, the
4-bit packing every packed format shares, and exact storage byte counts
(`storage_nbytes`, `effective_bits`) that the capacity planner uses without arrays.
"""

from tenantq.numerics.formats import FORMATS, FormatSpec, get_format
from tenantq.numerics.layout import Layout, effective_bits, resolve_layout, storage_nbytes
from tenantq.numerics.packing import pack_fp4, pack_int4, unpack_fp4, unpack_int4
from tenantq.numerics.qarray import QArray
from tenantq.numerics.quantize import dequantize, layout_of, quantize, scale_float32

__all__ = [
    "FORMATS",
    "FormatSpec",
    "Layout",
    "QArray",
    "dequantize",
    "effective_bits",
    "get_format",
    "layout_of",
    "pack_fp4",
    "pack_int4",
    "quantize",
    "resolve_layout",
    "scale_float32",
    "storage_nbytes",
    "unpack_fp4",
    "unpack_int4",
]
