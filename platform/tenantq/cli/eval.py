"""`tenantq eval`: one plan through the quality suite, summary with CIs and verdicts.

Loads the checkpoint and the suite, reads or computes the bf16 baseline (cached under
`--cache-dir`), evaluates the plan, prints the gates and the summary (`--json`: the flat
summary dict) and with `--out DIR` writes examples.parquet and summary.json. A progress bar
goes to stderr. Bad input (plan, dataset, a plan that does not fit) is a one-line error.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tenantq.cli._args import byte_count, cache_folder, output_folder
from tenantq.model.files import CACHE_DIR


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "eval",
        help="quality of a plan against the bf16 baseline, with CIs and verdicts",
        description="Run a quantization plan through the quality suite (fidelity, needle "
        "grid, structured output) paired against the bf16 baseline of the same model.",
    )
    p.add_argument("--model", help="checkpoint folder (default: the shipped reference model)")
    p.add_argument("--plan", help="QuantPlan .json/.toml (default: bf16, i.e. no change)")
    p.add_argument("--suite", default="quick", help="quick, standard, long or a suite .toml")
    p.add_argument("--split", choices=("search", "confirm"), help="override the suite's split")
    p.add_argument("--cache-dir", default=str(CACHE_DIR), help="baseline cache folder")
    p.add_argument(
        "--pool-bytes",
        type=byte_count("--pool-bytes"),
        help="size the engine's KV pool like a deployment: bytes, e.g. 2GiB or 2000000000",
    )
    p.add_argument("--out", help="folder for examples.parquet and summary.json")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def run(args: argparse.Namespace) -> int:
    from tenantq.evals import Evaluator, load_suite
    from tenantq.quant.plan import QuantPlan
    from tenantq.reference import reference_model_path

    out = output_folder(args.out, "--out") if args.out else None
    plan = QuantPlan.load(args.plan) if args.plan else QuantPlan()
    suite = load_suite(args.suite)
    if args.split:
        suite = suite.with_split(args.split)
    model = Path(args.model) if args.model else reference_model_path()
    if not model.is_dir():
        raise ValueError(f"--model {model} is not a checkpoint folder")
    if args.plan and (model / "config.json").is_file():  # before the baseline is measured
        from tenantq.model.config import ModelConfig

        try:
            plan.check_model(ModelConfig.from_file(model / "config.json"))
        except ValueError as err:
            raise ValueError(f"plan file {args.plan}: {err}") from None
    cache_folder(args.cache_dir, "--cache-dir")  # created once the inputs are checked
    options = {"pool_bytes": args.pool_bytes} if args.pool_bytes else None
    evaluator = Evaluator(
        model, suite, cache_dir=args.cache_dir, engine_options=options,
        progress=not args.no_progress,
    )  # fmt: skip
    result = evaluator.evaluate(plan)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        result.to_parquet(out / "examples.parquet")
        record = {"summary": result.summary, "timings_s": result.timings_s}
        (out / "summary.json").write_text(json.dumps(record, indent=1) + "\n")
    if args.json:
        print(json.dumps(result.summary, indent=1))
        return 0
    print(f"suite {suite.name} ({suite.split}), plan {plan.fingerprint()}, model {model}")
    print("\n".join(result_lines(result)))
    return 0


def result_lines(result) -> list[str]:
    """The gates (delta, CI, tolerance, verdict, changed), the suite's warnings, the rest of
    the summary and the timings: in the words the summary and MLflow hold."""
    lines = []
    for name, gate in result.gates.items():
        lines.append(
            f"  {name:<34} {gate.value:+.4f} [{gate.ci_low:+.4f}, {gate.ci_high:+.4f}] "
            f"tolerance {gate.tolerance:g}: {gate.verdict}; "
            f"changed: {result.summary.get(f'changed.{name}', '?')}"
        )
    for key, value in result.summary.items():
        if key.startswith("warning."):
            lines.append(f"  {key}: {value}")
    for key, value in result.summary.items():
        if key.endswith((".ci_low", ".ci_high")) or key.startswith(_WORDS):
            continue
        low = result.summary.get(f"{key}.ci_low")
        ci = f"  [{low:.4g}, {result.summary[f'{key}.ci_high']:.4g}]" if low is not None else ""
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        lines.append(f"  {key:<44} {shown}{ci}")
    lines.append("  timings_s " + ", ".join(f"{k} {v:.2f}" for k, v in result.timings_s.items()))
    return lines


# summary entries that are words, printed above with their gate or as warnings
_WORDS = ("verdict.", "changed.", "warning.")
