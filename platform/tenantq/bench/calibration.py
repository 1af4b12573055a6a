"""`python -m tenantq.bench calibration`: what GPTQ / AWQ / SmoothQuant cost and what they buy.

On the reference model: statistics collection (seconds per layer), then per decoder layer
the seconds each algorithm takes against RTN; then, for each algorithm and format, the
layer output error ‖XW − XŴ‖² summed over every decoder linear on *held-out* calibration
windows (their own Gram matrices) relative to RTN's, and the whole-model KL against bf16
on held-out text (the reference test split) with a bootstrap CI, plus the paired CI of
KL(algorithm) − KL(RTN) on the same windows (resampled by window, the same draw for both:
the test of "below RTN", which two overlapping unpaired CIs cannot decide). `--synthetic-8b` times
one Llama-3.1-8B-shaped layer (hidden 4096, MLP 14336, 8 KV heads) with random weights
and a Gram from random correlated inputs, to say what an 8B calibration costs here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from tenantq.model.files import CACHE_DIR
from tenantq.model.terminal import text_table

FORMATS = (("int4", 128), ("int8", None), ("nvfp4", None), ("mxfp4", None))
ALGORITHMS = ("rtn", "gptq", "awq", "smoothquant")
SYNTHETIC_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
W8A8_SCALES = (("dynamic", "absmax"), ("static", "absmax"), ("static", "percentile"))
# Under this variable (the suite's smoke test) the defaults shrink to a few short windows, one
# format and a 3-point AWQ grid: every step still runs, in seconds instead of minutes.
SMOKE_ENV = "TENANTQ_BENCH_SMOKE"
SMOKE_DEFAULTS = dict(sequences=4, seq_tokens=64, held_out=2, kl_rows=2, kl_tokens=64,
                      awq_grid=3)  # fmt: skip


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tenantq.bench calibration",
        description="calibration algorithms: seconds per layer and output error/KL vs RTN",
    )
    p.add_argument("--sequences", type=int, default=128, help="calibration windows (128)")
    p.add_argument("--seq-tokens", type=int, default=512, help="tokens per window (512)")
    p.add_argument("--held-out", type=int, default=32, help="held-out windows (32)")
    p.add_argument("--kl-rows", type=int, default=32, help="KL windows of test text (32)")
    p.add_argument("--kl-tokens", type=int, default=256, help="tokens per KL window (256)")
    p.add_argument("--awq-grid", type=int, default=20, help="AWQ alpha grid points (20)")
    p.add_argument("--cache-dir", default=str(CACHE_DIR), help="statistics cache")
    p.add_argument("--skip-reference", action="store_true", help="only the synthetic layer")
    p.add_argument("--synthetic-8b", action="store_true", help="time an 8B-shaped layer")
    p.add_argument("--synthetic-tokens", type=int, default=2048, help="tokens in its Gram")
    p.add_argument(
        "--synthetic-linears", nargs="+", choices=SYNTHETIC_LINEARS, default=SYNTHETIC_LINEARS,
        help="which of the 8B layer's linears to time (default all 7)",
    )  # fmt: skip
    p.add_argument(
        "--synthetic-algorithms", nargs="+", choices=ALGORITHMS, default=ALGORITHMS,
        help="which algorithms to time on them (default all)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    smoke = bool(os.environ.get(SMOKE_ENV))
    if smoke:
        p.set_defaults(**SMOKE_DEFAULTS)
    args = p.parse_args(argv)
    args.formats = FORMATS[:1] if smoke else FORMATS
    args.w8a8_scales = W8A8_SCALES[:2] if smoke else W8A8_SCALES
    if min(args.sequences, args.seq_tokens, args.held_out, args.kl_rows, args.awq_grid) <= 0:
        p.error("counts must be positive")
    return args


def _plan(algorithm: str, fmt: str, group: int | None, pattern: str = "layers/.*"):
    from tenantq.quant.plan import QuantPlan, Rule

    return QuantPlan(rules=(Rule(pattern, fmt, group_size=group, algorithm=algorithm),))


def _quantize(params, plan, config, stats, awq_grid: int, static_statistic: str = "absmax"):
    """(Calibrated, quantized params) for a plan: site_inputs then apply_plan, as a user would."""
    import jax

    from tenantq.quant.apply import apply_plan
    from tenantq.quant.site_inputs import site_inputs

    cal = site_inputs(params, plan, config, stats, awq_grid=awq_grid,
                  static_statistic=static_statistic)  # fmt: skip
    quantized = apply_plan(cal.params, plan, config, inputs=cal.inputs)
    jax.block_until_ready([v for v in quantized.values() if hasattr(v, "data")])
    return cal, quantized


def reference(args) -> dict:
    from tenantq.engine import Engine
    from tenantq.evals import data, fidelity, stats
    from tenantq.evals.identity import model_identity
    from tenantq.evals.windows import calibration_windows, text_windows
    from tenantq.model.config import ModelConfig
    from tenantq.model.loader import load_params
    from tenantq.model.tokenizer import load_tokenizer
    from tenantq.numerics import dequantize
    from tenantq.quant.awq import output_error
    from tenantq.quant.input_stats import collect_statistics
    from tenantq.reference import reference_model_path

    path = reference_model_path()
    config = ModelConfig.from_file(path)
    tok = load_tokenizer(path)
    params = {k: np.asarray(v, np.float32) for k, v in load_params(path, config).items()}
    cal_rows, held_rows = calibration_windows(
        tok, config, num_sequences=args.sequences, seq_tokens=args.seq_tokens,
        held_out=args.held_out,
    )  # fmt: skip
    model_id = model_identity(path)
    out: dict = {"model": str(path), "calibration": list(cal_rows.shape)}
    t0 = time.perf_counter()
    calib = collect_statistics(
        path, cal_rows, model_id=model_id, data_hash=data.array_hash(cal_rows),
        cache_dir=args.cache_dir, params=params,
    )  # fmt: skip
    held = collect_statistics(
        path, held_rows, model_id=model_id, data_hash=data.array_hash(held_rows),
        cache_dir=args.cache_dir, params=params,
    )  # fmt: skip
    out["statistics"] = {
        "seconds_per_layer": [round(s, 2) for s in calib.seconds_per_layer],
        "from_cache": calib.from_cache, "wall_s": round(time.perf_counter() - t0, 1),
    }  # fmt: skip

    # Seconds per decoder layer, int4 g128 (SmoothQuant: int8, its W8A8 weight format).
    timing = {}
    for algorithm in ALGORITHMS:
        fmt, group = ("int8", None) if algorithm == "smoothquant" else ("int4", 128)
        per_layer = []
        for layer in range(config.num_layers):
            plan = _plan(algorithm, fmt, group, f"layers/{layer}/.*")
            _quantize(params, plan, config, calib, args.awq_grid)  # compile once
            start = time.perf_counter()
            _quantize(params, plan, config, calib, args.awq_grid)
            per_layer.append(round(time.perf_counter() - start, 3))
        timing[algorithm] = per_layer
    out["seconds_per_layer"] = timing

    # Quality: held-out layer output error and whole-model KL, each vs RTN.
    rows = text_windows(tok, config, source=data.REFERENCE_TEST, rows=args.kl_rows,
                        row_tokens=args.kl_tokens)  # fmt: skip
    options = {"max_seqs": 16, "max_seq_tokens": args.kl_tokens, "dtype": "float32"}
    base = fidelity.compute_baseline(Engine(config, params, None, **options), rows,
                                     exact=True, top_k=64)  # fmt: skip

    def kl_of(quantized, plan):
        """(CI of the mean KL, KL per window: the pairing unit for a contrast with RTN)."""
        engine = Engine(config, quantized, plan, **options)
        kl = fidelity.kl_against_baseline(engine, rows, base, resamples=2000)
        return kl.ci, kl.per_window

    def vs_rtn(rtn_kl, kl) -> dict:
        """Paired CI of mean KL − RTN's mean KL over the same windows."""
        diff = stats.paired_bootstrap(rtn_kl, kl, resamples=2000)
        return {"kl_minus_rtn": diff.delta, "kl_minus_rtn_ci_low": diff.ci_low,
                "kl_minus_rtn_ci_high": diff.ci_high}  # fmt: skip

    quality = []
    for fmt, group in args.formats:
        results = {}
        for algorithm in ALGORITHMS:
            plan = _plan(algorithm, fmt, group)
            cal, quantized = _quantize(params, plan, config, calib, args.awq_grid)
            err = {}
            for p in plan.resolve(config):
                w_hat = cal.effective_weight(p, dequantize(quantized[p]), config)
                err[p] = output_error(w_hat, params[p], held.for_path(p).gram)
            ci, kl = kl_of(quantized, plan)
            results[algorithm] = (err, ci, kl)
        rtn_err, rtn_ci, rtn_kl = results["rtn"]
        for algorithm, (err, ci, kl) in results.items():
            quality.append({
                "format": fmt if group is None else f"{fmt} g{group}", "algorithm": algorithm,
                "layer_error_vs_rtn": sum(err.values()) / sum(rtn_err.values()),
                "tensors_below_rtn": sum(err[p] < rtn_err[p] for p in err), "tensors": len(err),
                "kl_mean": ci.delta, "kl_ci_low": ci.ci_low, "kl_ci_high": ci.ci_high,
                "kl_vs_rtn": ci.delta / rtn_ci.delta,
                **({} if algorithm == "rtn" else vs_rtn(rtn_kl, kl)),
            })  # fmt: skip
    # SmoothQuant's own setting: W8A8 (int8 weights, int8 activations), activations scaled
    # per token at run time (dynamic) or by one calibrated scale per linear input (static:
    # the calibration set's absmax, or its 99.9th percentile, beyond which values clip).
    from tenantq.quant.plan import QuantPlan, Rule

    for scale, statistic in args.w8a8_scales:
        label = "W8A8 int8" + ("" if scale == "dynamic" else f" static {statistic}")
        per_window = {}
        for algorithm in ("rtn", "smoothquant"):
            plan = QuantPlan(rules=(Rule("layers/.*", "int8", algorithm=algorithm,
                                         activations="int8", activation_scale=scale),))  # fmt: skip
            _, quantized = _quantize(params, plan, config, calib, args.awq_grid, statistic)
            ci, per_window[algorithm] = kl_of(quantized, plan)
            quality.append({"format": label, "algorithm": algorithm, "kl_mean": ci.delta,
                            "kl_ci_low": ci.ci_low, "kl_ci_high": ci.ci_high})  # fmt: skip
        w8a8 = [q for q in quality if q["format"] == label]
        w8a8[1]["kl_vs_rtn"] = w8a8[1]["kl_mean"] / w8a8[0]["kl_mean"]
        w8a8[1].update(vs_rtn(per_window["rtn"], per_window["smoothquant"]))
    out["quality"] = quality
    out["kl_set"] = list(rows.shape)
    return out


