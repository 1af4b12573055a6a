"""`python -m tenantq.bench driver`: the study driver's own cost per trial, and its growth.

The workers are `InProcessPool` slots that answer at once with a closed-form quality (no JAX,
no Ray), Optuna keeps the study in memory and MLflow is replaced by a tracker that writes
nothing, so what is timed is the driver: ask (random sampler), plan and exact budget, the
ledger, tell, the loop, and the front at the end. Reported: ms per trial at 1,000 and 10,000
trials with 1 and 100 simulated workers (wall and CPU time, and the CPU time less the plan's
own exact budget: the driver's overhead), and the ratio 10,000 : 1,000 (1.0 = no growth with
the size of the study). `--stores sqlite` times the same on Optuna sqlite and MLflow sqlite.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

SPEC = """
model = "reference"
[[objectives]]
metric = "tenants"
direction = "maximize"
[[objectives]]
metric = "fidelity.kl_mean"
direction = "minimize"
[deployment]
hardware = "cpu"
memory = "9830KiB"
context_tokens = 256
[space]
kind = "per_tensor"
[eval]
suite = "quick"
[sampler]
kind = "random"
seed = 0
[study]
name = "bench-driver"
trials = {trials}
baselines = false
storage = "sqlite:///{folder}/optuna.db"
[tracking]
uri = "sqlite:///{folder}/mlflow.db"
"""


class NullTracker:
    """`StudyTracker`'s surface, writing nothing (remembers which trials it was given)."""

    parent_run_id = "bench"

    def __init__(self) -> None:
        self.logged: dict[int, tuple[str, str]] = {}

    def start_study(self, *a, **k) -> str:
        return self.parent_run_id

    def resume_study(self, run_id: str) -> None:
        pass

    def end_study(self, *a, **k) -> None:
        pass

    def log_trial(self, number: int, **kw) -> str:
        self.logged[number] = (str(number), "FINISHED")
        return str(number)

    def trial_runs(self, *, with_status: bool = False):
        if with_status:
            return {n: [v] for n, v in self.logged.items()}
        return {n: v[0] for n, v in self.logged.items()}

    def tag(self, *a) -> None:
        pass

    def log_metrics(self, *a) -> None:
        pass

    def log_artifact(self, *a) -> None:
        pass

    def log_files(self, *a) -> None:
        pass

    def delete_run(self, run_id: str) -> None:
        pass


def run_one(trials: int, workers: int, stores: str, root: Path) -> dict:
    import tomllib

    import optuna

    from tenantq.search.driver import SearchDriver
    from tenantq.search.spec import parse_spec
    from tenantq.workers.inprocess import InProcessPool

    folder = root / f"{stores}-{trials}-{workers}"
    folder.mkdir(parents=True)
    text = SPEC.format(trials=trials, folder=folder)
    spec = parse_spec(tomllib.loads(text))

    class BenchDriver(SearchDriver):
        def _connect_tracking(self):
            return NullTracker() if stores == "memory" else super()._connect_tracking()

    storage = optuna.storages.InMemoryStorage() if stores == "memory" else None
    driver = BenchDriver(
        spec,
        text,
        workers=workers,
        progress=False,
        out_dir=folder / "out",
        storage=storage,
        pool_factory=lambda d: InProcessPool(count=d.workers),
    )
    start, cpu_start = time.perf_counter(), time.process_time()
    outcome = driver.run()
    wall_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    # The exact budget of each plan is the capacity measurement itself, not overhead: timed
    # apart on the study's own parameters (up to 200 of them).
    sample = [t.params for t in driver.study.get_trials(deepcopy=False)[:200]]
    began, cpu_began = time.perf_counter(), time.process_time()
    for params in sample:
        driver.context.plan_and_budget(params)
    budget_ms = 1000 * (time.perf_counter() - began) / max(1, len(sample))
    budget_cpu_ms = 1000 * (time.process_time() - cpu_began) / max(1, len(sample))
    asks = max(1, outcome.counts["asks"])
    return {
        "trials": trials,
        "workers": workers,
        "stores": stores,
        "plans": outcome.counts["done"],
        "asks": outcome.counts["asks"],
        "wall_s": round(wall_s, 2),
        "ms_per_trial": round(1000 * wall_s / asks, 3),
        "plan_and_budget_ms": round(budget_ms, 3),
        # CPU time of this process: what the driver itself spends, less sensitive than wall
        # time to other processes on a loaded machine
        "cpu_ms_per_trial": round(1000 * cpu_s / asks, 3),
        "plan_and_budget_cpu_ms": round(budget_cpu_ms, 3),
        "overhead_cpu_ms": round(1000 * cpu_s / asks - budget_cpu_ms, 3),
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m tenantq.bench driver", description=__doc__)
    # The test suite's smoke run (TENANTQ_BENCH_SMOKE): the same code at a size of seconds.
    smoke = os.environ.get("TENANTQ_BENCH_SMOKE", "") not in ("", "0")
    p.add_argument("--trials", type=int, nargs="+", default=[20, 40] if smoke else [1000, 10000])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 4] if smoke else [1, 100])
    p.add_argument("--stores", choices=["memory", "sqlite"], default="memory")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for workers in args.workers:
            for trials in args.trials:
                rows.append(run_one(trials, workers, args.stores, Path(tmp)))
                if not args.json:
                    r = rows[-1]
                    print(
                        f"{r['stores']:6s} {r['workers']:4d} workers {r['trials']:6d} trials: "
                        f"{r['ms_per_trial']:7.3f} ms/trial ({r['asks']} asks, {r['plans']} "
                        f"plans, {r['wall_s']} s; of which plan + exact budget "
                        f"{r['plan_and_budget_ms']:.3f} ms/trial); CPU "
                        f"{r['cpu_ms_per_trial']:.3f} ms/trial, of which plan + exact budget "
                        f"{r['plan_and_budget_cpu_ms']:.3f}: driver overhead "
                        f"{r['overhead_cpu_ms']:.3f} ms/trial",
                        flush=True,
                    )
    small, large = min(args.trials), max(args.trials)
    ratios = {}
    for workers in args.workers:
        by = {r["trials"]: r["ms_per_trial"] for r in rows if r["workers"] == workers}
        if small != large:
            ratios[workers] = round(by[large] / by[small], 2)
            if not args.json:
                print(f"ratio {large}:{small} with {workers} workers: {ratios[workers]}")
    if args.json:
        print(json.dumps({"rows": rows, "ratios": ratios}, indent=2))
    return 0
