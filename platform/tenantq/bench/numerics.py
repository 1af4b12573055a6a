"""`python -m tenantq.bench numerics`: quantize + dequantize throughput of every format.

Each format's round trip on an N x N float32 matrix runs under jax.jit: compiled first
(compile time reported on its own), then timed over several repeats with
block_until_ready, median taken. The reference is a plain bf16 cast round trip timed in
the same run, so the "x bf16" ratio survives a change of machine better than GB/s does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

BASELINE = "bf16 cast"


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tenantq.bench numerics",
        description="quantize+dequantize throughput per format, relative to a bf16 cast",
    )
    parser.add_argument("--size", type=int, default=4096, help="matrix side N (4096)")
    parser.add_argument("--repeats", type=int, default=10, help="timed repeats (10)")
    parser.add_argument("--axis", type=int, default=0, help="quantization axis (0: weights)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    if args.size <= 0 or args.repeats <= 0:
        parser.error("--size and --repeats must be positive")
    return args


def _time_round_trip(fn, x, repeats: int) -> tuple[float, list[float]]:
    """Compile seconds, then `repeats` wall times in seconds of the compiled call."""
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(x).compile()
    compile_s = time.perf_counter() - start
    compiled(x).block_until_ready()  # warm-up: first execution allocates buffers
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        compiled(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return compile_s, times


def measure(size: int, repeats: int, axis: int) -> list[dict]:
    from tenantq.numerics import FORMATS, dequantize, quantize

    x = jnp.asarray(np.random.default_rng(0).standard_normal((size, size), dtype=np.float32))
    input_gb = x.size * 4 / 1e9
    cases = [(BASELINE, lambda v: v.astype(jnp.bfloat16).astype(jnp.float32))]
    for name in FORMATS:
        cases.append((name, lambda v, name=name: dequantize(quantize(v, name, axis=axis))))
    rows = []
    for name, fn in cases:
        compile_s, times = _time_round_trip(fn, x, repeats)
        median_s = statistics.median(times)
        rows.append(
            {
                "format": name,
                "compile_s": compile_s,
                "median_s": median_s,
                "min_s": min(times),
                "gb_per_s": input_gb / median_s,
            }
        )
    baseline_s = rows[0]["median_s"]
    for row in rows:
        row["time_vs_bf16_cast"] = row["median_s"] / baseline_s
    return rows


def render(rows: list[dict], header: str) -> str:
    lines = [header, f"{'format':<10} {'compile s':>9} {'median ms':>10} {'GB/s':>8} {'x bf16':>7}"]
    for row in rows:
        lines.append(
            f"{row['format']:<10} {row['compile_s']:>9.2f} {row['median_s'] * 1e3:>10.2f} "
            f"{row['gb_per_s']:>8.2f} {row['time_vs_bf16_cast']:>7.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    rows = measure(args.size, args.repeats, args.axis)
    device = jax.devices()[0]
    meta = {
        "size": args.size,
        "repeats": args.repeats,
        "axis": args.axis,
        "device": f"{device.platform}:{device.device_kind}",
        "jax": jax.__version__,
    }
    if args.json:
        print(json.dumps({"meta": meta, "rows": rows}, indent=2))
    else:
        header = (
            f"quantize+dequantize of a {args.size}x{args.size} float32 matrix (axis "
            f"{args.axis}) on {meta['device']}, median of {args.repeats}; GB/s of float32 "
            f"input; x bf16 = time / time of a bf16 cast round trip"
        )
        print(render(rows, header))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
