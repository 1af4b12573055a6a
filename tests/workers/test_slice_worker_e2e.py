"""Slice workers with real Ray actors: 2 host processes x 1 CPU device joined by
`jax.distributed` into one 2-device program per trial (the reference model has 2 KV heads,
so tp = 2 is its widest layout).

A study on one such slice completes, losing host 1 of its gang on the int4 baseline once:
the trial is retried by the slice on a fresh gang (not failed, not retried by the ledger),
and the lost gang's actors and placement group are gone. The lost host empties its baseline
cache first (a replaced VM's disk), so the fresh gang's hosts must agree to compute it anew
rather than one loading it while the other waits in a collective.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import optuna
import pytest

from tenantq.search.spec import parse_spec
from tenantq.testing import tiny_study_spec

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# tests/search/tiny_suite.toml at half its rows and row length: what is under test is the gang
SUITE = """seed = 0
split = "search"
resamples = 100
[fidelity]
rows = 2
row_tokens = 64
[[gates]]
metric = "fidelity.kl_mean"
tolerance = 0.01
higher_is_better = false
"""
SLICE = '[workers]\nkind = "cpu_slice"\ncpu_slice_hosts = 2\ncpu_devices_per_host = 1\n'


def _slice_spec(tmp: Path, trials: int):
    suite = tmp / "suite.toml"
    suite.write_text(SUITE)
    text = tiny_study_spec(tmp, name="slice", trials=trials, suite=suite, workers=1)
    # tp = 2 splits o_proj's 192 input rows in shards of 96: int4 groups of 32 fit them
    text = text.replace("group_size = 64", "group_size = 32")
    text = text.replace("[deployment]", "[deployment]\nchips = 2")
    text = text.replace("[workers]\n", SLICE)
    return parse_spec(tomllib.loads(text)), text


def test_a_study_on_a_slice_completes_and_a_lost_host_retries_the_trial_on_a_new_gang(
    tmp_path, monkeypatch
):
    from tenantq.search.driver import SearchDriver
    from tenantq.workers.faults import SliceLosingAHostOnce

    monkeypatch.chdir(tmp_path)
    deaths = tmp_path / "deaths.log"
    monkeypatch.setenv("TENANTQ_FAULT_LOG", str(deaths))  # Ray's workers inherit it
    spec, text = _slice_spec(tmp_path, trials=3)  # bf16, fp8, int4 baselines
    assert spec.workers.kind == "cpu_slice" and spec.workers.count == 1
    driver = SearchDriver(
        spec, text, progress=False, out_dir=tmp_path / "out", worker_class=SliceLosingAHostOnce
    )
    outcome = driver.run()
    assert outcome.counts["done"] == 3
    study = optuna.load_study(study_name="slice", storage=f"sqlite:///{tmp_path}/optuna.db")
    trials = study.trials
    # every trial completed, the int4 one included: the slice retried it, the ledger did not
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 3
    assert len(deaths.read_text().splitlines()) == 1  # host 1 died once, mid-trial
    slices = [t.user_attrs["slice"] for t in trials]
    assert all(s["hosts"] == 2 and s["devices"] == 2 for s in slices)
    assert len(set(slices[0]["host_pids"])) == 2  # two processes ran one program
    assert [s["generation"] for s in slices] == [1, 1, 2]  # the int4 trial: a fresh gang
    assert slices[2]["gangs_lost"] == ["gang g1: ActorDiedError"]
    # the lost gang's placement group was removed: no half gang holds the hosts' resources
    assert slices[2]["placement_groups"] == ["REMOVED", "CREATED"]
    assert slices[2]["host_pids"][1] not in slices[0]["host_pids"]
    # host 1's cache was emptied: both hosts of the new gang computed the baseline again
    assert all(len(list((tmp_path / "cache" / f"host-{i}").glob("baseline-*"))) for i in (0, 1))
