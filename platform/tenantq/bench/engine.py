"""`python -m tenantq.bench engine`: prefill and decode throughput per weight format.

Every format runs in the same process on the same prompts, so its figures are reported
as ratios to bf16 measured in this run; compile time is reported apart (the engine's
stats separate it). The shipped reference model is used when present, else a random
model of its shape. On CPU, weight-only formats pay for dequantizing inside the matmul
and are expected to trail bf16; the ratio that matters is the one on the target device.
The KV part decodes with bf16 weights and each KV format at given contexts: the pool is
filled with random keys/values through the pool's own write (no quadratic prefill), then
timed greedy decode steps read every page back, dequantized, as serving would.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from tenantq.reference import reference_model_path

REFERENCE_MODEL = reference_model_path()
FORMATS = ("bf16", "fp8_e4m3", "int8", "int4", "mxfp4", "nvfp4")
KV_FORMATS = ("bf16", "fp8_e4m3", "int8", "int4", "mxfp4", "nvfp4")


def random_reference_config():
    from tenantq.model.config import ModelConfig

    return ModelConfig(
        model_type="llama",
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=768,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        name="random-reference-shape",
    )


def _plan(fmt: str):
    from tenantq.quant.plan import QuantPlan, Rule

    if fmt == "bf16":
        return QuantPlan()
    return QuantPlan(rules=(Rule(".*", fmt, group_size=128 if fmt == "int4" else None),))


def measure(engine, batch: int, prompt_tokens: int, decode_tokens: int, repeats: int, seed: int):
    """(prefill tokens/s, decode tokens/s, compile s) of greedy generation at `batch`."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(3, engine.config.vocab_size, (batch, prompt_tokens)).tolist()
    engine.stats.__init__()
    engine.generate(prompts, decode_tokens, stop_tokens=())  # compiles every shape used
    compile_s = engine.stats.compile_s
    best_prefill, best_decode = 0.0, 0.0
    for _ in range(repeats):
        engine.stats.__init__()
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
    import jax

    cache, layout = engine.cache, engine.cache.layout
    held = context - decode_tokens
    rng = np.random.default_rng(seed)
    kv = rng.standard_normal((batch, held, layout.kv_heads, layout.head_dim), np.float32)
    positions = np.broadcast_to(np.arange(held, dtype=np.int32), (batch, held))
    valid = np.ones((batch, held), bool)

    @jax.jit
    def fill(state, table, positions, valid, kv):
        for layer in range(len(layout.layers)):
            state = layout.write(state, layer, table, positions, valid, kv, kv)
        return state

    best, compile_s = 0.0, 0.0
    for attempt in range(repeats + 1):  # the first run compiles every shape it uses
        prompts = rng.integers(3, engine.config.vocab_size, (batch, 1)).tolist()
        run, _ = engine.prefill(prompts, reserve_tokens=context - 1)
        try:
            cache.prepare(run.seq_ids, [held] * batch)
            cache.state = jax.block_until_ready(
                fill(cache.state, cache.table(run.seq_ids), positions, valid, kv)
            )
            run.lengths = np.full(batch, held, np.int64)
            engine.stats.__init__()
            tokens = np.zeros(batch, np.int32)
            for _ in range(decode_tokens):
                tokens = np.asarray(engine._decode(run, tokens)[1])[:batch]
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
    from tenantq.engine import Engine

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
    parser = argparse.ArgumentParser(prog="python -m tenantq.bench engine", description=__doc__)
    parser.add_argument(
        "--model", help="HF checkpoint folder (default: the shipped reference model, else random)"
    )
    parser.add_argument(
        "--formats", default=",".join(FORMATS), help="comma-separated weight formats"
    )
    parser.add_argument("--batch-sizes", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per point (best kept)")
    parser.add_argument(
        "--kv-formats",
        default=",".join(KV_FORMATS),
        help="comma-separated KV formats for the decode-at-context table ('' to skip it)",
    )
    parser.add_argument(
        "--contexts", default="512,2048", help="comma-separated KV contexts (tokens held)"
    )
    parser.add_argument("--kv-decode-tokens", type=int, default=8, help="timed decode steps")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        help="compute dtype, also of the unquantized baseline row (XLA:CPU emulates bf16 slowly)",
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)

    import jax

    from tenantq.engine import Engine
    from tenantq.model.decoder import init_params
    from tenantq.model.loader import load_params

    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    batches = [int(b) for b in args.batch_sizes.split(",")]
    folder = Path(args.model) if args.model else REFERENCE_MODEL
    if (folder / "config.json").is_file():
        from tenantq.model.config import ModelConfig

        config = ModelConfig.from_file(folder)
        source = str(folder)
        params = load_params(folder, config)
    else:
        config = random_reference_config()
        source = "random model, reference shape (no shipped model found)"
        params = init_params(config, seed=0)
    pool = {"max_seqs": max(batches), "max_seq_tokens": args.prompt_tokens + args.decode_tokens}

    rows = []
    started = time.perf_counter()
    kv_formats = [f.strip() for f in args.kv_formats.split(",") if f.strip()]
    contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
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
