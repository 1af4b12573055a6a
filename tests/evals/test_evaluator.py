"""The Evaluator end to end on the shipped reference model, with a small suite.

Bounds: the baseline against itself must give KL exactly 0 and zero flips (the same
executable on the same inputs is deterministic); verdict thresholds come from the suite.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from tenantq.evals import Evaluator, fidelity, load_suite
from tenantq.evals.suite import suite_metrics
from tenantq.quant.plan import KVPlan, QuantPlan, Rule
from tenantq.reference import reference_model_path

SMALL_SUITE = """
seed = 0
resamples = 2000
[fidelity]
rows = 4
row_tokens = 256
[[needles]]
variant = "single"
lengths = [256]
per_length = 8
[structured]
tasks = ["close_line"]
per_task = 8
[[gates]]
metric = "fidelity.kl_mean"
tolerance = 0.01
higher_is_better = false
[[gates]]
metric = "needle.acc_delta.len256"
tolerance = 0.35
higher_is_better = true
"""
# 0.35: with 8 needles and no flip at all, Tango's 95% lower bound is -0.324 (stats), so a
# tighter tolerance could never show non-inferiority (the evaluator would warn so).


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("evals")
    path = root / "small.toml"
    path.write_text(SMALL_SUITE)
    evaluator = Evaluator(reference_model_path(), load_suite(path), cache_dir=root / "cache")
    return evaluator, root


@pytest.mark.slow
def test_baseline_against_itself_is_no_change(small) -> None:
    evaluator, root = small
    result = evaluator.evaluate(QuantPlan())
    s = result.summary
    assert s["fidelity.kl_mean"] == 0.0 and s["fidelity.kl_mean.ci_high"] == 0.0
    assert s["fidelity.top1_agree"] == 1.0 and s["fidelity.ppl_ratio"] == 1.0
    for key, value in s.items():
        if ".flips." in key:
            assert value == 0, key
    assert all(g.verdict == "non-inferior" and not g.changed for g in result.gates.values())
    assert all(g.constraint <= 0 for g in result.gates.values())
    assert s["verdict.needle.acc_delta.len256"] == "non-inferior"
    assert s["changed.needle.acc_delta.len256"] == "no"
    # no flip still leaves an interval: Tango's +-z^2 / (n + z^2) = +-0.324 at n = 8
    assert s["needle.acc_delta.len256.ci_low"] == pytest.approx(-0.3244, abs=1e-3)
    # the suite's 60% bar: exactly the groups whose bf16 pass rate is below it are named
    rates = {"needle.len256": s["needle.acc_base.len256"],
             "structured.close_line": s["structured.acc_base.close_line"]}  # fmt: skip
    for group, rate in rates.items():
        assert (f"warning.{group}" in s) == (rate < 0.6), (group, rate)
    assert not any(k.startswith("warning.gate.") for k in s)
    assert result.examples.num_rows == 4 + 8 + 8
    # one baseline margin per recorded token: a right needle answer records its 5 digits, a
    # wrong one ends at its first wrong digit (teacher-forced: greedy's later tokens unknown)
    rows = result.examples.to_pylist()
    for r in (r for r in rows if r["task"] == "needle"):
        n = len(r["baseline_tokens"])
        assert len(r["baseline_margins"]) == n
        assert n == 5 if r["baseline_score"] == 1.0 else 1 <= n <= 5
    assert all(r["margin"] == min(r["baseline_margins"]) for r in rows if r["task"] == "needle")
    assert set(result.timings_s) >= {"load", "quantize", "compile", "baseline", "fidelity",
                                     "needles", "structured", "total"}  # fmt: skip
    # The suite's metric catalogue (what `tenantq search --check` validates objectives and
    # constraints against) names exactly the numeric keys an evaluation reports.
    numeric = {k for k, v in s.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    assert numeric == set(suite_metrics(evaluator.suite))
    # MLflow metric names: letters, digits and _ - . / only
    assert all(set(k) <= set("abcdefghijklmnopqrstuvwxyz0123456789_-./") for k in s)
    out = result.to_parquet(root / "examples.parquet")
    table = pq.read_table(out)
    assert table.num_rows == 20
    assert json.loads(table.schema.metadata[b"tenantq.summary"])["fidelity.kl_mean"] == 0.0


@pytest.mark.slow
def test_second_evaluator_reads_the_cached_baseline(small, monkeypatch) -> None:
    evaluator, root = small
    first = evaluator.baseline()
    files = sorted(p.name for p in (root / "cache").iterdir())
    assert len(files) == 2 and all(f.endswith(".parquet") for f in files)

    def refuse(*args, **kwargs):
        raise AssertionError("the baseline was recomputed instead of read from the cache")

    monkeypatch.setattr(fidelity, "compute_baseline", refuse)
    monkeypatch.setattr(Evaluator, "_generate", refuse)
    again = Evaluator(reference_model_path(), evaluator.suite, cache_dir=root / "cache")
    second = again.baseline()
    np.testing.assert_array_equal(np.asarray(first["fidelity"].logp),
                                  np.asarray(second["fidelity"].logp))  # fmt: skip
    assert [g.tokens for g in first["generations"]] == [g.tokens for g in second["generations"]]


FIDELITY_SUITE = """
resamples = 2000
[fidelity]
rows = 4
row_tokens = 256
[[gates]]
metric = "fidelity.kl_mean"
tolerance = 0.01
higher_is_better = false
"""


@pytest.mark.slow
def test_damaging_plan_is_not_shown_non_inferior_and_harmless_one_is(tmp_path) -> None:
    path = tmp_path / "fidelity.toml"
    path.write_text(FIDELITY_SUITE)
    evaluator = Evaluator(reference_model_path(), load_suite(path), cache_dir=tmp_path)
    # fp8 weights, one scale per output channel: KL ~0.001 on this model (README table).
    harmless = evaluator.evaluate(QuantPlan(rules=(Rule(".*", "fp8_e4m3"),)))
    assert harmless.gates["fidelity.kl_mean"].verdict == "non-inferior"
    # int4 keys and values with a per-token key scale and every weight in int4: KL is
    # tens of times the 0.01 tolerance (README table).
    damaging = evaluator.evaluate(
        QuantPlan(
            rules=(Rule(".*", "int4"),),
            kv=KVPlan(key_format="int4", key_axis="token", value_format="int4"),
        )
    )
    gate = damaging.gates["fidelity.kl_mean"]
    assert gate.verdict == "not shown non-inferior" and gate.constraint > 0 and gate.changed
    assert damaging.summary["verdict.fidelity.kl_mean"] == "not shown non-inferior"
    assert damaging.summary["changed.fidelity.kl_mean"] == "yes"


def test_gate_on_an_unmeasured_metric_is_refused(tmp_path) -> None:
    path = tmp_path / "s.toml"
    path.write_text(
        '[fidelity]\nrows = 2\nrow_tokens = 64\n[[gates]]\nmetric = "needle.acc_delta.len99"\n'
        "tolerance = 0.1\nhigher_is_better = true\n"
    )
    with pytest.raises(ValueError, match="does not measure"):
        Evaluator(reference_model_path(), load_suite(path), cache_dir=tmp_path)
