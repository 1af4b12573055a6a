"""Real studies for the report tests, made by the search platform's own driver.

Ray local, real HostWorkers on the shipped reference model, Optuna and MLflow on sqlite in a
tmp dir; the suite (report_suite.toml) is the smallest that feeds every figure. Three studies
in one MLflow store and one Optuna storage: `report` (3 trials: the baselines bf16, fp8/fp8
and int4/bf16), `failing` (GPTQ without calibration statistics: every quantized trial raises in
the worker) and `single` (1 trial). Built once per session: 3-8 minutes on 2 shared cores.
TENANTQ_REPORT_STUDIES=DIR reuses (or builds once into) DIR, for iterating on these tests.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from tenantq.workers.faults import FailQuantizedTrials

SUITE = Path(__file__).with_name("report_suite.toml")


@dataclass(frozen=True)
class Studies:
    root: Path
    tracking_uri: str
    optuna_url: str


def run_study(tmp: Path, name: str, trials: int, worker_class: type | None = None) -> None:
    from tenantq.search.driver import SearchDriver
    from tenantq.search.spec import parse_spec
    from tenantq.testing import tiny_study_spec

    text = tiny_study_spec(
        tmp,
        name=name,
        trials=trials,
        suite=SUITE,
        objectives=("tenants", "fidelity.kl_mean", "needle.acc_delta.len256"),
    )
    spec = parse_spec(tomllib.loads(text))
    out = tmp / "runs" / name
    SearchDriver(spec, text, progress=False, out_dir=out, worker_class=worker_class).run()


@pytest.fixture(scope="session")
def studies(tmp_path_factory) -> Studies:
    import ray

    reuse = os.environ.get("TENANTQ_REPORT_STUDIES")
    tmp = Path(reuse) if reuse else tmp_path_factory.mktemp("studies")
    if reuse and (tmp / "mlflow.db").is_file():
        return Studies(tmp, f"sqlite:///{tmp}/mlflow.db", f"sqlite:///{tmp}/optuna.db")
    tmp.mkdir(parents=True, exist_ok=True)
    ray.init(num_cpus=2, include_dashboard=False, namespace="tenantq", log_to_driver=False)
    try:
        run_study(tmp, "report", trials=3)
        run_study(tmp, "failing", trials=3, worker_class=FailQuantizedTrials)
        run_study(tmp, "single", trials=1)
    finally:
        ray.shutdown()
    return Studies(tmp, f"sqlite:///{tmp}/mlflow.db", f"sqlite:///{tmp}/optuna.db")