def synthetic_8b(args) -> dict:
    """Seconds per linear (and per layer) of each algorithm on one 8B-shaped layer."""
    import jax

    from tenantq.quant.apply import quantize_tensor
    from tenantq.quant.awq import search_scale
    from tenantq.quant.folding import FoldSite, fold
    from tenantq.quant.input_stats import InputStats
    from tenantq.quant.plan import TensorQuant
    from tenantq.quant.smoothquant import site_scales

    hidden, mlp, kv = 4096, 14336, 1024
    shapes = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
              "o_proj": (hidden, hidden), "gate_proj": (hidden, mlp), "up_proj": (hidden, mlp),
              "down_proj": (mlp, hidden)}  # fmt: skip
    shapes = {name: shapes[name] for name in args.synthetic_linears}
    rng = np.random.default_rng(0)
    grams = {}
    for n in sorted({n for n, _ in shapes.values()}):
        z = rng.standard_normal((args.synthetic_tokens, 64)).astype(np.float32)
        x = z @ rng.standard_normal((64, n)).astype(np.float32)
        x += 0.5 * rng.standard_normal(x.shape).astype(np.float32)
        x *= np.exp(0.5 * rng.standard_normal(n)).astype(np.float32)  # uneven channels
        grams[n] = (x.T @ x).astype(np.float64), np.abs(x).mean(0), np.abs(x).max(0)
        del x, z
    out: dict = {"tokens": args.synthetic_tokens, "linears": {}}
    for name, (n, m) in shapes.items():
        w = (rng.standard_normal((n, m)) / np.sqrt(n)).astype(np.float32)
        gram, mean_abs, absmax = grams[n]
        stats = InputStats(name, (name,), args.synthetic_tokens, absmax, absmax, mean_abs, gram)
        how = TensorQuant(name, "int4", 0, 128, True, "rtn", None)
        row = {}
        for algorithm in args.synthetic_algorithms:
            start = time.perf_counter()
            if algorithm == "rtn":
                q = quantize_tensor(w, how)
            elif algorithm == "gptq":
                q = quantize_tensor(w, _with(how, "gptq"), hessian=stats.hessian)
            elif algorithm == "awq":
                site = FoldSite(name, (name,), "norm", "norm")
                params = {name: w, "norm": np.ones(n, np.float32)}
                s, _ = search_scale(params, None, site, stats, {name: how}, grid=args.awq_grid)
                folded = fold(params, None, site, s)
                scaled = InputStats(name, (name,), stats.tokens, absmax / s, absmax / s,
                                    mean_abs / s, gram / np.outer(s, s))  # fmt: skip
                q = quantize_tensor(folded[name], _with(how, "awq"), awq_scaled=True,
                                    gram=scaled.gram)  # fmt: skip
            else:
                site = FoldSite(name, (name,), "norm", "norm")
                params = {name: w, "norm": np.ones(n, np.float32)}
                from tenantq.quant.input_stats import CalibrationStats

                s = site_scales(params, None, site, CalibrationStats("", "", {name: stats}))
                folded = fold(params, None, site, s)
                q = quantize_tensor(folded[name], _with(how, "smoothquant", "int8"),
                                    smoothed=True)  # fmt: skip
            jax.block_until_ready(q.data)
            row[algorithm] = round(time.perf_counter() - start, 2)
            print(f"  8B {name} [{n}x{m}] {algorithm}: {row[algorithm]} s", file=sys.stderr)
        out["linears"][name] = row
    if len(shapes) == len(SYNTHETIC_LINEARS):
        out["per_layer_s"] = {a: round(sum(r[a] for r in out["linears"].values()), 1)
                              for a in args.synthetic_algorithms}  # fmt: skip
    return out


