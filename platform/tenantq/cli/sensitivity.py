"""`tenantq sensitivity`: KL cost of quantizing one tensor (or one layer's K or V) at a time.

Prints the layer x tensor-class matrix of mean KL (or, with --json, every row with its
CI) and writes the Arrow table as Parquet where --out says; the table is cached under
--cache-dir by (model identity, format, dataset hash), so a second run is a read.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pyarrow.parquet as pq

from tenantq.cli._args import cache_folder, output_file
from tenantq.model.files import CACHE_DIR


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "sensitivity",
        help="per-tensor KL sensitivity profile of a checkpoint",
        description="Quantize one tensor (or one block, or one layer's keys or values) at a "
        "time to FORMAT, everything else bf16, and measure KL against the bf16 model on a "
        "small fixed set of held-out windows, with a bootstrap CI. Units run in parallel "
        "over the local devices when there are several (one unit per device at a time).",
    )
    p.add_argument("--model", required=True, help="Hugging Face checkpoint folder")
    p.add_argument("--format", required=True, help="format to quantize each unit to (int4, ...)")
    p.add_argument("--kv", action="store_true", help="profile each layer's keys and values")
    p.add_argument(
        "--by", choices=("tensor", "block"), default="tensor",
        help="weight units: one tensor, or one layer's attention/MLP block (default tensor)",
    )  # fmt: skip
    p.add_argument(
        "--dataset", default="reference-test",
        help="held-out text: 'reference-test' (default) or a .txt/.jsonl/.parquet file",
    )  # fmt: skip
    p.add_argument("--rows", type=int, default=16, help="windows in the fixed set (16)")
    p.add_argument("--row-tokens", type=int, default=128, help="tokens per window (128)")
    p.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples (2000)")
    p.add_argument("--cache-dir", default=str(CACHE_DIR), help=f"cache folder ({CACHE_DIR})")
    p.add_argument("--out", help="also write the table to this .parquet file")
    p.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def run(args: argparse.Namespace) -> int:
    from tenantq.evals.sensitivity import matrix_text, profile

    model = Path(args.model)
    if not (model / "config.json").is_file():
        raise ValueError(f"--model {model}: no config.json there; pass a checkpoint folder")
    if args.rows < 2 or args.row_tokens < 2:
        raise ValueError("--rows and --row-tokens must be at least 2 (a CI needs two windows)")
    if args.resamples < 100:  # the suites' own floor (evals.suite.Suite.resamples)
        raise ValueError(
            f"--resamples must be at least 100 (a percentile CI needs them), got {args.resamples}"
        )
    # Checked before the profile runs (minutes): `.parquet`, as every reader of a profile
    # (`--profile`, a sensitivity space) reads other suffixes as Arrow IPC.
    out = output_file(args.out, "--out", ".parquet") if args.out else None
    cache_folder(args.cache_dir, "--cache-dir")
    table = profile(
        model, args.format, kv=args.kv, by=args.by, source=args.dataset, rows=args.rows,
        row_tokens=args.row_tokens, resamples=args.resamples, cache_dir=args.cache_dir,
        progress=not args.no_progress,
    )  # fmt: skip
    if out is not None:
        pq.write_table(table, out)
    if args.json:
        print(json.dumps(table.to_pylist(), indent=2))
        return 0
    what = "KV keys/values" if args.kv else f"weights by {args.by}"
    print(f"mean KL (nats/token) vs bf16, {what} in {args.format}, {args.rows} windows "
          f"x {args.row_tokens} tokens")  # fmt: skip
    print(matrix_text(table))
    top = sorted(table.to_pylist(), key=lambda r: -r["kl_mean"])[:5]
    print("most sensitive: " + ", ".join(
        f"{r['tensor']} {r['kl_mean']:.3g} [{r['kl_ci_low']:.3g}, {r['kl_ci_high']:.3g}]"
        for r in top))  # fmt: skip
    return 0
