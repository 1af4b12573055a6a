"""The ledger with real Ray workers on the shipped reference model: a worker that hangs on a
plan hits the trial's deadline, and a plan that kills its worker every time is tried at most
its failure budget while the study, on one worker, completes (issue 22, faults 7 and 8).

The bad plan is the int4 baseline (the third plan the driver enqueues): the bf16 and fp8
baselines complete, so with `trials = 3` the study ends once the int4 plan is settled as
failed. Budget: 1 + max_trial_retries attempts (1 in the deadline test, 2 in the other).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import optuna
import pytest

from tenantq.search.driver import SearchDriver
from tenantq.search.spec import parse_spec
from tenantq.testing import tiny_study_spec
from tenantq.workers.faults import DieOnInt4Weights, InstantUnlessInt4Weights

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SUITE = Path(__file__).with_name("tiny_suite.toml")
S = optuna.trial.TrialState


def _spec(tmp: Path, extra_study: str = "", extra_workers: str = ""):
    text = tiny_study_spec(tmp, name="bad", trials=3, suite=SUITE, workers=1)
    text = text.replace("[study]", f"[study]\n{extra_study}")
    if extra_workers:
        text = text.replace("[workers]", f"[workers]\n{extra_workers}")
    return parse_spec(tomllib.loads(text)), text


def _failures(tmp: Path) -> tuple[list, dict[str, int]]:
    trials = optuna.load_study(study_name="bad", storage=f"sqlite:///{tmp}/optuna.db").trials
    per_plan: dict[str, int] = {}
    for t in trials:
        if t.state == S.FAIL:
            fp = t.user_attrs["plan_fingerprint"]
            per_plan[fp] = per_plan.get(fp, 0) + 1
    return trials, per_plan


def test_a_hanging_worker_hits_the_deadline_and_the_study_completes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # 15 s: the other plans return fixed metrics at once (no model, no compile: a real trial's
    # first compile took up to ~40 s on two loaded cores, so the deadline was 90 s); the hung
    # plan would sleep an hour. No retry (budget 1): one deadline is what is under test, the
    # budget is the next test's.
    spec, text = _spec(tmp_path, "trial_timeout = 15\nmax_trial_retries = 0")
    outcome = SearchDriver(
        spec, text, progress=False, out_dir=tmp_path / "out",
        worker_class=InstantUnlessInt4Weights,
    ).run()  # fmt: skip
    trials, per_plan = _failures(tmp_path)
    assert outcome.counts["done"] == 3
    assert [t.state for t in trials[:2]] == [S.COMPLETE, S.COMPLETE]
    assert list(per_plan.values()) == [1]
    assert {t.user_attrs["failure_reason"] for t in trials if t.state == S.FAIL} == {"timeout"}


def test_a_plan_that_kills_its_worker_is_tried_at_most_its_budget_with_one_worker(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    # The spec's defaults (max_restarts = 2, max_task_retries = 0): Ray's task retries used
    # to default to 2, so each of the ledger's 2 attempts ran up to 3 times (6 deaths).
    deaths = tmp_path / "deaths.log"
    monkeypatch.setenv("TENANTQ_FAULT_LOG", str(deaths))  # Ray's workers inherit it
    spec, text = _spec(tmp_path)
    assert spec.workers.count == 1 and spec.workers.max_task_retries == 0
    outcome = SearchDriver(
        spec, text, progress=False, out_dir=tmp_path / "out", worker_class=DieOnInt4Weights
    ).run()
    trials, per_plan = _failures(tmp_path)
    assert outcome.counts["done"] == 3
    assert list(per_plan.values()) == [2]
    assert {t.user_attrs["failure_reason"] for t in trials if t.state == S.FAIL} == {"worker_died"}
    # the plan ran (and killed a worker) exactly its 2 attempts, not 2 x (1 + Ray's retries)
    assert len(deaths.read_text().splitlines()) == 2
