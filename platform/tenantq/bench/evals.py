"""`python -m tenantq.bench evals`: wall time of one quality-suite trial, split by phase.

On the shipped reference model with the `quick` suite: the first Evaluator computes the bf16
baseline; a second one reads it from the Parquet cache (what a new worker pays). Each plan is
evaluated twice: first for a new layout (its executables compile), then again with them
compiled. Every trial prints its gate verdicts, so the figures are for a suite that still
separates a damaging plan from a harmless one. Last, the top-k KL (sampled tail, and the
one-bin lower bound) against exact KL on the same candidates.

`--grid`: the findings grid (weight formats x KV formats x key axis x sinks x bf16 layers)
through `experiments/findings/grid-suite.toml`, printed as a Markdown table; it marks plans
whose perplexity is non-inferior (CI within 1%) while a retrieval or structure delta is a
significant loss (exact McNemar p <= 0.05). `--restat` recomputes a saved grid's statistics
with this code from the counts its summaries store, without running the model again.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from tenantq.model.files import CACHE_DIR, atomic_write_text

GRID_SUITE = Path(__file__).resolve().parents[3] / "experiments" / "findings" / "grid-suite.toml"
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
        window = evaluator.fidelity_kv_tokens  # the window the baseline was computed at
        exact = fidelity.compare(engine, evaluator.fidelity_rows, base, kv_tokens=window)["kl"]
        for k in ks:
            topk = fidelity.topk_from_exact(base, k)
            for tail in ("sampled", "lumped"):
                approx = fidelity.compare(
                    engine, evaluator.fidelity_rows, topk, lumped_tail=tail == "lumped",
                    kv_tokens=window,
                )["kl"]  # fmt: skip
                rows.append({
                    "plan": name, "k": k, "tail": tail, "kl_mean_exact": float(exact.mean()),
                    "kl_mean_topk": float(approx.mean()),
                    "rel_error_mean": float((approx.mean() - exact.mean()) / exact.mean()),
                    "abs_error_token_max": float(np.abs(exact - approx).max()),
                })  # fmt: skip
    return rows


def grid():
    """(label, plan) pairs: each lever moved alone from bf16, then a few combinations."""
    from tenantq.quant.plan import KVPlan, QuantPlan, Rule

    def kv(fmt, axis="channel", sinks=0, bf16_layers=()):
        return KVPlan(key_format=fmt, key_axis=axis, value_format=fmt, sink_tokens=sinks,
                      bf16_layers=tuple(bf16_layers))  # fmt: skip

    def w(fmt):
        return () if fmt == "bf16" else (Rule(".*", fmt),)

    cells = [
        ("W bf16 / KV fp8_e4m3", w("bf16"), kv("fp8_e4m3")),
        ("W bf16 / KV int8 token keys", w("bf16"), kv("int8", "token")),
        ("W bf16 / KV int4 channel keys", w("bf16"), kv("int4")),
        ("W bf16 / KV int4 token keys", w("bf16"), kv("int4", "token")),
        ("W bf16 / KV int4 token keys, 4 sinks", w("bf16"), kv("int4", "token", 4)),
        ("W bf16 / KV int4 token keys, bf16 layers 0,-1", w("bf16"),
         kv("int4", "token", 0, (0, -1))),
        ("W bf16 / KV mxfp4 channel keys", w("bf16"), kv("mxfp4")),
        ("W bf16 / KV nvfp4 token keys", w("bf16"), kv("nvfp4", "token")),
        ("W fp8_e4m3 / KV bf16", w("fp8_e4m3"), kv("bf16")),
        ("W int4 / KV bf16", w("int4"), kv("bf16")),
        ("W int4 / KV int4 channel keys", w("int4"), kv("int4")),
    ]  # fmt: skip
    return [(label, QuantPlan(rules=rules, kv=kvp)) for label, rules, kvp in cells]


def _ci(s: dict, key: str, fmt: str = "+.3f") -> str:
    return f"{s[key]:{fmt}} [{s[key + '.ci_low']:{fmt}}, {s[key + '.ci_high']:{fmt}}]"


# A retrieval/structure delta counts as broken when it is a loss and the exact McNemar test
# calls it changed (p <= 0.05, the gate's `changed` flag): with 32-48 examples a 5-point
# non-inferiority is never shown (even no flip leaves the bound at -0.07..-0.11), so the
# verdict alone cannot separate a collapse from a single flip.
_PASS_FAIL = (
    ("needle", "needle.{m}.len1019"),
    ("vartrack", "needle_vartrack.{m}.len1019"),
    ("close_brackets", "structured.{m}.close_brackets"),
)


def _run_grid(args) -> int:
    from tenantq.evals import Evaluator, load_suite
    from tenantq.reference import reference_model_path

    if args.render:
        records = json.loads(Path(args.render).read_text())
        print(_render_grid(records, "(from " + args.render + ")"))
        return 0
    if args.restat:
        saved = json.loads(Path(args.restat).read_text())
        suite = load_suite(args.suite or GRID_SUITE)
        records = restat(saved, suite, measured_at=args.measured_at)
        if args.out:
            atomic_write_text(args.out, json.dumps(records, indent=1) + "\n")
        print(_render_grid(records, "(statistics recomputed from " + args.restat + ")"))
        return 0
    suite = load_suite(args.suite or GRID_SUITE)
    evaluator = Evaluator(reference_model_path(), suite, cache_dir=args.cache_dir)
    records = []
    if args.resume:
        if not args.out or not Path(args.out).is_file():
            raise SystemExit(f"--resume needs an existing --out JSON, got {args.out!r}")
        records = json.loads(Path(args.out).read_text())
    done = {r["plan"] for r in records}
    began = time.perf_counter()
    for label, plan in grid()[: args.only]:
        if label in done:
            continue
        result = evaluator.evaluate(plan)
        commit = git_commit()
        records.append({"plan": label, "plan_json": plan.to_dict(), "summary": result.summary,
                        "timings_s": result.timings_s,
                        "commit": {"measurement": commit, "statistics": commit}})  # fmt: skip
        if args.out:
            atomic_write_text(args.out, json.dumps(records, indent=1) + "\n")
    took = f"{time.perf_counter() - began:.0f} s"
    print(_render_grid(records, f"suite {suite.name} ({suite.split}), {took}"))
    return 0


def git_commit() -> str:
    """The commit of this tree (with "+dirty" when files differ from it), "unknown" outside git."""
    root = Path(__file__).resolve().parent
    git = {"cwd": root, "capture_output": True, "text": True, "timeout": 30}
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], check=True, **git).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], **git).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty.strip() else "")


_FLIPS = re.compile(r"^(?P<task>[a-z_]+)\.flips(?P<group>\.[^.]+)?\.correct_to_wrong$")


def restat(records: list[dict], suite, *, measured_at: str | None = None) -> list[dict]:
    """A saved grid's statistics recomputed with this code, from what each summary stores.

    Pass/fail deltas: Tango's interval and the exact McNemar p from the discordant counts
    and n (sufficient statistics for both: the interval needs nothing else). Continuous
    metrics keep their stored paired-bootstrap CIs (the same bootstrap code today). The noise
    floors are dropped; verdicts, `changed` flags and the suite's warnings are recomputed;
    each record gets the commits its measurement and its statistics come from."""
    from tenantq.evals import stats
    from tenantq.evals.evaluator import decision_words, gates_for
    from tenantq.evals.suite import baseline_pass_warnings, unreachable_gate_warnings

    statistics_at = git_commit()
    out = []
    for record in records:
        old = record["summary"]
        s = {k: v for k, v in old.items()
             if not k.endswith("noise_floor") and not k.startswith(("verdict.", "changed.",
                                                                     "warning."))}  # fmt: skip
        passes, examples = {}, {}
        for key in old:
            m = _FLIPS.match(key)
            if not m:
                continue
            task, group = m["task"], m["group"] or ""
            worse = int(old[key])
            better = int(old[f"{task}.flips{group}.wrong_to_correct"])
            n = int(old[f"{task}.n{group}"])
            low, high = stats.tango_interval(worse, better, n)
            s[f"{task}.acc_delta{group}.ci_low"] = float(low)
            s[f"{task}.acc_delta{group}.ci_high"] = float(high)
            s[f"{task}.mcnemar_p{group}"] = stats.mcnemar_exact(worse, better)
            examples[f"{task}.acc_delta{group}"] = n
            if group:
                passes[f"{task}{group}"] = (round(float(old[f"{task}.acc_base{group}"]) * n), n)
        s.update(decision_words(gates_for(suite, s)))
        s.update(baseline_pass_warnings(suite, passes))
        s.update(unreachable_gate_warnings(suite, examples))
        commit = dict(record.get("commit") or {})
        commit["measurement"] = measured_at or commit.get("measurement", "unknown")
        commit["statistics"] = statistics_at
        out.append({**record, "summary": s, "commit": commit})
    return out


def _render_grid(records: list[dict], header: str) -> str:
    s0 = records[0]["summary"] if records else {}
    lines = [
        f"{header}; bf16 baseline: ppl {s0.get('fidelity.ppl_base', 0):.2f}, needle@1019 "
        f"{s0.get('needle.acc_base.len1019', 0):.0%}, vartrack@1019 "
        f"{s0.get('needle_vartrack.acc_base.len1019', 0):.0%}, close_brackets "
        f"{s0.get('structured.acc_base.close_brackets', 0):.0%}",
        "",
        "| plan | ppl ratio [95% CI] | KL mean | needle Δ [CI] (p) | vartrack Δ [CI] (p) "
        "| close_brackets Δ [CI] (p) | ppl verdict | losses with p <= 0.05 "
        "| ppl non-inferior, retrieval/structure breaks |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        s = r["summary"]
        ppl = s["verdict.fidelity.ppl_ratio"]
        cells = [r["plan"], _ci(s, "fidelity.ppl_ratio", ".4f"), f"{s['fidelity.kl_mean']:.4f}"]
        broke = []
        for name, key in _PASS_FAIL:
            delta, p = key.format(m="acc_delta"), s[key.format(m="mcnemar_p")]
            cells.append(f"{_ci(s, delta)} ({p:.2g})")
            if s[delta] < 0 and s.get(f"changed.{delta}") == "yes":
                broke.append(name)
        cells += [ppl, ", ".join(broke) or "none"]
        cells.append(f"**yes** ({', '.join(broke)})" if ppl == "non-inferior" and broke else "no")
        lines.append("| " + " | ".join(cells) + " |")
    warned = {k: v for r in records for k, v in r["summary"].items() if k.startswith("warning.")}
    if warned:
        lines += ["", "Warnings (the suite's own bars):", ""]
        lines += [f"- `{k.removeprefix('warning.')}`: {v}" for k, v in sorted(warned.items())]
    commits = {json.dumps(r.get("commit"), sort_keys=True) for r in records}
    lines += ["", "Commits (measurement, statistics): " + "; ".join(sorted(commits))]
    return "\n".join(lines)


_SMOKE_SUITE = """
resamples = 200
[fidelity]
rows = 2
row_tokens = 64
[[needles]]
lengths = [128]
per_length = 2
[structured]
tasks = ["close_brackets"]
per_task = 2
context_tokens = 64
max_new_tokens = 4
"""


def _write_smoke_suite() -> Path:
    path = Path(tempfile.mkdtemp(prefix="tenantq-bench-evals-")) / "smoke.toml"
    path.write_text(_SMOKE_SUITE)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tenantq.bench evals", description=__doc__)
    ap.add_argument("--suite", help="suite name or TOML (default: quick; --grid: grid-suite)")
    ap.add_argument("--grid", action="store_true", help="the findings grid (see _run_grid)")
    ap.add_argument("--cache-dir", default=str(CACHE_DIR), help="baseline cache for --grid")
    ap.add_argument("--out", help="--grid: write every plan's summary and timings as JSON")
    ap.add_argument("--only", type=int, help="--grid: run only the first N plans")
    ap.add_argument("--render", help="--grid: print the table of a saved --out JSON")
    ap.add_argument(
        "--restat",
        help="--grid: recompute a saved --out JSON's statistics with this code (no model run); "
        "--out writes the result",
    )
    ap.add_argument("--measured-at", help="--restat: the commit the JSON's measurement ran at")
    ap.add_argument(
        "--resume",
        action="store_true",
        help="--grid: keep the plans in --out, run the rest",
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-topk", action="store_true", help="skip the top-k error measurement")
    ap.add_argument("--topk-only", action="store_true", help="only the top-k error measurement")
    args = ap.parse_args(argv)
    if args.grid:
        return _run_grid(args)
    from tenantq.bench.engine import SMOKE_ENV
    from tenantq.engine import steps
    from tenantq.evals import Evaluator, load_suite
    from tenantq.reference import reference_model_path

    plans = _plans()
    if os.environ.get(SMOKE_ENV, "") not in ("", "0") and not args.suite:
        # smoke run (the test that every benchmark runs): a tiny suite and one plan
        suite, plans = load_suite(_write_smoke_suite()), dict(list(plans.items())[:1])
    else:
        suite = load_suite(args.suite or "quick")
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
        for name, plan in {} if args.topk_only else plans.items():
            for state in ("new layout", "compiled"):
                executables = steps.compiled_count()
                result = evaluator.evaluate(plan)
                out["trials"].append({
                    "plan": name, "state": state,
                    "executables_compiled": steps.compiled_count() - executables,
                    **{k: result.timings_s[k] for k in PHASES},
                    "verdicts": {k: g.verdict for k, g in result.gates.items()},
                    "kl_mean": result.summary.get("fidelity.kl_mean"),
                })  # fmt: skip
        if not args.no_topk:
            out["topk_vs_exact"] = _topk_error(evaluator, plans)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    if out["trials"]:
        print(
            f"suite {out['suite']}: baseline computed in {out['baseline_compute_s']} s; a new "
            f"evaluator loads in {out['evaluator_load_s']} s and reads the cached baseline in "
            f"{out['baseline_cache_read_s']} s"
        )
        head = f"{'plan':<36}{'state':<12}{'compiled':>9}" + "".join(f"{p:>11}" for p in PHASES)
        print(head + "  verdicts")
    for t in out["trials"]:
        verdicts = ", ".join(f"{k.split('.')[0]}:{v}" for k, v in t["verdicts"].items())
        times = "".join(f"{t[p]:>11.2f}" for p in PHASES)
        print(f"{t['plan']:<36}{t['state']:<12}{t['executables_compiled']:>9}{times}  {verdicts}")
    for r in out.get("topk_vs_exact", []):
        print(
            f"top-{r['k']:<3} {r['tail']:<8} {r['plan']:<36} exact KL {r['kl_mean_exact']:.5f}"
            f"  top-k {r['kl_mean_topk']:.5f}  relative error {r['rel_error_mean']:+.2%}"
            f"  max per-token {r['abs_error_token_max']:.2e}"
        )
    return 0
