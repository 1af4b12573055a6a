"""`tenantq formats`: every number format, what it stores, and what a weight costs in it.

The bits-per-element column is measured, not typed in: a random square weight (4096 by
default) is quantized per output channel (axis=0, the format's default group) and its
real `QArray.nbytes` is divided by the element count, so the table shows what a server
would hold, scales and packing included.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

COLUMNS = (
    ("format", "format"),
    ("element_dtype", "element"),
    ("element_bits", "bits"),
    ("granularity", "block/group"),
    ("scale_dtype", "scale"),
    ("effective_bits", "bits/elem"),
    ("weight_nbytes", "weight bytes"),
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "formats",
        help="the number formats and their true storage cost",
        description="For each number format: element type and bits, block or group, scale "
        "type, and the measured bits per element of an N x N float32 weight quantized "
        "along axis 0 with the format's default group.",
    )
    p.add_argument("--json", action="store_true", help="print a JSON list of objects")
    p.add_argument(
        "--size", type=int, default=4096, help="side N of the square weight measured (4096)"
    )
    return p


def _granularity(spec, q) -> str:
    if spec.scale_dtype is None:
        return "none (cast)"
    kind = "block" if spec.block_size else "group"
    if q.group_size is None:
        return f"per channel (axis {q.axis})"
    extra = " + tensor" if spec.has_tensor_scale else ""
    return f"{kind} {q.group_size} (axis {q.axis}){extra}"


def format_rows(size: int) -> list[dict]:
    """One row per format, measured on a random size x size float32 weight."""
    from tenantq.numerics import FORMATS, quantize

    if size <= 0:
        raise ValueError(f"--size must be a positive int, got {size}")
    weight = np.random.default_rng(0).standard_normal((size, size), dtype=np.float32)
    rows = []
    for name, spec in FORMATS.items():
        q = quantize(weight, name, axis=0)
        rows.append(
            {
                "format": name,
                "element_dtype": spec.element_dtype,
                "element_bits": spec.element_bits,
                "block_size": spec.block_size,
                "group_size": q.group_size,
                "granularity": _granularity(spec, q),
                "scale_dtype": spec.scale_dtype or "-",
                "tensor_scale": spec.has_tensor_scale,
                "weight_shape": [size, size],
                "weight_nbytes": q.nbytes,
                "effective_bits": 8.0 * q.nbytes / weight.size,
            }
        )
    return rows


def render_table(rows: list[dict]) -> str:
    cells = [[title for _, title in COLUMNS]]
    for row in rows:
        line = []
        for key, _ in COLUMNS:
            value = row[key]
            line.append(f"{value:.4f}" if isinstance(value, float) else str(value))
        cells.append(line)
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    numeric = {"element_bits", "effective_bits", "weight_nbytes"}
    out = []
    for line in cells:
        parts = [
            cell.rjust(width) if key in numeric else cell.ljust(width)
            for cell, width, (key, _) in zip(line, widths, COLUMNS, strict=True)
        ]
        out.append("  ".join(parts).rstrip())
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    rows = format_rows(args.size)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        n = args.size
        print(f"{n}x{n} float32 weight, quantized along axis 0 (default group), true bytes:")
        print(render_table(rows))
    return 0
