"""`tenantq capacity`: the memory budget of a deployment, line by line, and the tenants it holds.

One plan: `--weights`/`--kv` (every tensor / every KV layer in one format) or `--plan FILE`.
`--compare` prints several weights x KV format pairs side by side. Each argument is typed
and checked while parsing (one line naming it, exit 2: cli/_args.py); what only the model,
the plan or the budget can judge raises ValueError naming the argument, which the
dispatcher prints as one line with exit 2.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tenantq.cli._args import byte_count, number_format, one_line_errors, positive_int

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
    p.add_argument(
        "--model", required=True, help="a preset (e.g. llama-3.1-8b) or a config.json / its folder"
    )
    p.add_argument(
        "--hardware", required=True, type=_hardware, help="tpu-v5e, tpu-v6e, h100-sxm, ..., cpu"
    )
    p.add_argument(
        "--chips",
        type=positive_int("a chip count", example=8),
        default=1,
        help="chips = tensor-parallel degree (1)",
    )
    p.add_argument(
        "--memory",
        type=byte_count("--memory", example="64GiB"),
        help="memory size for --hardware cpu, e.g. 64GiB",
    )
    p.add_argument(
        "--context",
        type=positive_int("a token count"),
        required=True,
        help="tokens per tenant, e.g. 4096",
    )
    p.add_argument("--weights", type=number_format, help="format of every weight tensor (bf16)")
    p.add_argument("--kv", type=number_format, help="format of every KV layer (bf16)")
    p.add_argument(
        "--kv-scale-dtype",
        choices=("float32", "bf16", "e8m0"),
        help="with --kv: how page/token KV scales (and int2 zero points) are stored "
        "(default: bf16 for int4/int2, float32 otherwise)",
    )
    p.add_argument(
        "--plan", type=_plan_path, help="a QuantPlan .json/.toml file instead of --weights/--kv"
    )
    p.add_argument(
        "--page-tokens",
        type=positive_int("a token count", example=16),
        default=16,
        help="tokens per KV page (16)",
    )
    p.add_argument(
        "--reserve",
        type=_reserve,
        help="runtime reserve per chip: a fraction of HBM in (0, 1) like 0.15, a percentage "
        "like 15%%, or bytes with a unit like 4GiB; default 10%% of HBM",
    )
    p.add_argument(
        "--tenants",
        type=positive_int("a tenant count", example=8),
        default=1,
        help="report the longest context this many can hold (1)",
    )
    p.add_argument("--compare", action="store_true", help="compare weights x KV format pairs")
    p.add_argument(
        "--pairs", type=_parse_pairs, help="pairs for --compare, e.g. bf16:bf16,int4:fp8_e4m3"
    )
    p.add_argument("--per-tensor", action="store_true", help="list every tensor's bytes")
    p.add_argument(
        "--slo",
        type=_slo,
        help="a decode rate per tenant (TPOT), e.g. 20tok/s (a bare 20 is tok/s too): adds "
        "the decode step time and the tenants by memory, by SLO and the binding limit",
    )
    p.add_argument(
        "--prompt-tokens",
        type=positive_int("a token count", example=512),
        help="with --slo: new (uncached) prompt tokens per request; their batched prefill is "
        "amortised over --output-tokens and the SLO judged on that rate (default: none, "
        "decode only)",
    )
    p.add_argument(
        "--output-tokens",
        type=positive_int("a token count", example=256),
        help="with --prompt-tokens: tokens generated per request (256); prompt + output must "
        "fit in --context",
    )
    p.add_argument(
        "--step-overhead-ms",
        type=_overhead_ms,
        help="with --slo: fixed cost of one decode step in ms (0.5)",
    )
    p.add_argument("--json", action="store_true", help="print the budget as JSON")
    return one_line_errors(p)


def _hardware(text: str) -> str:
    from tenantq.capacity.hardware import get_hardware

    if text.strip().lower() != "cpu":  # plain cpu needs --memory, checked together with it
        try:
            get_hardware(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return text


def _reserve(text: str) -> str:
    from tenantq.capacity.units import parse_reserve

    try:
        parse_reserve(text, what=None)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def _slo(text: str) -> float:
    from tenantq.capacity.roofline import parse_slo

    try:
        return parse_slo(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("slo: ")) from None


def _overhead_ms(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a time in ms >= 0, e.g. 0.5")
    return value


def _plan_path(text: str) -> str:
    path = Path(text).expanduser()
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise argparse.ArgumentTypeError(f"{text} {what}; give a QuantPlan .json or .toml file")
    return text


def run(args: argparse.Namespace) -> int:
    from tenantq.capacity import Deployment, budget, get_model_config
    from tenantq.capacity.table import render_budget, render_compare
    from tenantq.quant.plan import QuantPlan

    try:
        config = get_model_config(args.model)
    except (OSError, ValueError) as err:
        raise ValueError(f"--model: {err}") from None
    if args.pairs and not args.compare:
        raise ValueError("--pairs applies only with --compare")
    if args.slo is None and (
        args.prompt_tokens or args.output_tokens or args.step_overhead_ms is not None
    ):
        given = (
            "--prompt-tokens"
            if args.prompt_tokens
            else ("--output-tokens" if args.output_tokens else "--step-overhead-ms")
        )
        raise ValueError(f"{given} applies only with --slo (e.g. --slo 20tok/s)")
    if args.output_tokens and not args.prompt_tokens:
        raise ValueError(
            "--output-tokens applies only with --prompt-tokens (the decode-only SLO has no "
            "prefill to amortise)"
        )
    if args.slo is not None and args.compare:
        raise ValueError("--slo applies to one plan; it does not apply with --compare")
    if args.per_tensor and args.compare:
        raise ValueError("--per-tensor lists one plan's tensors; it does not apply with --compare")
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
        if args.kv_scale_dtype:
            raise ValueError("--kv-scale-dtype applies with --kv, not with --compare")
        pairs = args.pairs or DEFAULT_PAIRS
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

    if args.kv_scale_dtype and not args.kv:
        raise ValueError(
            "--kv-scale-dtype applies with --kv (a plan file sets kv.scale_dtype itself)"
        )
    if args.plan:
        if args.weights or args.kv:
            raise ValueError("give either --plan or --weights/--kv, not both")
        try:
            plan = QuantPlan.load(args.plan)
        except (OSError, ValueError) as err:
            raise ValueError(f"--plan: {err}") from None
    else:
        try:
            plan = QuantPlan.uniform(
                args.weights or "bf16", args.kv or "bf16",
                kv_scale_dtype=args.kv_scale_dtype,
            )  # fmt: skip
        except ValueError as err:
            raise ValueError(f"--kv-scale-dtype: {err}") from None
    b = one(plan)
    level = None
    if args.slo is not None:
        level = _service_level(config, plan, deployment, b, args)
    if args.json:
        d = b.to_dict(per_tensor=args.per_tensor)
        if level is not None:
            d["service_level"] = level.to_dict()
        print(json.dumps(d, indent=2))
    else:
        text = render_budget(b, per_tensor=args.per_tensor, description=description)
        if level is not None:
            from tenantq.capacity.table import render_service_level

            text += "\n" + render_service_level(b, level)
        print(text)
    return 0


def _service_level(config, plan, deployment, b, args):
    from tenantq.capacity.roofline import (
        DEFAULT_OUTPUT_TOKENS,
        DEFAULT_STEP_OVERHEAD_S,
        tenants_at_slo,
    )

    hw = deployment.hardware
    if hw.hbm_bandwidth_bytes_per_s is None or hw.peak_bf16_flops_per_s is None:
        raise ValueError(
            f"--slo: hardware {hw.name} has no bandwidth and peak figures; give an accelerator "
            "(tpu-v5e, h100-sxm, ...)"
        )
    overhead = args.step_overhead_ms
    prompt, out = args.prompt_tokens or 0, args.output_tokens or DEFAULT_OUTPUT_TOKENS
    if prompt and prompt + out > args.context:
        raise ValueError(
            f"--prompt-tokens {prompt:,} + --output-tokens {out:,} exceed --context "
            f"{args.context:,}: a request's context holds both; give fewer or a longer --context"
        )
    return tenants_at_slo(
        config,
        plan,
        deployment,
        args.context,
        args.slo,
        tenants_by_memory=b.tenants,
        prompt_tokens=prompt,
        output_tokens=out,
        overhead_s=DEFAULT_STEP_OVERHEAD_S if overhead is None else overhead / 1e3,
    )


def _parse_pairs(text: str) -> list[tuple[str, str]]:
    """`int4:fp8_e4m3,bf16:bf16` -> [(weights, kv), ...]; an argparse type."""
    pairs = []
    for item in text.split(","):
        parts = [part.strip() for part in item.strip().split(":")]
        if len(parts) != 2 or not all(parts):
            raise argparse.ArgumentTypeError(
                f"{item!r} is not WEIGHTS:KV; write pairs like int4:fp8_e4m3,bf16:bf16"
            )
        pairs.append((number_format(parts[0]), number_format(parts[1])))
    return pairs
