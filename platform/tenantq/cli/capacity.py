"""`tenantq capacity`: the memory budget of a deployment, line by line, and the tenants it holds.

One plan: `--weights`/`--kv` (every tensor / every KV layer in one format) or `--plan FILE`.
`--compare` prints several weights x KV format pairs side by side. Bad input raises
ValueError; the dispatcher prints it as one line and exits 2.
"""

from __future__ import annotations

import argparse
import json

DEFAULT_PAIRS = (
    ("bf16", "bf16"),
    ("fp8_e4m3", "bf16"),
    ("bf16", "fp8_e4m3"),
    ("fp8_e4m3", "fp8_e4m3"),
    ("int4", "fp8_e4m3"),
    ("int4", "int4"),
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "capacity",
        help="how many tenants fit: the memory budget, line by line",
        description="The per-chip memory budget of a model on a deployment: HBM - weights - "
        "runtime reserve = KV pool, KV bytes per token, pages, and how many tenants of a "
        "given context fit.",
    )
    p.add_argument("--model", required=True, help="preset name (e.g. llama-3.1-8b) or config.json")
    p.add_argument("--hardware", required=True, help="tpu-v5e, tpu-v5p, tpu-v6e, tpu-v7, ..., cpu")
    p.add_argument("--chips", type=int, default=1, help="chips = tensor-parallel degree (1)")
    p.add_argument("--memory", help="memory size for --hardware cpu, e.g. 64GiB")
    p.add_argument("--context", type=int, required=True, help="tokens per tenant")
    p.add_argument("--weights", help="format of every weight tensor (default bf16)")
    p.add_argument("--kv", help="format of every KV layer (default bf16)")
    p.add_argument("--plan", help="a QuantPlan .json/.toml file instead of --weights/--kv")
    p.add_argument("--page-tokens", type=int, default=16, help="tokens per KV page (16)")
    p.add_argument(
        "--reserve",
        help="runtime reserve per chip: a fraction of HBM (0.1, 10%%) or bytes (4GiB); "
        "default 10%% of HBM",
    )
    p.add_argument(
        "--tenants", type=int, default=1, help="report the longest context this many can hold"
    )
    p.add_argument("--compare", action="store_true", help="compare weights x KV format pairs")
    p.add_argument("--pairs", help="pairs for --compare, e.g. bf16:bf16,int4:fp8_e4m3")
    p.add_argument("--per-tensor", action="store_true", help="list every tensor's bytes")
    p.add_argument("--json", action="store_true", help="print the budget as JSON")
    return p


def run(args: argparse.Namespace) -> int:
    from tenantq.capacity import Deployment, budget, get_model_config
    from tenantq.capacity.table import render_budget, render_compare
    from tenantq.quant.plan import QuantPlan

    config = get_model_config(args.model)
    deployment = Deployment.of(
        args.hardware,
        args.chips,
        memory_bytes=args.memory,
        page_tokens=args.page_tokens,
        reserve=args.reserve,
    )
    description = deployment.hardware.description

    def one(plan: QuantPlan):
        return budget(
            config,
            plan,
            deployment,
            args.context,
            target_tenants=args.tenants,
            model_name=args.model,
        )

    if args.compare:
        if args.plan or args.weights or args.kv:
            raise ValueError("--compare takes --pairs, not --plan/--weights/--kv")
        pairs = _parse_pairs(args.pairs) if args.pairs else DEFAULT_PAIRS
        rows = [(w, kv, one(QuantPlan.uniform(w, kv))) for w, kv in pairs]
        base = next((b for w, kv, b in rows if w == kv == "bf16"), None)
        base = base or one(QuantPlan.uniform("bf16", "bf16"))
        if args.json:
            print(
                json.dumps(
                    {
                        "baseline_pool_tokens": base.pool_tokens,
                        "rows": [
                            {
                                "weights": w,
                                "kv": kv,
                                "pool_tokens_ratio": b.pool_tokens / base.pool_tokens
                                if base.pool_tokens
                                else None,
                                **b.to_dict(),
                            }
                            for w, kv, b in rows
                        ],
                    },
                    indent=2,
                )
            )
        else:
            print(render_compare(rows, base))
        return 0

    if args.plan:
        if args.weights or args.kv:
            raise ValueError("give either --plan or --weights/--kv, not both")
        plan = QuantPlan.load(args.plan)
    else:
        plan = QuantPlan.uniform(args.weights or "bf16", args.kv or "bf16")
    b = one(plan)
    if args.json:
        print(json.dumps(b.to_dict(per_tensor=args.per_tensor), indent=2))
    else:
        print(render_budget(b, per_tensor=args.per_tensor, description=description))
    return 0


def _parse_pairs(text: str) -> list[tuple[str, str]]:
    pairs = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if len(parts) != 2 or not all(parts):
            raise ValueError(f"--pairs: {item!r} is not WEIGHTS:KV (e.g. int4:fp8_e4m3)")
        pairs.append((parts[0].strip(), parts[1].strip()))
    return pairs
