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

from tenantq.cli._args import one_line_errors, positive_int

COLUMNS = (
    ("format", "format"),
    ("element_dtype", "element"),
    ("element_bits", "bits"),
    ("granularity", "block/group"),
    ("scale_dtype", "scale"),
    ("effective_bits", "bits/elem"),
    ("weight_nbytes", "weight bytes"),
)


# Checked with jax 0.10.2 on CPU: jit(x * y)(1e-40, 2) and jit(x * y)(tiny, 0.25) both give 0.
SUBNORMALS = """\
float32 subnormals (|x| < 2^-126 = 1.18e-38): XLA on CPU flushes them to zero, as inputs
and as results (JAX sets flush-to-zero / denormals-are-zero; jax-ml/jax#16200,
openxla/xla#35740; measured here). TPUs flush them too (jax-ml/jax#19689). XLA on NVIDIA
GPUs keeps them unless --xla_gpu_ftz=true (jax-ml/jax#19689). tenantq's quantizers never
store a subnormal float32 scale: a group whose amax / max_finite would be one is stored
with scale 1 (its elements round to 0); E8M0's 2^-127 is applied as 2^-1 * 2^-126. Subnormal
input elements still read as 0 on CPU and TPU but not on such a GPU."""

MAX_SIZE = 16384  # a 16384^2 float32 weight is 1 GiB; bits per element no longer change


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "formats",
        help="the number formats and their true storage cost",
        description="For each number format: element type and bits, block or group, scale "
        "type, and the measured bits per element of an N x N float32 weight quantized "
        "along axis 0 with the format's default group.",
        epilog=SUBNORMALS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print a JSON list of objects")
    p.add_argument(
        "--size",
        type=positive_int("a matrix side", maximum=MAX_SIZE),
        default=4096,
        help=f"side N of the square weight measured, 1 to {MAX_SIZE} (4096)",
    )
    return one_line_errors(p)


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

    if not isinstance(size, int) or not 0 < size <= MAX_SIZE:
        raise ValueError(f"--size must be an integer from 1 to {MAX_SIZE}, got {size!r}")
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
    from tenantq.model.terminal import text_table

    cells = [
        [f"{row[key]:.4f}" if isinstance(row[key], float) else str(row[key]) for key, _ in COLUMNS]
        for row in rows
    ]
    numeric = {"element_bits", "effective_bits", "weight_nbytes"}
    right = {i for i, (key, _) in enumerate(COLUMNS) if key in numeric}
    return "\n".join(text_table([title for _, title in COLUMNS], cells, right=right))


def run(args: argparse.Namespace) -> int:
    rows = format_rows(args.size)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        n = args.size
        print(f"{n}x{n} float32 weight, quantized along axis 0 (default group), true bytes:")
        print(render_table(rows))
    return 0
