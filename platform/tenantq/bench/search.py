"""`python -m tenantq.bench search`: trials per hour with 1 and 2 workers, and where a trial's
time goes (load / quantize / compile / eval).

Both runs search the quickstart spec with the same seeded random sampler, so they evaluate the
same plans in the same order. The bf16 baseline is computed once beforehand and copied into
each run's cache (it is a one-off per model and suite, not a per-trial cost), while each run
starts with an empty XLA compilation cache, so the 2-worker run gains nothing from the first.
Steady-state rate = trials / (last trial's end - first trial's start), from Optuna's records.
`TENANTQ_BENCH_SMOKE=1` shrinks the defaults to one worker, two trials and a tiny suite.
`--efficiency` compares samplers on the cached 168-plan space instead (tenantq.search.efficiency).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from tenantq.model.terminal import text_table
from tenantq.testing import TINY_SUITE

PHASES = ("load", "quantize", "compile", "fidelity", "needles", "structured")
SMOKE_ENV = "TENANTQ_BENCH_SMOKE"  # the test suite's smoke run: one worker, a tiny suite
DEFAULT_SPEC = Path(__file__).resolve().parents[3] / "experiments" / "quickstart.toml"
EVAL_PHASES = ("fidelity", "needles", "structured")


def _spec(base: dict, folder: Path, trials: int, workers: int, suite: str):
    from tenantq.search.spec import parse_spec

    raw = json.loads(json.dumps(base))
    raw["study"].update(name=f"bench-{workers}w", trials=trials, storage=f"sqlite:///{folder}/o.db")
    raw["tracking"] = {"uri": f"sqlite:///{folder}/m.db", "experiment": f"bench-{workers}w"}
    raw["eval"] = {"suite": suite, "cache_dir": str(folder / "cache")}
    raw["sampler"] = {"kind": "random", "seed": 0}
    raw["workers"] = dict(raw.get("workers", {}), count=workers, cpus_per_worker=1)
    return parse_spec(raw), json.dumps(raw)


def _warm_baseline(model_path: Path, suite: str, cache: Path) -> float:
    from tenantq.evals import Evaluator

    start = time.perf_counter()
    Evaluator(model_path, suite, cache_dir=cache).baseline()
    return time.perf_counter() - start


def run_one(base: dict, workers: int, trials: int, suite: str, warm: Path, root: Path) -> dict:
    import optuna

    from tenantq.search.driver import SearchDriver

    folder = root / f"{workers}w"
    (folder / "cache").mkdir(parents=True)
    for f in warm.glob("baseline-*"):
        shutil.copy2(f, folder / "cache" / f.name)
    spec, text = _spec(base, folder, trials, workers, suite)
    began = time.perf_counter()
    SearchDriver(spec, text, progress=False, out_dir=folder / "out").run()
    wall_s = time.perf_counter() - began
    study = optuna.load_study(study_name=spec.study.name, storage=spec.study.storage)
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    measured = [t for t in done if "duplicate_of" not in t.user_attrs]
    if not done:
        errors = {t.user_attrs.get("error", "") for t in study.trials}
        raise RuntimeError(f"bench search: no trial completed with {workers} worker(s): {errors}")
    steady_s = (
        max(t.datetime_complete for t in done) - min(t.datetime_start for t in done)
    ).total_seconds()
    phases = {p: sum(t.user_attrs["timings_s"].get(p, 0.0) for t in measured) for p in PHASES}
    total = sum(t.user_attrs["timings_s"].get("total", 0.0) for t in measured)
    return {
        "workers": workers,
        "trials": len(done),
        "evaluated": len(measured),
        "wall_s": wall_s,
        "steady_s": steady_s,
        "trials_per_hour": 3600 * len(done) / steady_s,
        "trial_s_mean": total / max(len(measured), 1),
        "phase_share": {p: v / total for p, v in phases.items()} if total else {},
    }


def _int_list(flag: str, text: str, minimum: int) -> tuple[int, ...]:
    """A comma-separated list of integers >= `minimum`, or a one-line SystemExit naming `flag`."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < minimum:
        raise SystemExit(f"{flag} {text!r}: give comma-separated integers >= {minimum}, "
                         f"e.g. {flag} {minimum},{minimum + 1}")  # fmt: skip
    return values


