"""`python -m tenantq.bench engine`: prefill and decode throughput per weight format.

Every format runs in the same process on the same prompts, so its figures are reported
as ratios to bf16 measured in this run; compile time is reported apart (the engine's
stats separate it). The shipped reference model is used unless `--model` names another.
On CPU, weight-only formats pay for dequantizing inside the matmul and are expected to
trail bf16; the ratio that matters is the one on the target device. The KV part decodes
with bf16 weights and each KV format at given contexts (half the model's context and all
of it by default): an untimed prefill of random tokens fills the pool, then timed greedy
decode steps read every page back, dequantized, as serving would. Everything goes through
the engine's public calls. `TENANTQ_BENCH_SMOKE=1` shrinks the defaults to a tiny random
model and a few steps (the test suite's smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from tenantq.engine import Engine

FORMATS = ("bf16", "fp8_e4m3", "int8", "int4", "mxfp4", "nvfp4")
KV_FORMATS = ("bf16", "fp8_e4m3", "int8", "int4", "mxfp4", "nvfp4")
SMOKE_ENV = "TENANTQ_BENCH_SMOKE"
# Defaults, and the smoke run's (a tiny random model, one short point per format).
DEFAULTS = dict(formats=",".join(FORMATS), batch_sizes="1,16", prompt_tokens=128,
                decode_tokens=32, repeats=2, kv_formats=",".join(KV_FORMATS),
                kv_decode_tokens=8)  # fmt: skip
SMOKE_DEFAULTS = dict(formats="int4", batch_sizes="1", prompt_tokens=8, decode_tokens=2,
                      repeats=1, kv_formats="int4", kv_decode_tokens=2)  # fmt: skip


def _plan(fmt: str):
    from tenantq.quant.plan import QuantPlan, Rule

    if fmt == "bf16":
        return QuantPlan()
    return QuantPlan(rules=(Rule(".*", fmt, group_size=128 if fmt == "int4" else None),))


def measure(engine, batch: int, prompt_tokens: int, decode_tokens: int, repeats: int, seed: int):
    """(prefill tokens/s, decode tokens/s, compile s) of greedy generation at `batch`."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(3, engine.config.vocab_size, (batch, prompt_tokens)).tolist()
    engine.stats.reset()
    engine.generate(prompts, decode_tokens, stop_tokens=())  # compiles every shape used
    compile_s = engine.stats.compile_s
    best_prefill, best_decode = 0.0, 0.0
    for _ in range(repeats):
        engine.stats.reset()
        engine.generate(prompts, decode_tokens, stop_tokens=())
        s = engine.stats
        best_prefill = max(best_prefill, s.prefill_tokens / s.prefill_s)
        best_decode = max(best_decode, s.decode_tokens / s.decode_s)
    return best_prefill, best_decode, compile_s


def _kv_plan(fmt: str):
    from tenantq.quant.plan import KVPlan, QuantPlan

    return QuantPlan(kv=KVPlan(key_format=fmt, value_format=fmt))


def measure_kv(engine, batch: int, context: int, decode_tokens: int, repeats: int, seed: int):
    """(decode tokens/s, compile s) of `decode_tokens` steps ending at `context` tokens."""
    held = context - decode_tokens
    if held < 1:
        raise ValueError(f"context {context} leaves no prompt before {decode_tokens} decode steps")
    rng = np.random.default_rng(seed)
    best, compile_s = 0.0, 0.0
    for attempt in range(repeats + 1):  # the first run compiles every shape it uses
        prompts = rng.integers(3, engine.config.vocab_size, (batch, held)).tolist()
        run, logits = engine.prefill(prompts, reserve_tokens=decode_tokens)
        try:
            engine.stats.reset()  # the prefill that filled the pool is not timed
            tokens = np.argmax(logits, axis=-1)
            for _ in range(decode_tokens):
                tokens = np.argmax(engine.decode(run, tokens), axis=-1)
        finally:
            engine.release(run)
        s = engine.stats
        if attempt == 0:
            compile_s = s.compile_s
        else:
            best = max(best, s.decode_tokens / s.decode_s)
    return best, compile_s


