"""`python -m tenantq.bench load`: what the loader's NaN/inf check costs a checkpoint load.

A random Llama-shaped checkpoint (155.7M params by default, written once under --dir) is
loaded from the page cache three ways, each load in a fresh Python process (as a user's
load is: a fresh allocator, pages not yet mapped), alternating, best of --repeats each:
- the plain memory-map load the loader used before the check (`jnp.asarray` of each
  mapped tensor, no check): the baseline;
- the check in line: each tensor checked in cache-sized blocks (`read_tensor`) on the
  loading thread, then copied (the loader before the check moved to a worker thread);
- `load_params` as shipped: the same checks on a worker thread running ahead of the copies.
Wall and CPU seconds (user + system of the loading process, all its threads, measured
inside it) are both reported; CPU seconds are the steadier figure when other jobs share
the machine, and wall seconds gain from the worker thread only when a second core is idle.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

SMOKE_ENV = "TENANTQ_BENCH_SMOKE"
DEFAULT_DIR = Path(".tenantq-cache") / "bench-load"


def _parse(argv: list[str]) -> argparse.Namespace:
    smoke = os.environ.get(SMOKE_ENV, "") not in ("", "0")
    parser = argparse.ArgumentParser(
        prog="python -m tenantq.bench load",
        description="checkpoint load time with and without the NaN/inf check",
    )
    parser.add_argument("--hidden", type=int, default=128 if smoke else 1024)
    parser.add_argument("--layers", type=int, default=2 if smoke else 8)
    parser.add_argument("--vocab", type=int, default=1024 if smoke else 32000)
    parser.add_argument("--dtype", default="bfloat16", help="dtype loaded into (bfloat16)")
    parser.add_argument("--repeats", type=int, default=2 if smoke else 7)
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"({DEFAULT_DIR})")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    for name in ("hidden", "layers", "vocab", "repeats"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be positive, got {getattr(args, name)}")
    if args.hidden % 64:
        parser.error(f"--hidden must be a multiple of 64 (head_dim 64), got {args.hidden}")
    if args.dtype not in ("bfloat16", "float32"):
        parser.error(f"--dtype must be bfloat16 or float32, got {args.dtype!r}")
    return args


def _checkpoint(args: argparse.Namespace):
    """The random bf16 checkpoint for these sizes (written once; reused from --dir)."""
    import ml_dtypes
    from safetensors.numpy import save_file

    from tenantq.model.config import ModelConfig
    from tenantq.model.loader import hf_names

    config = ModelConfig(
        model_type="llama",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4 // 64 * 64,
        num_layers=args.layers,
        num_heads=args.hidden // 64,
        num_kv_heads=max(1, args.hidden // 256),
        head_dim=64,
        max_position_embeddings=2048,
    )
    folder = args.dir / f"h{args.hidden}-l{args.layers}-v{args.vocab}"
    if not (folder / "config.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(0)
        tensors = {}
        for path, (name, transpose) in hf_names(config).items():
            shape = config.tensors()[path].shape
            shape = tuple(reversed(shape)) if transpose else shape
            values = rng.standard_normal(shape, dtype=np.float32) * 0.02
            tensors[name] = values.astype(ml_dtypes.bfloat16)
        save_file(tensors, str(folder / "model.safetensors"))
        # config.json last: its presence marks a complete checkpoint
        (folder / "config.json").write_text(json.dumps(config.to_hf_dict()))
    return folder, config


def _mapped_load(folder: Path, config, dtype: str, *, check: bool) -> dict[str, Any]:
    """Each mapped tensor handed to jnp.asarray on this thread; with `check`, after
    `read_tensor` checked it here (no worker thread). Without: the loader before the check."""
    import jax.numpy as jnp

    from tenantq.model.loader import checkpoint_files, hf_names, map_tensor, read_tensor
    from tenantq.model.safetensors_header import SafetensorsHeader

    files = checkpoint_files(folder)
    headers = {f: SafetensorsHeader.read(f) for f in set(files.values())}
    out = {}
    for path, (name, transpose) in hf_names(config).items():
        header = headers[files[name]]
        array = map_tensor(header, header.entries[name])
        if check:
            array = read_tensor(array, name, transpose)
        elif transpose:
            array = array.T
        out[path] = jnp.asarray(array, dtype=jnp.dtype(dtype))
    return out


def _one_load(folder: Path, variant: str, dtype: str) -> dict[str, float]:
    """One load in this process: seconds of wall and CPU time."""
    import tenantq.model.decoder  # noqa: F401  (imported by load_params: not part of the load)
    from tenantq.model import loader
    from tenantq.model.config import ModelConfig

    config = ModelConfig.from_file(folder / "config.json")
    wall0, cpu0 = time.perf_counter(), time.process_time()
    if variant == "shipped":
        params = loader.load_params(folder, config, dtype=dtype)
    else:
        params = _mapped_load(folder, config, dtype, check=variant == "inline")
    jax.block_until_ready(list(params.values()))
    return {"wall_s": time.perf_counter() - wall0, "cpu_s": time.process_time() - cpu0}


VARIANTS = {
    "plain (before the check)": "plain",
    "check in line": "inline",
    "shipped (check on thread)": "shipped",
}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    folder, config = _checkpoint(args)
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    best = {name: [float("inf"), float("inf")] for name in VARIANTS}
    for _ in range(args.repeats):
        for name, variant in VARIANTS.items():
            out = subprocess.run(
                [sys.executable, "-m", "tenantq.bench.load", "--one", variant,
                 "--dir", str(folder), "--dtype", args.dtype],
                capture_output=True, text=True, env=env, check=True,
            )  # fmt: skip
            one = json.loads(out.stdout.strip().splitlines()[-1])
            best[name] = [min(best[name][0], one["wall_s"]), min(best[name][1], one["cpu_s"])]
    base_wall, base_cpu = best["plain (before the check)"]
    rows = [
        {
            "variant": name,
            "wall_s": round(wall, 4),
            "cpu_s": round(cpu, 4),
            "wall_vs_plain": round(wall / base_wall, 3),
            "cpu_vs_plain": round(cpu / base_cpu, 3),
        }
        for name, (wall, cpu) in best.items()
    ]
    return {
        "params": config.param_count(),
        "file_bytes": (folder / "model.safetensors").stat().st_size,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "load_average": round(os.getloadavg()[0], 2),
        "rows": rows,
        "check_cost_wall": rows[-1]["wall_vs_plain"],
        "check_cost_cpu": rows[-1]["cpu_vs_plain"],
    }


def main(argv: list[str]) -> int:
    if argv[:1] == ["--one"]:  # a child process: one load, one JSON line
        folder = Path(argv[argv.index("--dir") + 1])
        print(json.dumps(_one_load(folder, argv[1], argv[argv.index("--dtype") + 1])))
        return 0
    args = _parse(argv)
    report = measure(args)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"{report['params'] / 1e6:.1f}M params, {report['file_bytes'] / 2**20:.0f} MiB bf16 "
        f"file -> {report['dtype']}; best of {report['repeats']}; "
        f"load average {report['load_average']}"
    )
    print(f"{'variant':<26} {'wall s':>8} {'cpu s':>8} {'wall/plain':>11} {'cpu/plain':>10}")
    for r in report["rows"]:
        print(
            f"{r['variant']:<26} {r['wall_s']:>8.4f} {r['cpu_s']:>8.4f} "
            f"{r['wall_vs_plain']:>11.3f} {r['cpu_vs_plain']:>10.3f}"
        )
    print(
        f"load with the check: x{report['check_cost_wall']:.3f} wall, "
        f"x{report['check_cost_cpu']:.3f} CPU of the plain load"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
