"""KV format x scale axis x scale storage on the reference model with the quick suite
(README "KV cache formats" and "KV scale storage").

Regenerate: `JAX_PLATFORMS=cpu python experiments/kv_granularity/measure.py` (writes
results.json beside this file and prints the table; rows already there are kept). Static axes
are calibrated on the reference train split (64 x 512 tokens) by the evaluator; the clip rate
is over the trial's own writes. A row's `scale_dtype` is the plan's `kv.scale_dtype`; its
`page_tokens` is the pool's page, which is also the span of a per-channel key scale (a key
scale over 2 or 4 pages of 16 tokens is a page of 32 or 64 tokens). Each page size has its
own bf16 baseline (the evaluator keys baselines by engine settings).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from tenantq.evals import Evaluator, load_suite
from tenantq.quant.plan import KVPlan, QuantPlan
from tenantq.reference import reference_model_path

GRID = [
    ("fp8_e4m3", "tensor", "tensor"), ("fp8_e4m3", "head", "head"),
    ("fp8_e4m3", "channel", "token"), ("int8", "tensor", "tensor"), ("int8", "head", "head"),
    ("int8", "channel", "token"), ("int4", "channel", "token"), ("int4", "token", "token"),
    ("int4", "head", "head"), ("int4", "tensor", "tensor"), ("int2", "channel", "token"),
    ("int2", "token", "token"),
]  # fmt: skip
# (format, key axis, value axis, scale dtype, page tokens); the rows above are float32, 16.
SCALE_GRID = [
    ("int4", "channel", "token", "bf16", 16), ("int4", "channel", "token", "e8m0", 16),
    ("int4", "channel", "token", "float32", 64), ("int4", "channel", "token", "bf16", 64),
    ("int4", "channel", "token", "e8m0", 64), ("int2", "channel", "token", "bf16", 16),
    ("int2", "channel", "token", "float32", 64), ("int2", "channel", "token", "bf16", 64),
    ("int2", "channel", "token", "bf16", 32), ("int4", "channel", "token", "e8m0", 32),
    ("int2", "channel", "token", "float32", 32),
    ("int8", "channel", "token", "e8m0", 16), ("fp8_e4m3", "channel", "token", "e8m0", 16),
]  # fmt: skip


def _key(r: dict) -> tuple:
    return (r["format"], r["key_axis"], r["value_axis"], r.get("scale_dtype", "float32"),
            r.get("page_tokens", 16))  # fmt: skip


def _plan(fmt: str, k_axis: str, v_axis: str, scale_dtype: str) -> QuantPlan:
    return QuantPlan(kv=KVPlan(fmt, k_axis, fmt, v_axis, scale_dtype=scale_dtype))


def table(rows: list[dict]) -> str:
    """The README table: quality on the reference model, bytes on Llama-3.1-8B (planner)."""
    from tenantq.capacity import Deployment, budget, get_model_config

    llama = get_model_config("llama-3.1-8b")
    out = [
        "| KV format | keys | values | scales | page | mean KL [95% CI] | needle Δ [95% CI] "
        "| verdicts (KL, needle) | clip rate | 8B B/token | 8B slot B | 8B static B |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    formats = list(dict.fromkeys(g[0] for g in GRID))
    axes = ["tensor", "head", "channel", "token"]
    scales = ["float32", "bf16", "e8m0"]

    def order(r: dict) -> tuple:
        fmt, k_axis, _, scale_dtype, page_tokens = _key(r)
        return formats.index(fmt), axes.index(k_axis), page_tokens, scales.index(scale_dtype)

    for r in sorted(rows, key=order):
        fmt, k_axis, v_axis, scale_dtype, page_tokens = _key(r)
        v6e = Deployment.of("tpu-v6e", 1, page_tokens=page_tokens)
        b = budget(llama, _plan(fmt, k_axis, v_axis, scale_dtype), v6e, 8192)
        v = r["verdicts"]
        verdicts = ", ".join(
            v[k].replace("no detectable change", "ok")
            for k in ("verdict.fidelity.kl_mean", "verdict.needle.acc_delta.len1019")
        )
        clip = "-" if r["clip_rate"] is None else f"{r['clip_rate']:.2g}"
        lo, hi = r["kl_mean_ci"]
        nlo, nhi = r["needle_ci"]
        out.append(
            f"| {fmt} | {k_axis} | {v_axis} | {scale_dtype} | {page_tokens} | {r['kl_mean']:.5f} "
            f"[{lo:.5f}, {hi:.5f}] | {r['needle_delta']:+.3f} [{nlo:+.3f}, {nhi:+.3f}] | "
            f"{verdicts} | {clip} | "
            f"{int(b.kv_bytes_per_token):,} | {b.tenant_slot_bytes_per_chip:,} | "
            f"{b.kv_static_bytes_per_chip:,} |"
        )
    return "\n".join(out)


def main() -> None:
    out = Path(__file__).with_name("results.json")
    rows = json.loads(out.read_text()) if out.is_file() else []
    evaluators = {16: Evaluator(reference_model_path(), load_suite("quick"))}
    # Rows of another quick suite (another dataset hash) are measured again, not mixed in.
    dataset = evaluators[16].dataset_hash
    stale = [r for r in rows if r.get("dataset_hash") != dataset]
    if stale:
        print(f"{len(stale)} rows of another suite version dropped", file=sys.stderr)
    rows = [r for r in rows if r.get("dataset_hash") == dataset]
    done = {_key(r) for r in rows}
    grid = [(*g, "float32", 16) for g in GRID] + SCALE_GRID
    todo = [g for g in grid if g not in done]
    for fmt, k_axis, v_axis, scale_dtype, page_tokens in todo:
        if page_tokens not in evaluators:
            evaluators[page_tokens] = Evaluator(
                reference_model_path(), load_suite("quick"),
                engine_options={"page_tokens": page_tokens},
            )  # fmt: skip
        ev = evaluators[page_tokens]
        plan = _plan(fmt, k_axis, v_axis, scale_dtype)
        began = time.perf_counter()
        result = ev.evaluate(plan)
        s = result.summary
        needle = "needle.acc_delta.len1019"
        engine = ev.build_engine(plan)  # same scales; the clip rate of one quick-suite pass
        engine.logits(ev.fidelity_rows[:4].tolist())
        row = {
            "format": fmt, "key_axis": k_axis, "value_axis": v_axis,
            "scale_dtype": scale_dtype, "page_tokens": page_tokens,
            "kl_mean": s["fidelity.kl_mean"],
            "kl_mean_ci": [s["fidelity.kl_mean.ci_low"], s["fidelity.kl_mean.ci_high"]],
            "needle_delta": s[needle],
            "needle_ci": [s[f"{needle}.ci_low"], s[f"{needle}.ci_high"]],
            "structured_delta": s.get("structured.acc_delta"),
            "verdicts": {k: v for k, v in s.items() if k.startswith("verdict.")},
            "clip_rate": engine.kv_clip_rate(),
            "seconds": time.perf_counter() - began,
            "load_average_1min": os.getloadavg()[0],
            "dataset_hash": ev.dataset_hash,
        }  # fmt: skip
        rows.append(row)
        out.write_text(json.dumps(rows, indent=1))
        print(json.dumps(row), file=sys.stderr, flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