def efficiency_main(argv: list[str]) -> int:
    """Sampler front coverage and hypervolume on a finite space's ground truth (the table in
    experiments/ground-truth/); `--measure` first measures (or resumes) the plans it lacks."""
    from tenantq.search.ground_truth import TRUTH_DIR

    p = argparse.ArgumentParser(prog="python -m tenantq.bench search --efficiency")
    p.add_argument("--efficiency", action="store_true")
    p.add_argument("--spec", default=str(DEFAULT_SPEC), help="deployment for the tenant count")
    p.add_argument(
        "--space",
        default="mlp-attn-kv",
        choices=("mlp-attn-kv", "per-layer"),
        help="mlp-attn-kv: 168 plans; per-layer: each layer's MLP x KV format (1,296 plans)",
    )
    p.add_argument(
        "--truth",
        default=None,
        help=f"ground-truth table (JSON lines; default: {TRUTH_DIR}/<space's table>)",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="read a per-plan JSON quality cache (the format before the table) instead",
    )
    p.add_argument(
        "--import-cache",
        default=None,
        metavar="DIR",
        help="add a per-plan JSON cache's rows to the table (hashes checked) before anything",
    )
    p.add_argument("--measure", action="store_true", help="measure plans missing from the table")
    p.add_argument("--measure-limit", type=int, default=None, help="measure at most N plans")
    p.add_argument("--measure-only", action="store_true", help="measure, then stop (no comparison)")
    p.add_argument("--batch", type=int, default=10, help="plans per atomic write of the table")
    p.add_argument("--budgets", default="10,20,25,40", help="evaluations per run")
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--samplers", default="random,nsga2,tpe,capacity_aware")
    p.add_argument(
        "--baselines", action="store_true", help="enqueue the driver's 3 baselines first"
    )
    p.add_argument(
        "--metric",
        default="fidelity.kl_mean",
        help="cached lower-is-better metric, or -KEY for higher-is-better",
    )
    p.add_argument(
        "--ask-cost",
        type=int,
        default=10,
        help="asks timed on Llama-3.1-8B's 32-layer per-tensor space (capacity preset); 0: skip",
    )
    p.add_argument(
        "--synthetic",
        type=int,
        default=None,
        metavar="SEED",
        help="a made-up KL on the space's real tenants instead of the cache (sampler development)",
    )
    p.add_argument(
        "--quickstart",
        action="store_true",
        help="hypervolume after each budget on the quickstart spec's own space (defaults: "
        "budgets 10,25; samplers capacity_aware,nsga2,tpe)",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from tenantq.search import efficiency as eff
    from tenantq.search import ground_truth as truth
    from tenantq.search.spec import SAMPLERS

    _int_list("--budgets", args.budgets, 1)
    _int_list("--seeds", args.seeds, 0)
    known = SAMPLERS if args.quickstart else eff.COMPARISON_SAMPLERS
    unknown = [k for k in args.samplers.split(",") if k not in known]
    if unknown:
        raise SystemExit(f"--samplers: {unknown[0]!r} is not a sampler of this comparison; "
                         f"choose from {','.join(known)}")  # fmt: skip
    if args.quickstart:
        return quickstart_main(args, argv)

    table = Path(args.truth) if args.truth else TRUTH_DIR / eff.TRUTH_TABLES[args.space]
    if args.synthetic is not None and args.space != "mlp-attn-kv":
        raise SystemExit(f"--synthetic: a made-up KL of the mlp-attn-kv space only, not "
                         f"--space {args.space}")  # fmt: skip
    cost = None
    if args.ask_cost and not args.measure_only:
        cost = eff.ask_cost(eff.preset_context(), args.ask_cost)
    if cost and not args.json:
        print(
            f"capacity_aware on llama-3.1-8b per-tensor (tpu-v6e, 8192 tokens): "
            f"{float(cost['plans']):.3g} plans, build {cost['build_s']:.2f} s, "
            f"{cost['ask_s_mean']:.3f} s per ask (max {cost['ask_s_max']:.3f} s, "
            f"{cost['asks']} asks; bytes exact: {cost['exact_bytes']})"
        )

    try:
        points, prep = eff.space_points(args.space, args.spec)
    except ValueError as e:  # a spec without its checkpoint, a space too large to enumerate
        raise SystemExit(f"--spec {args.spec}: {e}") from e
    if args.import_cache:
        keys = truth.current_keys(prep.model_path, eff.SUITE_PATH)
        rows = truth.read_table(table, model=keys[0], dataset=keys[1])
        imported = truth.rows_from_cache(eff.read_cache(args.import_cache), points)
        stale = [r for r in imported if (r["model"], r["dataset"]) != keys]
        if stale:
            raise SystemExit(
                f"--import-cache {args.import_cache}: {len(stale)} records were measured on "
                f"model {stale[0]['model'][:16]} / dataset {stale[0]['dataset'][:16]}, not "
                f"today's {keys[0][:16]} / {keys[1][:16]}; not imported"
            )
        # the table's own rows win over the cache's; merged under the table's lock
        # (a failed row of the table is no measurement: the cache's record replaces it)
        fresh = {r["fingerprint"]: r for r in imported
                 if "error" in rows.get(r["fingerprint"], {"error": "absent"})}  # fmt: skip
        truth.merge_into_table(table, fresh, model=keys[0], dataset=keys[1])
        print(f"{table}: {len(fresh)} of {len(imported)} cached plans imported (the rest held)")
    if args.measure:
        truth.measure(
            points, prep.model_path, table, suite=eff.SUITE_PATH, limit=args.measure_limit,
            batch_plans=args.batch, shuffle_seed=0 if args.space == "per-layer" else None,
            log=lambda s: print(s, flush=True),
        )  # fmt: skip
    if args.measure_only:
        return 0
    axes = eff.space_axes(args.space, prep.config)
    if args.synthetic is not None:
        land = eff.synthetic_landscape(points, args.synthetic)
    elif args.cache_dir:
        land = eff.Landscape.from_cache(points, eff.read_cache(args.cache_dir), args.metric, axes)
    else:
        keys = truth.current_keys(prep.model_path, eff.SUITE_PATH)
        rows = truth.read_table(table, model=keys[0], dataset=keys[1])
        failed = [fp for fp in dict.fromkeys(p.fingerprint for p in points)
                  if "error" in rows.get(fp, {})]  # fmt: skip
        if failed:  # ground_truth.measure's failed rows: no metrics, measured again next pass
            raise truth.TruthTableError(
                f"{table}: {len(failed)} of the space's plans have only a failed row (first "
                f"{failed[0]}: {rows[failed[0]]['error']}); measure them again (--measure)"
            )
        summaries = {fp: {"summary": r["metrics"]} for fp, r in rows.items()}
        try:
            land = eff.Landscape.from_cache(points, summaries, args.metric, axes)
        except ValueError as e:  # plans missing, a metric absent: the table's fault
            raise truth.TruthTableError(f"{table}: {e}") from e
    budgets = _int_list("--budgets", args.budgets, 1)
    if max(budgets) > len(land.loss):
        raise SystemExit(f"--budgets {args.budgets!r}: at most the space's {len(land.loss)} "
                         f"distinct plans")  # fmt: skip
    rows = eff.compare(
        land, prep.spec, budgets, _int_list("--seeds", args.seeds, 0),
        tuple(args.samplers.split(",")), baselines=args.baselines,
    )  # fmt: skip
    summary = eff.summarize(rows)
    front = eff.pareto_front(land.all_points())
    if args.json:
        if cost:
            cost["plans"] = float(cost["plans"])
        out = {"front": front, "summary": summary, "runs": rows, "ask_cost": cost}
        print(json.dumps(out, indent=2))
        return 0
    source = (
        f"synthetic KL (seed {args.synthetic})"
        if args.synthetic is not None
        else f"{args.metric} from {args.cache_dir or table}"
    )
    print(
        f"search efficiency: {len(points)} plans ({len(land.loss)} distinct fingerprints), "
        f"{len({p.tenants for p in points})} tenant levels, exhaustive front of {len(front)} "
        f"levels; quality = {source}; baselines "
        f"{'enqueued first' if args.baselines else 'not given'}"
    )
    print(eff.render_table(summary))
    return 0


def quickstart_main(args, argv: list[str]) -> int:
    """`--efficiency --quickstart`: measured-front hypervolume per sampler, seed and budget."""
    import numpy as np

    from tenantq.search import efficiency as eff
    from tenantq.search.ground_truth import TRUTH_DIR

    budgets = args.budgets if "--budgets" in argv else "10,25"
    samplers = args.samplers if "--samplers" in argv else "capacity_aware,nsga2,tpe"
    rows = eff.quickstart_hypervolume(
        args.spec, tuple(samplers.split(",")), tuple(int(s) for s in args.seeds.split(",")),
        tuple(int(b) for b in budgets.split(",")),
        table=Path(args.truth) if args.truth else TRUTH_DIR / eff.QUICKSTART_TABLE,
        log=lambda s: print(s, flush=True) if not args.json else None,
    )  # fmt: skip
    if args.json:
        print(json.dumps({"runs": rows}, indent=2))
        return 0
    print("measured-front hypervolume in (tenants, log10 KL), mean +- sd over seeds")
    for kind in dict.fromkeys(r["sampler"] for r in rows):
        cells = []
        for b in sorted({r["budget"] for r in rows}):
            hv = [r["hypervolume"] for r in rows if r["sampler"] == kind and r["budget"] == b]
            cells.append(f"@{b}: {np.mean(hv):.2f} +- {np.std(hv):.2f}")
        print(f"{kind:>16}  " + "   ".join(cells))
    return 0


def main(argv: list[str]) -> int:
    if "--efficiency" in argv:
        from tenantq.search.ground_truth import TruthTableError

        try:
            return efficiency_main(argv)
        except TruthTableError as e:  # stale, damaged or incomplete table: one line, no trace
            print(f"error: {e}", file=sys.stderr)
            return 2
    p = argparse.ArgumentParser(prog="python -m tenantq.bench search", description=__doc__)
    smoke = os.environ.get(SMOKE_ENV) == "1"
    p.add_argument("--spec", default=str(DEFAULT_SPEC))
    p.add_argument("--trials", type=int, default=2 if smoke else 6)
    p.add_argument("--suite", default=None, help="suite name or TOML (default: quick)")
    p.add_argument("--workers", default="1" if smoke else "1,2", help="worker counts")
    p.add_argument(
        "--synthetic",
        type=int,
        default=None,
        metavar="SEED",
        help="a made-up KL on the space's real tenants instead of the cache (sampler development)",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from tenantq.search.spec import parse_spec

    base = tomllib.loads(Path(args.spec).read_text())
    if smoke and args.suite is None:  # the tiny suite measures fidelity only
        base["objectives"] = [
            {"metric": "tenants", "direction": "maximize"},
            {"metric": "fidelity.kl_mean", "direction": "minimize"},
        ]
    spec = parse_spec(base, args.spec)
    counts = [int(x) for x in args.workers.split(",")]
    with tempfile.TemporaryDirectory(prefix="tenantq-bench-search-") as tmp:
        root = Path(tmp)
        if args.suite is None and smoke:
            args.suite = str(root / "smoke_suite.toml")
            Path(args.suite).write_text(TINY_SUITE)
        args.suite = args.suite or "quick"
        warm = root / "warm"
        baseline_s = _warm_baseline(spec.model_path(), args.suite, warm)
        rows = [run_one(base, w, args.trials, args.suite, warm, root) for w in counts]
    first = rows[0]["trials_per_hour"]
    for r in rows:
        r["speedup"] = r["trials_per_hour"] / first
    if args.json:
        print(json.dumps({"baseline_s": baseline_s, "runs": rows}, indent=2))
        return 0
    print(
        f"search bench: {args.spec}, suite {args.suite}, {args.trials} trials per run, "
        f"{os.cpu_count()} CPUs; bf16 baseline computed once beforehand in {baseline_s:.1f} s"
    )
    head = [
        "workers",
        "trials",
        "evaluated",
        "wall s",
        "steady s",
        "trials/h",
        "speedup",
        "s/trial",
    ]
    body = [
        [
            f"{r['workers']}",
            f"{r['trials']}",
            f"{r['evaluated']}",
            f"{r['wall_s']:.1f}",
            f"{r['steady_s']:.1f}",
            f"{r['trials_per_hour']:.1f}",
            f"{r['speedup']:>6.2f}x",
            f"{r['trial_s_mean']:.1f}",
        ]  # fmt: skip
        for r in rows
    ]
    widths = [7, 6, 9, 8, 8, 9, 7, 8]
    print("\n".join(text_table(head, body, widths=widths, right=True, sep=" ")))
    print("\nshare of evaluated trial time (sum over trials)")
    share = [
        [f"{r['workers']}"]
        + [f"{100 * r['phase_share'].get(p, 0):>9.1f}%" for p in PHASES]
        + [f"{100 * sum(r['phase_share'].get(p, 0) for p in EVAL_PHASES):>9.1f}%"]
        for r in rows
    ]
    widths = [7] + [10] * (len(PHASES) + 1)
    print("\n".join(text_table(["workers", *PHASES, "eval"], share, widths=widths, right=True,
                               sep=" ")))  # fmt: skip
    return 0
