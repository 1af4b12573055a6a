"""What the engine holds in memory, tensor by tensor, counted as true storage bytes.

A quantized tensor counts `QArray.nbytes` (packed elements, scales, zero points); a plain
array counts elements times its dtype's itemsize. The capacity planner's arithmetic must
equal these figures byte for byte, so they are read from the arrays, not recomputed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from tenantq.numerics import QArray

_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes per weight tensor (by path; `weight_parts` splits data/scale/zero point/tensor
    scale), each tensor's format, the KV cache's bytes, and for the paged pool one row per
    layer (formats, data, scale, residual and sink bytes: `PagedPool.kv_report`)."""

    weight_bytes: dict[str, int]
    weight_formats: dict[str, str]
    cache_bytes: int
    weight_parts: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    kv_layers: tuple[dict[str, Any], ...] = ()

    @property
    def total_weight_bytes(self) -> int:
        return sum(self.weight_bytes.values())

    @property
    def total_bytes(self) -> int:
        return self.total_weight_bytes + self.cache_bytes

    def __str__(self) -> str:
        """A short table: weight bytes by format, then one line per KV layer."""
        by_format: dict[str, list[int]] = {}
        for path, nbytes in self.weight_bytes.items():
            entry = by_format.setdefault(self.weight_formats[path], [0, 0])
            entry[0] += 1
            entry[1] += nbytes
        lines = [f"weights {self.total_weight_bytes:,} B"]
        for fmt, (count, nbytes) in sorted(by_format.items(), key=lambda kv: -kv[1][1]):
            lines.append(f"  {fmt:<9} {count:>5} tensors {nbytes:>16,} B")
        lines.append(f"KV cache {self.cache_bytes:,} B")
        for row in self.kv_layers:
            formats = f"K {row.get('key_format', '?')} V {row.get('value_format', '?')}"
            lines.append(
                f"  layer {row.get('layer', '?'):>3} {formats:<24}"
                f" pages {row['pages_bytes']:>12,} B"
                f"  residual {row['residual_bytes']:>10,} B  sinks {row['sink_bytes']:>10,} B"
                + (f"  static {row['static_bytes']:,} B" if row.get("static_bytes") else "")
            )
        lines.append(f"total {self.total_bytes:,} B")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "weight_bytes": dict(self.weight_bytes),
            "weight_formats": dict(self.weight_formats),
            "total_weight_bytes": self.total_weight_bytes,
            "cache_bytes": self.cache_bytes,
            "weight_parts": {p: dict(v) for p, v in self.weight_parts.items()},
            "kv_layers": [dict(r) for r in self.kv_layers],
        }


def tensor_nbytes(value: Any) -> int:
    if isinstance(value, QArray):
        return value.nbytes
    return int(np.prod(value.shape, dtype=np.int64)) * np.dtype(value.dtype).itemsize


def tensor_format(value: Any) -> str:
    if isinstance(value, QArray):
        return value.fmt
    name = np.dtype(value.dtype).name
    return _DTYPE_NAMES.get(name, name)


def tensor_parts(value: Any) -> dict[str, int]:
    """True bytes of each stored part: data, scale, zero_point, tensor_scale (0 if absent)."""
    if not isinstance(value, QArray):
        return {"data": tensor_nbytes(value), "scale": 0, "zero_point": 0, "tensor_scale": 0}
    parts = {"data": value.data, "scale": value.scale, "zero_point": value.zero_point}
    parts["tensor_scale"] = value.tensor_scale
    return {k: 0 if a is None else tensor_nbytes(a) for k, a in parts.items()}


def memory_report(params: Mapping[str, Any], cache_bytes: int, kv_layers=()) -> MemoryReport:
    return MemoryReport(
        weight_bytes={p: tensor_nbytes(v) for p, v in params.items()},
        weight_formats={p: tensor_format(v) for p, v in params.items()},
        cache_bytes=int(cache_bytes),
        weight_parts={p: tensor_parts(v) for p, v in params.items()},
        kv_layers=tuple(kv_layers),
    )
