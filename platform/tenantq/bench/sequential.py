"""`python -m tenantq.bench sequential`: GPTQ with one-shot against sequential statistics.

One-shot: every layer's Hessian from the full-precision model's activations (collected once
per model and calibration set, cacheable). Sequential (`quant.site_inputs.site_inputs_sequential`,
GPTQ paper section 4): layer l's from the outputs of the already-quantized layers < l,
recollected per plan. Per weight format, on the reference model: the whole-model KL against
the unquantized model on test-split text with a bootstrap CI, the paired CI of
KL(sequential) − KL(one-shot) on the same windows, and the calibration seconds of each.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

FORMATS = (("int4", 128), ("int4", 32), ("nvfp4", None), ("mxfp4", None))
SMOKE_ENV = "TENANTQ_BENCH_SMOKE"  # the suite's smoke test: a few short windows, one format
SMOKE_DEFAULTS = dict(sequences=4, seq_tokens=64, kl_rows=2, kl_tokens=64)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tenantq.bench sequential", description=__doc__)
    p.add_argument("--sequences", type=int, default=128, help="calibration windows (128)")
    p.add_argument("--seq-tokens", type=int, default=512, help="tokens per window (512)")
    p.add_argument("--kl-rows", type=int, default=32, help="KL windows of test text (32)")
    p.add_argument("--kl-tokens", type=int, default=256, help="tokens per KL window (256)")
    p.add_argument(
        "--formats", nargs="+", default=[f"{f}" if g is None else f"{f}:{g}" for f, g in FORMATS],
        help="weight formats, FORMAT or FORMAT:GROUP (default int4:128 int4:32 nvfp4 mxfp4)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    smoke = bool(os.environ.get(SMOKE_ENV))
    if smoke:
        p.set_defaults(**SMOKE_DEFAULTS, formats=["int4:128"])
    args = p.parse_args(argv)
    args.smoke = smoke
    if min(args.sequences, args.seq_tokens, args.kl_rows, args.kl_tokens) <= 0:
        p.error("counts must be positive")
    args.formats = [(f.split(":")[0], int(f.split(":")[1]) if ":" in f else None)
                    for f in args.formats]  # fmt: skip
    return args


def run(args) -> dict:
    import jax

    from tenantq.bench.calibration import _plan
    from tenantq.engine import Engine
    from tenantq.evals import data, fidelity, stats
    from tenantq.evals.identity import model_identity
    from tenantq.evals.windows import calibration_windows, text_windows
    from tenantq.model.config import ModelConfig
    from tenantq.model.loader import load_params
    from tenantq.model.tokenizer import load_tokenizer
    from tenantq.quant.apply import apply_plan
    from tenantq.quant.input_stats import collect_statistics
    from tenantq.quant.site_inputs import site_inputs, site_inputs_sequential
    from tenantq.reference import reference_model_path

    path = reference_model_path()
    config = ModelConfig.from_file(path)
    tok = load_tokenizer(path)
    params = {k: np.asarray(v, np.float32) for k, v in load_params(path, config).items()}
    windows, _ = calibration_windows(tok, config, num_sequences=args.sequences,
                                     seq_tokens=args.seq_tokens)  # fmt: skip
    rows = text_windows(tok, config, source=data.REFERENCE_TEST, rows=args.kl_rows,
                        row_tokens=args.kl_tokens)  # fmt: skip
    options = {"max_seqs": 16, "max_seq_tokens": args.kl_tokens, "dtype": "float32"}
    base = fidelity.compute_baseline(Engine(config, params, None, **options), rows,
                                     exact=True, top_k=64)  # fmt: skip

    def kl_of(quantized, plan) -> fidelity.KLMeasurement:
        engine = Engine(config, quantized, plan, **options)
        return fidelity.kl_against_baseline(engine, rows, base, resamples=2000)

    def ready(q):
        jax.block_until_ready([v for v in q.values() if hasattr(v, "data")])
        return q

    out: dict = {"calibration": list(windows.shape), "kl_set": list(rows.shape), "rows": []}
    with tempfile.TemporaryDirectory() as cache:  # one-shot statistics computed, not read
        began = time.perf_counter()
        one_shot_stats = collect_statistics(
            path, windows, model_id=model_identity(path), data_hash=data.array_hash(windows),
            cache_dir=cache, params=params,
        )  # fmt: skip
        out["one_shot_statistics_s"] = round(time.perf_counter() - began, 1)
    for fmt, group in args.formats:
        plan = _plan("gptq", fmt, group)
        label = fmt if group is None else f"{fmt} g{group}"
        if not getattr(args, "smoke", False):  # the smoke run times nothing worth a warm-up
            cal = site_inputs(params, plan, config, one_shot_stats)  # compiles GPTQ: untimed
            ready(apply_plan(cal.params, plan, config, inputs=cal.inputs))
        began = time.perf_counter()
        cal = site_inputs(params, plan, config, one_shot_stats)
        q_one = ready(apply_plan(cal.params, plan, config, inputs=cal.inputs))
        one_s = time.perf_counter() - began
        began = time.perf_counter()
        cal, _ = site_inputs_sequential(params, plan, config, windows)
        q_seq = ready(apply_plan(cal.params, plan, config, inputs=cal.inputs))
        seq_s = time.perf_counter() - began
        one, seq = kl_of(q_one, plan), kl_of(q_seq, plan)
        ci_one, ci_seq = one.ci, seq.ci
        diff = stats.paired_bootstrap(one.per_window, seq.per_window, resamples=2000)
        out["rows"].append({
            "format": label,
            "one_shot": {"kl_mean": ci_one.delta, "kl_ci": [ci_one.ci_low, ci_one.ci_high],
                         "quantize_s": round(one_s, 1)},
            "sequential": {"kl_mean": ci_seq.delta, "kl_ci": [ci_seq.ci_low, ci_seq.ci_high],
                           "calibrate_and_quantize_s": round(seq_s, 1)},
            "sequential_minus_one_shot": {"kl": diff.delta, "ci": [diff.ci_low, diff.ci_high]},
        })  # fmt: skip
        print(json.dumps(out["rows"][-1]), file=sys.stderr, flush=True)  # a partial run's rows
    return out


def _print(out: dict) -> None:
    n, t = out["calibration"]
    print(f"reference model, GPTQ, calibration {n} x {t} tokens, KL on {out['kl_set'][0]} x "
          f"{out['kl_set'][1]} test-split tokens (95% CI); one-shot statistics "
          f"{out['one_shot_statistics_s']} s (once per model and data)")  # fmt: skip
    for r in out["rows"]:
        o, s, d = r["one_shot"], r["sequential"], r["sequential_minus_one_shot"]
        print(f"  {r['format']:<10} one-shot {o['kl_mean']:.3e} [{o['kl_ci'][0]:.3e}, "
              f"{o['kl_ci'][1]:.3e}] ({o['quantize_s']} s)  sequential {s['kl_mean']:.3e} "
              f"[{s['kl_ci'][0]:.3e}, {s['kl_ci'][1]:.3e}] ({s['calibrate_and_quantize_s']} s)"
              f"  seq - one {d['kl']:+.3e} [{d['ci'][0]:+.3e}, {d['ci'][1]:+.3e}]")  # fmt: skip


def main(argv: list[str]) -> int:
    args = _parse(argv)
    out = run(args)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        _print(out)
    return 0
