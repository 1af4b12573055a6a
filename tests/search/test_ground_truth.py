"""The ground-truth table (tenantq.search.ground_truth): batches written atomically, a killed
pass resumed from the last written batch, a table of another model or dataset refused. Unit
tests with a stand-in Evaluator (no JAX); the bench reading the table is in test_efficiency.py.
"""

from __future__ import annotations

import json

import pytest

from tenantq.quant.plan import QuantPlan, Rule
from tenantq.search.efficiency import SpacePoint
from tenantq.search.ground_truth import (
    StaleTruthError,
    measure,
    read_table,
    rows_from_cache,
    write_table,
)

MODEL, DATASET = "m" * 64, "d" * 64


def _points(n: int) -> list[SpacePoint]:
    plans = [QuantPlan(rules=(Rule(f"layers/{i}/mlp/down_proj", "int4", group_size=64),))
             for i in range(n)]  # fmt: skip
    return [SpacePoint(("int4", str(i)), p.fingerprint(), 10 + i, p.to_json())
            for i, p in enumerate(plans)]  # fmt: skip


class _Result:
    def __init__(self, kl: float):
        self.summary = {"fidelity.kl_mean": kl, "fidelity.kl_mean.ci_low": kl / 2,
                        "suite.name": "x", "identity.plan": "p"}  # fmt: skip
        self.timings_s = {"total": 0.0}


class _Evaluator:
    """Counts evaluations; raises KeyboardInterrupt (a kill) at evaluation `die_at`."""

    def __init__(self, model=MODEL, dataset=DATASET, die_at: int | None = None):
        self.identity, self.dataset_hash, self.die_at = model, dataset, die_at
        self.calls: list[str] = []

    def evaluate(self, plan):
        if self.die_at is not None and len(self.calls) + 1 == self.die_at:
            raise KeyboardInterrupt
        self.calls.append(plan.fingerprint())
        return _Result(0.001 * len(self.calls))


def test_a_pass_killed_mid_batch_resumes_from_the_last_written_batch(tmp_path):
    # 7 plans in batches of 3, killed while evaluating the 5th: batch 1 (plans 1-3) is on disk,
    # plan 4 of batch 2 is lost with the kill; the resumed pass measures exactly plans 4-7.
    points, table = _points(7), tmp_path / "truth.jsonl"
    first = _Evaluator(die_at=5)
    with pytest.raises(KeyboardInterrupt):
        measure(points, tmp_path, table, suite=None, batch_plans=3, evaluator=first,
                log=lambda s: None)  # fmt: skip
    assert set(read_table(table)) == {p.fingerprint for p in points[:3]}
    assert [p.name for p in tmp_path.iterdir()] == ["truth.jsonl"]  # no temporary file left
    second = _Evaluator()
    rows = measure(points, tmp_path, table, suite=None, batch_plans=3, evaluator=second,
                   log=lambda s: None)  # fmt: skip
    assert second.calls == [p.fingerprint for p in points[3:]]
    assert set(read_table(table)) == set(rows) == {p.fingerprint for p in points}
    row = read_table(table)[points[0].fingerprint]
    # the row keeps the quality figures (not the suite's name) and says what was measured
    assert row["metrics"] == {"fidelity.kl_mean": 0.001, "fidelity.kl_mean.ci_low": 0.0005}
    assert (row["model"], row["dataset"], row["choice"], row["tenants"]) == (
        MODEL, DATASET, ["int4", "0"], 10)  # fmt: skip
    assert row["commit"]


