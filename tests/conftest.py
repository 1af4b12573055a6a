"""Suite-wide test setup: the shared tiny model's fixtures (`config`, `params`, `tokenizer`,
`make_config`, from `tenantq.testing`), CPU JAX by default, the `device` marker's skip rule,
the serial xdist group (e2e and tests/cluster), one XLA compilation cache that every study's
Ray workers share (a study compiles what an earlier one already compiled otherwise: about
half a cold trial's time on 2 cores), and the real studies that the report tests and the search's
failed-trial test read (`studies`).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from _cwd_guard import nothing_written_to_the_current_folder  # noqa: F401 (autouse)
from _serial_group import register as register_serial_group

# The driver and the tests run JAX on the CPU unless a device test asks otherwise.
os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture(scope="session", autouse=True)
def shared_worker_xla_cache(tmp_path_factory) -> Iterator[Path]:
    """Ray workers started in this session keep compiled executables in one folder
    (`tenantq.workers.host.XLA_CACHE_ENV`); set beforehand, the variable is kept as it is."""
    from tenantq.workers.host import XLA_CACHE_ENV

    folder = os.environ.get(XLA_CACHE_ENV) or str(tmp_path_factory.mktemp("worker-xla"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(XLA_CACHE_ENV, folder)
        yield Path(folder)


@pytest.fixture(scope="session")
def make_config():
    """`make_config(**overrides)`: `tenantq.testing`'s tiny config with some fields changed."""
    from tenantq.testing import tiny_config

    return tiny_config


@pytest.fixture(scope="session")
def config():
    """The shared tiny model's config (`tenantq.testing.tiny_config`)."""
    from tenantq.testing import tiny_config

    return tiny_config()


@pytest.fixture(scope="session")
def params(config):
    """Random float32 params of `config` (`tenantq.testing.tiny_params`, seed 0)."""
    from tenantq.testing import tiny_params

    return tiny_params(config, seed=0)


@pytest.fixture(scope="session")
def tokenizer():
    """The character-level tokenizer whose ids fit the tiny config (`tiny_tokenizer`)."""
    from tenantq.testing import tiny_tokenizer

    return tiny_tokenizer()


def _has_accelerator() -> bool:
    if os.environ.get("JAX_PLATFORMS", "") == "cpu":
        return False
    try:
        import jax

        return any(d.platform != "cpu" for d in jax.devices())
    except Exception:  # no backend at all: no accelerator
        return False


def pytest_configure(config: pytest.Config) -> None:
    # `make test` runs on two pytest-xdist workers (`-n 2 --dist loadgroup`): every `e2e` test
    # and everything under tests/cluster/ in one group, `serial`, on one worker (_serial_group).
    register_serial_group(config, Path(__file__).parent / "cluster")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any("device" in item.keywords for item in items) and not _has_accelerator():
        skip = pytest.mark.skip(reason="needs an accelerator (GPU/TPU); JAX sees only CPUs here")
        for item in items:
            if "device" in item.keywords:
                item.add_marker(skip)


# ---------------------------------------------------------------- real studies
# Ray local, real HostWorkers on the shipped reference model, Optuna and MLflow on sqlite in a
# tmp dir; the suite (report/report_suite.toml) is the smallest that feeds every report figure.
# Three studies in one MLflow store and one Optuna storage: `report` (3 trials: the baselines
# bf16, fp8/fp8 and int4/bf16), `failing` (tenantq.workers.faults.FailQuantizedTrials: every
# quantized trial raises in the worker; the report's failed-trial figures and the search's
# failed-trial bookkeeping both read it) and `single` (1 trial). Built once per session, when a
# test first asks for it. TENANTQ_REPORT_STUDIES=DIR reuses (or builds once into) DIR, for
# iterating on these tests.
REPORT_SUITE = Path(__file__).parent / "report" / "report_suite.toml"


@dataclass(frozen=True)
class Studies:
    root: Path
    tracking_uri: str
    optuna_url: str


def run_study(
    tmp: Path, name: str, trials: int, worker_class: type | None = None, workers: int = 2
) -> None:
    from tenantq.search.driver import SearchDriver
    from tenantq.search.spec import parse_spec
    from tenantq.testing import tiny_study_spec

    text = tiny_study_spec(
        tmp,
        name=name,
        trials=trials,
        suite=REPORT_SUITE,
        objectives=("tenants", "fidelity.kl_mean", "needle.acc_delta.len256"),
        workers=workers,
    )
    spec = parse_spec(tomllib.loads(text))
    out = tmp / "runs" / name
    SearchDriver(spec, text, progress=False, out_dir=out, worker_class=worker_class).run()


@pytest.fixture(scope="session")
def studies(tmp_path_factory) -> Studies:
    import ray

    from tenantq.workers.faults import FailQuantizedTrials

    reuse = os.environ.get("TENANTQ_REPORT_STUDIES")
    tmp = Path(reuse) if reuse else tmp_path_factory.mktemp("studies")
    if reuse and (tmp / "mlflow.db").is_file():
        return Studies(tmp, f"sqlite:///{tmp}/mlflow.db", f"sqlite:///{tmp}/optuna.db")
    tmp.mkdir(parents=True, exist_ok=True)
    started = not ray.is_initialized()  # a module's own Ray (tests/search) is reused
    if started:
        ray.init(num_cpus=2, include_dashboard=False, namespace="tenantq", log_to_driver=False)
    try:
        # In tmp: MLflow's sqlite store puts the artifacts in ./mlruns (recorded as absolute
        # paths, so the tests read them from anywhere), not in the checkout beside another run's.
        with pytest.MonkeyPatch.context() as patch:
            patch.chdir(tmp)
            run_study(tmp, "report", trials=3)  # two workers: the timeline has two lanes
            # One worker each: a failing trial ends at once and one trial needs no second one.
            run_study(tmp, "failing", trials=3, worker_class=FailQuantizedTrials, workers=1)
            run_study(tmp, "single", trials=1, workers=1)
    finally:
        if started:
            ray.shutdown()
    return Studies(tmp, f"sqlite:///{tmp}/mlflow.db", f"sqlite:///{tmp}/optuna.db")