def _with(how, algorithm: str, fmt: str | None = None):
    from dataclasses import replace

    group = None if fmt == "int8" else how.group_size
    return replace(how, algorithm=algorithm, format=fmt or how.format, group_size=group)


def _print(result: dict) -> None:
    ref = result.get("reference")
    if ref:
        st = ref["statistics"]
        print(f"reference model, calibration {ref['calibration'][0]} x {ref['calibration'][1]} "
              f"tokens; statistics s/layer {st['seconds_per_layer']} "
              f"(from cache: {st['from_cache']})")  # fmt: skip
        print("seconds per decoder layer (int4 g128; smoothquant int8):")
        for algorithm, secs in ref["seconds_per_layer"].items():
            print(f"  {algorithm:<12} " + " ".join(f"{s:7.2f}" for s in secs))
        print(f"quality vs RTN (layer error: held-out Gram, all decoder linears; KL: "
              f"{ref['kl_set'][0]} x {ref['kl_set'][1]} test-split tokens, 95% CI)")  # fmt: skip
        body = []
        for q in ref["quality"]:
            err = f"{q['layer_error_vs_rtn']:.3f}" if "layer_error_vs_rtn" in q else "-"
            below = f"{q['tensors_below_rtn']}/{q['tensors']}" if "tensors" in q else "-"
            ratio = f"{q['kl_vs_rtn']:.3f}" if "kl_vs_rtn" in q else "-"
            ci = f"[{q['kl_ci_low']:.2e}, {q['kl_ci_high']:.2e}]"
            paired = "-"
            if "kl_minus_rtn" in q:
                paired = (f"{q['kl_minus_rtn']:+.2e} [{q['kl_minus_rtn_ci_low']:+.2e}, "
                          f"{q['kl_minus_rtn_ci_high']:+.2e}]")  # fmt: skip
            body.append([q["format"], q["algorithm"], err, below, f"{q['kl_mean']:9.2e}", ci,
                         ratio, paired])  # fmt: skip
        head = ["format", "algorithm", "err/rtn", "below", "KL mean", "KL 95% CI", "KL/rtn",
                "KL - rtn, paired 95% CI"]  # fmt: skip
        widths = [26, 12, 8, 6, 9, 21, 7, 34]
        print("\n".join(text_table(head, body, widths=widths, right=range(2, 8), sep=" ",
                                   indent="  ")))  # fmt: skip
    syn = result.get("synthetic_8b")
    if syn:
        for name, row in syn["linears"].items():
            print(f"Llama-3.1-8B-shaped {name}, int4 g128 (smoothquant int8), seconds: {row}")
        if "per_layer_s" in syn:
            print(f"Llama-3.1-8B-shaped layer, seconds per layer: {syn['per_layer_s']}")


def main(argv: list[str]) -> int:
    args = _parse(argv)
    result: dict = {}
    if not args.skip_reference:
        result["reference"] = reference(args)
    if args.synthetic_8b:
        result["synthetic_8b"] = synthetic_8b(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print(result)
    return 0