def test_a_failed_rewrite_leaves_the_previous_table_whole(tmp_path, monkeypatch):
    import os

    table = tmp_path / "truth.jsonl"
    write_table(table, [{"fingerprint": "a", "metrics": {}, "model": MODEL, "dataset": DATASET}])
    before = table.read_text()

    def broken_replace(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        write_table(table, [{"fingerprint": "b", "metrics": {}, "model": MODEL,
                             "dataset": DATASET}])  # fmt: skip
    assert table.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["truth.jsonl"]


@pytest.mark.parametrize("key", ["model", "dataset"])
def test_a_table_of_another_model_or_dataset_is_refused_before_measuring(tmp_path, key):
    points, table = _points(3), tmp_path / "truth.jsonl"
    measure(points[:2], tmp_path, table, suite=None, evaluator=_Evaluator(), log=lambda s: None)
    today = _Evaluator(**{key: "f" * 64})
    with pytest.raises(StaleTruthError) as err:
        measure(points, tmp_path, table, suite=None, evaluator=today, log=lambda s: None)
    old = MODEL if key == "model" else DATASET
    assert str(err.value) == (
        f"{table}: 2 of 2 rows were measured on {key} {old[:16]}, today's {key} is "
        f"{'f' * 16}; the table is stale: move it aside and measure again (--measure)"
    )
    assert today.calls == []


def test_a_damaged_row_is_named_by_line(tmp_path):
    table = tmp_path / "truth.jsonl"
    table.write_text(json.dumps({"fingerprint": "a", "metrics": {}, "model": MODEL,
                                 "dataset": DATASET}) + "\n{trunc\n")  # fmt: skip
    with pytest.raises(ValueError, match=r"truth.jsonl:2: not a ground-truth row"):
        read_table(table)


def test_a_per_plan_cache_converts_to_rows_with_its_hashes(tmp_path):
    points = _points(2)
    cache = {points[0].fingerprint: {"summary": {"fidelity.kl_mean": 0.5, "suite.name": "x"},
                                     "model": MODEL, "dataset_hash": DATASET,
                                     "timings_s": {"total": 7.25}}}  # fmt: skip
    rows = rows_from_cache(cache, points)
    assert rows == [{"fingerprint": points[0].fingerprint, "choice": ["int4", "0"],
                     "tenants": 10, "metrics": {"fidelity.kl_mean": 0.5}, "model": MODEL,
                     "dataset": DATASET, "commit": "unknown", "seconds": 7.25}]  # fmt: skip


@pytest.mark.slow  # prepares the quickstart study and builds its knapsack sampler (~10 s)
def test_quickstart_runs_measure_each_plan_once_and_resume_from_the_table(tmp_path):
    # Stand-in Evaluator: KL from the plan's fingerprint (deterministic, no JAX). Two samplers x
    # one seed x budget 3: every run reaches 3 distinct plans, the table holds each plan once,
    # and a second call with the same seeds reaches the same plans and measures none.
    from tenantq.search.efficiency import quickstart_hypervolume

    class Hashed(_Evaluator):
        def evaluate(self, plan):
            self.calls.append(plan.fingerprint())
            return _Result(1e-4 + int(plan.fingerprint()[:4], 16) / 65536 * 1e-2)

    table, first = tmp_path / "q.jsonl", Hashed()
    runs = quickstart_hypervolume(samplers=("random", "capacity_aware"), seeds=(0,),
                                  budgets=(2, 3), table=table, evaluator=first,
                                  log=lambda s: None)  # fmt: skip
    assert [(r["sampler"], r["budget"], r["evaluated"]) for r in runs] == [
        ("random", 2, 2), ("random", 3, 3),
        ("capacity_aware", 2, 2), ("capacity_aware", 3, 3),
    ]  # fmt: skip
    assert all(r["hypervolume"] > 0 for r in runs)
    assert len(first.calls) == len(set(first.calls)) == len(read_table(table))
    again = Hashed()
    rerun = quickstart_hypervolume(samplers=("random", "capacity_aware"), seeds=(0,),
                                   budgets=(2, 3), table=table, evaluator=again,
                                   log=lambda s: None)  # fmt: skip
    assert again.calls == [] and rerun == runs


def test_two_passes_on_one_table_keep_each_others_rows(tmp_path):
    # Pass A measures plans 0-1 with one write at its end; while A evaluates its 2nd plan, pass
    # B measures plans 2-3 into the same table and returns. A's write must keep B's two rows:
    # a rewrite from A's in-memory rows alone would drop them (4 rows expected, not 2).
    points, table = _points(4), tmp_path / "truth.jsonl"

    class Interleaved(_Evaluator):
        def evaluate(self, plan):
            if len(self.calls) == 1:
                measure(points[2:], tmp_path, table, suite=None, evaluator=_Evaluator(),
                        log=lambda s: None)  # fmt: skip
            return super().evaluate(plan)

    measure(points[:2], tmp_path, table, suite=None, evaluator=Interleaved(), log=lambda s: None)
    assert set(read_table(table)) == {p.fingerprint for p in points}
    assert [p.name for p in tmp_path.iterdir()] == ["truth.jsonl"]


def test_a_pass_refuses_a_table_holding_plans_of_another_space(tmp_path):
    # A table measured on plans 0-2 given to a pass over plans 3-5 (e.g. --truth naming the
    # per-layer table for the 168-plan space): refused before measuring, the table unchanged.
    points, table = _points(6), tmp_path / "truth.jsonl"
    measure(points[:3], tmp_path, table, suite=None, evaluator=_Evaluator(), log=lambda s: None)
    before, other = table.read_text(), _Evaluator()
    with pytest.raises(StaleTruthError, match=r"3 of 3 rows are plans outside this space"):
        measure(points[3:], tmp_path, table, suite=None, evaluator=other, log=lambda s: None)
    assert other.calls == [] and table.read_text() == before


def test_a_plan_twice_in_the_table_is_refused_naming_both_lines(tmp_path):
    # Two tables merged by hand or by git (e.g. two trees measuring the per-layer space) can
    # hold one plan twice with different figures; the last one silently won. Refused instead.
    table = tmp_path / "truth.jsonl"
    row = {"fingerprint": "a", "metrics": {"fidelity.kl_mean": 0.1}, "model": MODEL,
           "dataset": DATASET}  # fmt: skip
    other = {**row, "metrics": {"fidelity.kl_mean": 0.2}}
    table.write_text("".join(json.dumps(r) + "\n" for r in (row, other)))
    with pytest.raises(ValueError, match=r"truth.jsonl:2: plan a is also on line 1"):
        read_table(table)


class _CompilingEvaluator(_Evaluator):
    """Compiles a new executable per plan (a jit at a new shape, and an entry in the engine's
    executable LRU, as `engine.steps._compiled` makes one per layout) and records, at each
    evaluation, how many of each the process holds."""

    def __init__(self, fail: set[int] = frozenset()):
        import jax

        super().__init__()
        self.fail = set(fail)  # evaluation numbers (1-based) that raise, as a failed compile
        self.jitted = jax.jit(lambda x: x * 2)
        self.held: list[tuple[int, int]] = []
        self.tries = 0

    def evaluate(self, plan):
        import numpy as np

        from tenantq.engine import steps

        self.tries += 1
        self.held.append((self.jitted._cache_size(), steps.compiled_count()))
        if self.tries in self.fail:
            raise RuntimeError("INTERNAL: LLVM compilation error: Cannot allocate memory\nmore")
        self.jitted(np.ones(len(self.calls) + 1, np.float32))
        steps._EXECUTABLES[("test", plan.fingerprint())] = object()
        return super().evaluate(plan)


def test_the_pass_drops_compiled_executables_every_release_every_plans(tmp_path):
    # Bound: with release_every=2 the process never holds more than 2 plans' executables at an
    # evaluation's start (1 from the plan before, after a release 0); without the release the
    # 5th plan would see 4 of each. One jit cache and the engine's LRU are both checked.
    from tenantq.engine import steps

    steps._EXECUTABLES.clear()
    ev = _CompilingEvaluator()
    measure(_points(5), tmp_path, tmp_path / "t.jsonl", suite=None, release_every=2,
            evaluator=ev, log=lambda s: None)  # fmt: skip
    assert ev.held == [(0, 0), (1, 1), (0, 0), (1, 1), (0, 0)]
    steps._EXECUTABLES.clear()


def test_a_plan_whose_compile_fails_is_a_failed_row_measured_again_next_pass(tmp_path):
    from tenantq.engine import steps

    steps._EXECUTABLES.clear()
    points, table = _points(4), tmp_path / "t.jsonl"
    # plan 2 fails twice (its first try and the retry after a release): a failed row, the pass
    # goes on to plans 3 and 4
    ev = _CompilingEvaluator(fail={2, 3})
    measure(points, tmp_path, table, suite=None, evaluator=ev, log=lambda s: None)
    rows = read_table(table)
    assert rows[points[1].fingerprint]["error"] == (
        "RuntimeError: INTERNAL: LLVM compilation error: Cannot allocate memory"
    )
    assert rows[points[1].fingerprint]["metrics"] == {}
    assert ev.held[2] == (0, 0)  # the retry came after a release
    assert all("error" not in rows[p.fingerprint] for p in (points[0], *points[2:]))
    again = _Evaluator()
    measure(points, tmp_path, table, suite=None, evaluator=again, log=lambda s: None)
    assert again.calls == [points[1].fingerprint]  # only the failed plan, now measured
    assert "error" not in read_table(table)[points[1].fingerprint]
    steps._EXECUTABLES.clear()


def test_plans_failing_in_a_row_stop_the_pass_with_their_rows_written(tmp_path):
    from tenantq.search.ground_truth import MAX_FAILED_IN_A_ROW, TruthTableError

    class Broken(_Evaluator):
        def evaluate(self, plan):
            raise ValueError("the evaluator is broken")

    points, table = _points(MAX_FAILED_IN_A_ROW + 2), tmp_path / "t.jsonl"
    with pytest.raises(TruthTableError, match="failed in a row"):
        measure(points, tmp_path, table, suite=None, evaluator=Broken(), log=lambda s: None)
    assert len(read_table(table)) == MAX_FAILED_IN_A_ROW  # not every plan of the space


def test_a_failed_row_never_replaces_a_measured_row_in_the_table(tmp_path):
    # Two passes on one table: pass A measures plan 0 and writes it; pass B, which read the
    # table before, fails on plan 0 (twice) and merges its failed row. A's measurement must stay:
    # a failed row overwrote it (the plan was then measured a third time by the next pass).
    from tenantq.search.ground_truth import failed_row, merge_into_table, row_for

    points, table = _points(2), tmp_path / "t.jsonl"
    good = row_for(points[0], _Result(0.004).summary, MODEL, DATASET, "c", 1.0)
    merge_into_table(table, {points[0].fingerprint: good}, model=MODEL, dataset=DATASET)
    bad = {p.fingerprint: failed_row(p, RuntimeError("LLVM"), MODEL, DATASET, "c", 1.0)
           for p in points}  # fmt: skip
    rows = merge_into_table(table, bad, model=MODEL, dataset=DATASET)
    assert rows[points[0].fingerprint] == good == read_table(table)[points[0].fingerprint]
    assert "error" in read_table(table)[points[1].fingerprint]  # a failed row where none was


@pytest.mark.slow  # prepares the quickstart study (~8 s)
def test_a_failed_row_in_the_quickstart_table_is_measured_again_not_read(tmp_path):
    # A plan the table holds only as a failed row (no metrics) was taken as measured: the run
    # read its metrics and died on a KeyError. It is measured again and its row replaced.
    from tenantq.search.efficiency import quickstart_hypervolume
    from tenantq.search.ground_truth import failed_row

    class Hashed(_Evaluator):
        def evaluate(self, plan):
            self.calls.append(plan.fingerprint())
            return _Result(1e-4 + int(plan.fingerprint()[:4], 16) / 65536 * 1e-2)

    table, first = tmp_path / "q.jsonl", Hashed()
    kw = {"samplers": ("random",), "seeds": (0,), "budgets": (2,), "table": table,
          "log": lambda s: None}  # fmt: skip
    runs = quickstart_hypervolume(evaluator=first, **kw)
    rows = read_table(table)
    fp = first.calls[1]
    point = SpacePoint(tuple(rows[fp]["choice"]), fp, rows[fp]["tenants"], "")
    rows[fp] = failed_row(point, RuntimeError("LLVM"), MODEL, DATASET, "c", 1.0)
    write_table(table, rows.values())
    again = Hashed()
    assert quickstart_hypervolume(evaluator=again, **kw) == runs
    assert again.calls == [fp] and "error" not in read_table(table)[fp]