def run_kv(config, params, kv_formats, batches, contexts, decode_tokens, repeats, dtype):
    """One row per KV format: decode tokens/s per (batch, context), ratios to bf16 KV."""

    rows = []
    for fmt in kv_formats:
        engine = Engine(
            config, params, _kv_plan(fmt), dtype=dtype, max_seqs=max(batches),
            max_seq_tokens=max(contexts),
        )  # fmt: skip
        pages_bytes = sum(r["pages_bytes"] for r in engine.cache.kv_report())
        row = {"kv_format": fmt, "kv_page_bytes": pages_bytes // engine.cache.num_pages}
        row["compile_s"] = 0.0
        for b in batches:
            for c in contexts:
                tok_s, compile_s = measure_kv(engine, b, c, decode_tokens, repeats, seed=b + c)
                row[f"decode_tok_s_b{b}_c{c}"] = tok_s
                row["compile_s"] += compile_s
        rows.append(row)
        del engine
    base = next((r for r in rows if r["kv_format"] == "bf16"), None)
    if base is not None:
        for r in rows:
            for key in [k for k in r if k.startswith("decode_tok_s")]:
                r[f"{key}_vs_bf16"] = r[key] / base[key]
    return rows


def main(argv: list[str]) -> int:
    smoke = os.environ.get(SMOKE_ENV, "") not in ("", "0")
    d = SMOKE_DEFAULTS if smoke else DEFAULTS
    parser = argparse.ArgumentParser(prog="python -m tenantq.bench engine", description=__doc__)
    parser.add_argument(
        "--model",
        help="HF checkpoint folder (default: the shipped reference model; a tiny random "
        f"model when {SMOKE_ENV}=1)",
    )
    parser.add_argument("--formats", default=d["formats"], help="comma-separated weight formats")
    parser.add_argument(
        "--batch-sizes", default=d["batch_sizes"], help="comma-separated batch sizes"
    )
    parser.add_argument("--prompt-tokens", type=int, default=d["prompt_tokens"])
    parser.add_argument("--decode-tokens", type=int, default=d["decode_tokens"])
    parser.add_argument(
        "--repeats", type=int, default=d["repeats"], help="timed runs per point (best kept)"
    )
    parser.add_argument(
        "--kv-formats",
        default=d["kv_formats"],
        help="comma-separated KV formats for the decode-at-context table ('' to skip it)",
    )
    parser.add_argument(
        "--contexts",
        default=None,
        help="comma-separated KV contexts in tokens (default: half the model's context, and all)",
    )
    parser.add_argument(
        "--kv-decode-tokens", type=int, default=d["kv_decode_tokens"], help="timed decode steps"
    )
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        help="compute dtype, also of the unquantized baseline row (XLA:CPU emulates bf16 slowly)",
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)

    import jax

    from tenantq.model.config import ModelConfig
    from tenantq.model.loader import load_params

    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    batches = [int(b) for b in args.batch_sizes.split(",")]
    if args.model or not smoke:
        from tenantq.reference import reference_model_path

        folder = Path(args.model) if args.model else reference_model_path()
        config = ModelConfig.from_file(folder)
        source = str(folder)
        params = load_params(folder, config)
    else:
        from tenantq.testing import tiny_config, tiny_params

        config = tiny_config()
        source = "tiny random model (tenantq.testing, smoke run)"
        params = tiny_params(config)
    context = config.max_position_embeddings
    if args.contexts is None:
        contexts = sorted({context // 2, context})
    else:
        contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
    too_long = [c for c in contexts if c > context]
    if too_long or args.prompt_tokens + args.decode_tokens > context:
        raise ValueError(
            f"contexts {too_long or [args.prompt_tokens + args.decode_tokens]} exceed the "
            f"model's context of {context} tokens; pass --contexts/--prompt-tokens within it"
        )
    pool = {"max_seqs": max(batches), "max_seq_tokens": args.prompt_tokens + args.decode_tokens}

    rows = []
    started = time.perf_counter()
    kv_formats = [f.strip() for f in args.kv_formats.split(",") if f.strip()]
    for fmt in formats:
        engine = Engine(config, params, _plan(fmt), dtype=args.dtype, **pool)
        row = {
            "format": fmt,
            "weight_bytes": engine.memory_report().total_weight_bytes,
            "compile_s": 0.0,
        }
        for b in batches:
            prefill, decode, compile_s = measure(
                engine, b, args.prompt_tokens, args.decode_tokens, args.repeats, seed=b
            )
            row[f"prefill_tok_s_b{b}"], row[f"decode_tok_s_b{b}"] = prefill, decode
            row["compile_s"] += compile_s
        rows.append(row)
        del engine
    base = next((r for r in rows if r["format"] == "bf16"), None)
    if base is not None:
        for r in rows:
            for key in [k for k in r if k.endswith(tuple(f"_b{b}" for b in batches))]:
                r[f"{key}_vs_bf16"] = r[key] / base[key]

    kv_rows = run_kv(
        config, params, kv_formats, batches, contexts, args.kv_decode_tokens, args.repeats,
        args.dtype,
    )  # fmt: skip
    meta = {
        "model": source,
        "device": str(jax.devices()[0]),
        "dtype": args.dtype,
        "prompt_tokens": args.prompt_tokens,
        "decode_tokens": args.decode_tokens,
        "wall_s": time.perf_counter() - started,
    }
    if args.json:
        print(json.dumps({"meta": meta, "rows": rows, "kv_rows": kv_rows}, indent=2))
    else:
        print(_table(rows, batches, meta, has_base=base is not None))
        if kv_rows:
            print(_kv_table(kv_rows, batches, contexts))
    return 0


def _table(rows, batches, meta, *, has_base: bool) -> str:
    head = ["format", "weights MiB"]
    for kind in ("prefill", "decode"):
        for b in batches:
            head.append(f"{kind} tok/s b{b}" + (" (x bf16)" if has_base else ""))
    head.append("compile s")
    lines = [
        f"model: {meta['model']}; device: {meta['device']}, compute {meta['dtype']}; "
        f"prompt {meta['prompt_tokens']} "
        f"tokens, {meta['decode_tokens']} new tokens; wall {meta['wall_s']:.0f} s",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in rows:
        cells = [r["format"], f"{r['weight_bytes'] / 2**20:.2f}"]
        for kind in ("prefill", "decode"):
            for b in batches:
                key = f"{kind}_tok_s_b{b}"
                ratio = f" ({r[key + '_vs_bf16']:.2f})" if has_base else ""
                cells.append(f"{r[key]:,.0f}{ratio}")
        cells.append(f"{r['compile_s']:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _kv_table(rows, batches, contexts) -> str:
    has_base = f"decode_tok_s_b{batches[0]}_c{contexts[0]}_vs_bf16" in rows[0]
    head = ["KV format", "page bytes (all layers)"]
    head += [f"decode tok/s b{b} ctx{c}" + (" (x bf16)" if has_base else "") for b in batches
             for c in contexts]  # fmt: skip
    head.append("compile s")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["kv_format"], str(r["kv_page_bytes"])]
        for b in batches:
            for c in contexts:
                key = f"decode_tok_s_b{b}_c{c}"
                ratio = f" ({r[key + '_vs_bf16']:.2f})" if has_base else ""
                cells.append(f"{r[key]:,.0f}{ratio}")
        cells.append(f"{r['compile_s']:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
