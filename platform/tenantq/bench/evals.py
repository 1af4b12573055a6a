"""`python -m tenantq.bench evals`: wall time of one quality-suite trial, split by phase.

On the shipped reference model with the `quick` suite: the first Evaluator computes the bf16
baseline; a second one reads it from the Parquet cache (what a new worker pays). Each plan is
evaluated twice: first for a new layout (its executables compile), then again with them
compiled. Every trial prints its gate verdicts, so the figures are for a suite that still
separates a damaging plan from a harmless one. Last, the top-k + tail KL against exact KL.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

PHASES = ("quantize", "compile", "baseline", "fidelity", "needles", "structured", "total")


def _plans():
    from tenantq.quant.plan import KVPlan, QuantPlan, Rule

    return {
        "fp8 weights (harmless)": QuantPlan(rules=(Rule(".*", "fp8_e4m3"),)),
        "int4 KV per-token keys": QuantPlan(
            kv=KVPlan(key_format="int4", key_axis="token", value_format="int4")
        ),
        "int4 weights + int4 KV (damaging)": QuantPlan(
            rules=(Rule(".*", "int4"),),
            kv=KVPlan(key_format="int4", key_axis="token", value_format="int4"),
        ),
    }


def _topk_error(evaluator, plans, ks=(16, 64)) -> list[dict]:
    from tenantq.evals import fidelity

    base = evaluator.baseline()["fidelity"]
    rows = []
    for name, plan in plans.items():
        engine = evaluator.build_engine(plan)
        exact = fidelity.compare(engine, evaluator.fidelity_rows, base)["kl"]
        for k in ks:
            approx = fidelity.compare(
                engine, evaluator.fidelity_rows, fidelity.topk_from_exact(base, k)
            )["kl"]
            rows.append({
                "plan": name, "k": k, "kl_mean_exact": float(exact.mean()),
                "kl_mean_topk": float(approx.mean()),
                "rel_error_mean": float((exact.mean() - approx.mean()) / exact.mean()),
                "abs_error_token_max": float(np.abs(exact - approx).max()),
            })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tenantq.bench evals", description=__doc__)
    ap.add_argument("--suite", default="quick")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-topk", action="store_true", help="skip the top-k error measurement")
    args = ap.parse_args(argv)
    from tenantq.evals import Evaluator, load_suite
    from tenantq.reference import reference_model_path

    suite = load_suite(args.suite)
    out: dict = {"suite": suite.name, "trials": []}
    with tempfile.TemporaryDirectory() as cache:
        began = time.perf_counter()
        first = Evaluator(reference_model_path(), suite, cache_dir=Path(cache))
        first.baseline()
        out["baseline_compute_s"] = round(time.perf_counter() - began, 2)
        began = time.perf_counter()
        evaluator = Evaluator(reference_model_path(), suite, cache_dir=Path(cache))
        out["evaluator_load_s"] = round(evaluator.load_s, 2)
        evaluator.baseline()
        out["baseline_cache_read_s"] = round(time.perf_counter() - began - evaluator.load_s, 2)
        plans = _plans()
        for name, plan in plans.items():
            for state in ("new layout", "compiled"):
                result = evaluator.evaluate(plan)
                out["trials"].append({
                    "plan": name, "state": state,
                    **{k: result.timings_s[k] for k in PHASES},
                    "verdicts": {k: g.verdict for k, g in result.gates.items()},
                    "kl_mean": result.summary.get("fidelity.kl_mean"),
                })  # fmt: skip
        if not args.no_topk:
            out["topk_vs_exact"] = _topk_error(evaluator, plans)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"suite {out['suite']}: baseline computed in {out['baseline_compute_s']} s; a new "
          f"evaluator loads in {out['evaluator_load_s']} s and reads the cached baseline in "
          f"{out['baseline_cache_read_s']} s")  # fmt: skip
    print(f"{'plan':<36}{'state':<12}" + "".join(f"{p:>11}" for p in PHASES) + "  verdicts")
    for t in out["trials"]:
        verdicts = ", ".join(f"{k.split('.')[0]}:{v}" for k, v in t["verdicts"].items())
        print(f"{t['plan']:<36}{t['state']:<12}" + "".join(f"{t[p]:>11.2f}" for p in PHASES)
              + f"  {verdicts}")  # fmt: skip
    for r in out.get("topk_vs_exact", []):
        print(f"top-{r['k']:<3} {r['plan']:<36} exact KL {r['kl_mean_exact']:.5f}  top-k "
              f"{r['kl_mean_topk']:.5f}  relative error {r['rel_error_mean']:.2%}  "
              f"max per-token {r['abs_error_token_max']:.2e}")  # fmt: skip
    return 0
