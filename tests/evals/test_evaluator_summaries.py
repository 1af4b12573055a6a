"""The Evaluator's bookkeeping without a model: the paired pass/fail figures, the fidelity
summary, the gates and their words, the per-example rows and the cached generations.

Each test builds what it checks (a stand-in `self` for the methods, hand-made items and
records), so it runs in milliseconds. References are independent where one exists: McNemar
against scipy's exact binomial test, the perplexity ratio and the KL mean by direct numpy.
"""

from __future__ import annotations

import inspect
import json
import math
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from scipy import stats as sps

from tenantq.evals import evaluator as ev
from tenantq.evals import stats
from tenantq.evals.generation import Generated
from tenantq.evals.needle_grid import NeedleItem
from tenantq.evals.structured import StructuredItem
from tenantq.evals.suite import FidelitySpec, GateSpec, NeedleSpec, StructuredSpec, Suite
from tenantq.evals.tasks import FidelityTask, PassFailTask, flip


def _needle(length: int, k: int, depth: float = 0.25) -> NeedleItem:
    return NeedleItem("needle", f"needle/len{length}/{k}", length, depth, [1] * 7, np.zeros(5))


def _struct(task: str, k: int) -> StructuredItem:
    return StructuredItem(task, f"structured/{task}/{k}", [1] * (3 + k), "x", "")


# 12 needles at length 64 with 5 correct->wrong and 1 wrong->correct flip, 4 at length 128
BASE_64 = [1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 1]
CAND_64 = [0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
BASE_128 = [1, 0, 1, 1]
CAND_128 = [1, 0, 1, 1]


def _needle_pass_fail():
    items = [_needle(64, k) for k in range(12)] + [_needle(128, k) for k in range(4)]
    base_gens = [Generated([1, 2], [0.5 + k, 0.25 + k]) for k in range(16)]
    cand_gens = [Generated([3], [2.0 + k]) for k in range(16)]
    cand_gens[13] = Generated([], [])  # no recorded step: margin nan
    me, rows = PassFailTask("needles", items, "len", None, None), []
    out = me.pair(BASE_64 + BASE_128, CAND_64 + CAND_128, base_gens, cand_gens, rows)
    return me, out, rows, items


def test_pass_fail_figures_per_length_are_the_paired_ones() -> None:
    me, out, _, _ = _needle_pass_fail()
    b, c = np.array(BASE_64, bool), np.array(CAND_64, bool)
    assert out["needle.acc_base.len64"] == pytest.approx(9 / 12)
    assert out["needle.acc_cand.len64"] == pytest.approx(5 / 12)
    assert out["needle.acc_delta.len64"] == pytest.approx(5 / 12 - 9 / 12)
    assert out["needle.flips.len64.correct_to_wrong"] == 5
    assert out["needle.flips.len64.wrong_to_correct"] == 1
    assert out["needle.n.len64"] == 12 and out["needle.n.len128"] == 4
    # the interval is Tango's for (baseline, candidate) in that order: swapped, it mirrors
    ci = stats.paired_proportion_ci(b, c)
    assert (out["needle.acc_delta.len64.ci_low"], out["needle.acc_delta.len64.ci_high"]) == (
        ci.ci_low, ci.ci_high
    )  # fmt: skip
    # 5 losses against 1 gain: the interval leans below 0 (its mirror would lean above)
    assert out["needle.acc_delta.len64.ci_low"] < -out["needle.acc_delta.len64.ci_high"] < 0
    # McNemar: the 6 discordant pairs as Binomial(6, 1/2), two-sided (scipy's exact test)
    want = sps.binomtest(1, 6, 0.5, alternative="two-sided").pvalue
    assert out["needle.mcnemar_p.len64"] == pytest.approx(want, rel=1e-12)
    assert out["needle.mcnemar_p.len128"] == 1.0  # nothing flipped
    assert out["needle.acc_delta.len128"] == 0.0 and out["needle.acc_base.len128"] == 0.75
    # each length is one group of the suite's baseline pass-rate bar: (bf16 passes, examples)
    assert me.baseline_passes == {"needle.len64": (9, 12), "needle.len128": (3, 4)}
    # nothing else: 9 figures per length
    assert len(out) == 18


def test_every_needle_gets_one_row_with_its_flip_and_smallest_margin() -> None:
    _, _, rows, items = _needle_pass_fail()
    assert [r["example_id"] for r in rows] == [i.example_id for i in items]
    flips = [r["flip"] for r in rows[:12]]
    assert flips == ["correct_to_wrong"] * 5 + [""] * 5 + ["wrong_to_correct", ""]
    r = rows[2]
    assert (r["task"], r["length"], r["depth"]) == ("needle", 64, 0.25)
    assert (r["baseline_score"], r["candidate_score"]) == (1.0, 0.0)
    assert r["margin"] == 2.25 and r["candidate_margin"] == 4.0  # min over the steps
    assert r["baseline_tokens"] == [1, 2] and r["candidate_tokens"] == [3]
    assert r["baseline_margins"] == [2.5, 2.25]
    assert math.isnan(r["kl"]) and math.isnan(r["top1_agree"])
    assert math.isnan(rows[13]["candidate_margin"])  # no step recorded
    table = ev._examples_table(rows)
    assert table.num_rows == 16 and table.schema.field("length").type == pa.int32()


def test_structured_tasks_are_scored_whole_and_per_task() -> None:
    items = [_struct("close_line", k) for k in range(3)] + [_struct("indent_block", 0)]
    gens = [Generated([5], [1.0]) for _ in items]
    me, rows = PassFailTask("structured", items, "task", None, None), []
    out = me.pair([1, 1, 0, 1], [1, 0, 0, 1], gens, gens, rows)
    assert out["structured.acc_delta"] == pytest.approx(-0.25)
    assert out["structured.n"] == 4 and out["structured.n.close_line"] == 3
    assert out["structured.acc_delta.close_line"] == pytest.approx(-1 / 3)
    assert out["structured.acc_delta.indent_block"] == 0.0
    assert out["structured.flips.correct_to_wrong"] == 1
    # the pass-rate bar applies per task, not to the whole
    assert me.baseline_passes == {
        "structured.close_line": (2, 3),
        "structured.indent_block": (1, 1),
    }
    assert len(out) == 3 * 9
    # a structured example has no length of its own: its prompt's; no depth
    assert [r["length"] for r in rows] == [3, 4, 5, 3] and math.isnan(rows[0]["depth"])


def test_flip_words() -> None:
    assert flip(True, True) == "" and flip(False, False) == ""
    assert flip(True, False) == "correct_to_wrong"
    assert flip(False, True) == "wrong_to_correct"


def _fidelity_task(resamples: int = 400, seed: int = 3) -> FidelityTask:
    """A fidelity task on four 9-token windows with the suite's resamples and seed."""
    return FidelityTask(np.zeros((4, 9), np.int32), None, resamples, seed)


def test_fidelity_summary_is_per_window_means_and_their_ratios() -> None:
    me = _fidelity_task()
    rng = np.random.default_rng(0)
    kl = rng.exponential(0.02, size=(4, 8))
    agree = rng.random((4, 8)) < 0.9
    base_logp = -rng.exponential(2.0, size=(4, 8))
    cand_logp = base_logp - rng.exponential(0.05, size=(4, 8))
    margin = rng.random((4, 8))
    base = SimpleNamespace(target_logp=base_logp, margin=margin, exact=True)
    rows: list[dict] = []
    cand = {"kl": kl, "top1_agree": agree, "target_logp": cand_logp}
    measured = ev.fidelity.KLMeasurement.of(cand, resamples=400, seed=3)
    out = me.summarize(base, measured, rows)
    assert out["fidelity.kl_mean"] == pytest.approx(kl.mean())
    assert (
        out["fidelity.kl_mean.ci_low"] <= kl.mean(axis=1).mean() <= out["fidelity.kl_mean.ci_high"]
    )
    assert out["fidelity.kl_mean.ci_low"] >= kl.mean(axis=1).min()
    assert out["fidelity.kl_p99"] == pytest.approx(np.quantile(kl, 0.99))
    assert out["fidelity.kl_max"] == kl.max()
    assert out["fidelity.top1_agree"] == pytest.approx(agree.mean())
    assert out["fidelity.top1_agree_delta"] == pytest.approx(agree.mean() - 1.0)
    assert out["fidelity.top1_agree_delta.ci_high"] <= 0.0  # agreement can only fall from 1
    nll_b, nll_c = -base_logp.mean(axis=1), -cand_logp.mean(axis=1)
    assert out["fidelity.ppl_base"] == pytest.approx(np.exp(nll_b.mean()))
    assert out["fidelity.ppl_cand"] == pytest.approx(np.exp(nll_c.mean()))
    ratio = np.exp(nll_c.mean() - nll_b.mean())
    assert out["fidelity.ppl_ratio"] == pytest.approx(ratio) and ratio > 1.0
    assert out["fidelity.ppl_ratio.ci_low"] <= ratio <= out["fidelity.ppl_ratio.ci_high"]
    assert out["fidelity.ppl_ratio.ci_low"] > 1.0  # every window's NLL rose
    assert out["fidelity.tokens"] == 32 and out["fidelity.exact"] == 1
    # the CIs are the suite's bootstrap (its resamples and seed), seen by re-computing one
    want = stats.paired_bootstrap(
        nll_b, nll_c, resamples=400, seed=3, contrast=lambda c, b: np.exp(c - b)
    )
    assert out["fidelity.ppl_ratio.ci_low"] == want.ci_low
    assert out["fidelity.ppl_ratio.ci_high"] == want.ci_high
    for key in ("kl_mean", "top1_agree_delta"):
        assert out[f"fidelity.{key}.ci_low"] < out[f"fidelity.{key}.ci_high"], key
    assert len(rows) == 4
    r = rows[1]
    assert (r["task"], r["example_id"], r["length"], r["flip"]) == ("fidelity", "fidelity/1", 9, "")
    assert r["baseline_score"] == pytest.approx(nll_b[1]) and r["candidate_score"] == pytest.approx(
        nll_c[1]
    )
    assert r["kl"] == pytest.approx(kl[1].mean()) and r["top1_agree"] == pytest.approx(
        agree[1].mean()
    )
    assert r["margin"] == pytest.approx(margin[1].mean())
    assert math.isnan(r["depth"]) and math.isnan(r["candidate_margin"])
    assert (
        r["baseline_tokens"] == [] and r["candidate_tokens"] == [] and r["baseline_margins"] == []
    )
    another = _fidelity_task(seed=4).summarize(
        SimpleNamespace(target_logp=base_logp, margin=margin, exact=False),
        measured, [],
    )  # fmt: skip
    assert another["fidelity.exact"] == 0


def _suite(*gates: tuple[str, float, bool]) -> Suite:
    return Suite(
        name="t",
        fidelity=FidelitySpec(rows=2, row_tokens=64),
        needles=(NeedleSpec(lengths=(64,), per_length=8),),
        gates=tuple(GateSpec(metric=m, tolerance=t, higher_is_better=h) for m, t, h in gates),
    )


def test_gates_judge_each_delta_from_its_no_change_value() -> None:
    suite = _suite(
        ("fidelity.kl_mean", 0.01, False),
        ("fidelity.ppl_ratio", 0.02, False),
        ("needle.acc_delta.len64", 0.1, True),
    )
    summary = {
        "fidelity.kl_mean": 0.004, "fidelity.kl_mean.ci_low": 0.003,
        "fidelity.kl_mean.ci_high": 0.006,
        # a perplexity ratio's no change is 1: [1.01, 1.03] is 0.01..0.03 above it
        "fidelity.ppl_ratio": 1.02, "fidelity.ppl_ratio.ci_low": 1.01,
        "fidelity.ppl_ratio.ci_high": 1.03,
        "needle.acc_delta.len64": -0.05, "needle.acc_delta.len64.ci_low": -0.08,
        "needle.acc_delta.len64.ci_high": 0.02, "needle.mcnemar_p.len64": 0.04,
    }  # fmt: skip
    gates = ev.gates_for(suite, summary)
    kl = gates["fidelity.kl_mean"]
    assert (kl.value, kl.ci_low, kl.ci_high, kl.tolerance) == (0.004, 0.003, 0.006, 0.01)
    assert not kl.higher_is_better and kl.verdict == stats.NON_INFERIOR
    assert kl.constraint == pytest.approx(0.006 - 0.01) and kl.changed  # CI excludes 0
    ppl = gates["fidelity.ppl_ratio"]
    assert (
        ppl.constraint == pytest.approx(0.03 - 0.02) and ppl.verdict == stats.NOT_SHOWN_NON_INFERIOR
    )
    assert ppl.changed and (ppl.ci_low, ppl.ci_high) == (1.01, 1.03)  # reported as measured
    acc = gates["needle.acc_delta.len64"]
    assert acc.higher_is_better and acc.constraint == pytest.approx(-0.1 + 0.08)
    assert acc.verdict == stats.NON_INFERIOR
    assert acc.changed  # McNemar's p 0.04 <= 0.05, though the CI holds 0
    summary["needle.mcnemar_p.len64"] = 0.06
    assert not ev.gates_for(suite, summary)["needle.acc_delta.len64"].changed
    summary["fidelity.ppl_ratio.ci_low"] = 0.99  # now holds 1: no change shown
    assert not ev.gates_for(suite, summary)["fidelity.ppl_ratio"].changed
    words = ev.decision_words(gates)
    assert words == {
        "verdict.fidelity.kl_mean": "non-inferior",
        "verdict.fidelity.ppl_ratio": "not shown non-inferior",
        "verdict.needle.acc_delta.len64": "non-inferior",
        "changed.fidelity.kl_mean": "yes",
        "changed.fidelity.ppl_ratio": "yes",
        "changed.needle.acc_delta.len64": "yes",
    }


def test_a_gate_without_a_ci_is_judged_on_its_value() -> None:
    suite = _suite(("fidelity.kl_mean", 0.01, False))
    gate = ev.gates_for(suite, {"fidelity.kl_mean": 0.02})["fidelity.kl_mean"]
    assert (gate.ci_low, gate.ci_high) == (0.02, 0.02)
    assert gate.constraint == pytest.approx(0.01) and gate.changed


def test_a_result_passes_only_when_every_gate_is_within_tolerance(tmp_path) -> None:
    def gate(constraint: float) -> ev.Gate:
        return ev.Gate("m", 0.0, 0.0, 0.0, 0.1, True, "v", constraint)

    def result(*constraints: float) -> ev.EvalResult:
        gates = {f"g{i}": gate(c) for i, c in enumerate(constraints)}
        return ev.EvalResult({"a": 1.5}, gates, ev._examples_table([]), {"total": 2.0}, {})

    assert result(0.0, -0.5).passed and result().passed
    assert not result(-0.5, 0.01).passed
    path = result(0.0, 0.2).to_parquet(tmp_path / "r.parquet")
    assert path == tmp_path / "r.parquet"
    meta = pq.read_table(path).schema.metadata
    assert json.loads(meta[b"tenantq.summary"]) == {"a": 1.5}
    assert json.loads(meta[b"tenantq.timings_s"]) == {"total": 2.0}
    assert json.loads(meta[b"tenantq.gates"])["g1"]["constraint"] == 0.2
    assert json.loads(meta[b"tenantq.gates"])["g1"]["changed"] is False


def test_a_gate_as_a_dict_keeps_every_field_in_plain_python_types() -> None:
    # numpy scalars (as stats returns them) become Python's, so a trial's result crosses Ray
    # and JSON as it is; higher_is_better travels with the rest
    gate = ev.Gate(
        "needle.acc_delta.len64", np.float64(-0.25), np.float64(-0.5), np.float64(0.1), 0.2,
        np.bool_(True), "not shown non-inferior", np.float64(0.3), np.bool_(False),
    )  # fmt: skip
    plain = gate.as_dict()
    assert plain == {
        "metric": "needle.acc_delta.len64", "value": -0.25, "ci_low": -0.5, "ci_high": 0.1,
        "tolerance": 0.2, "higher_is_better": True, "verdict": "not shown non-inferior",
        "constraint": 0.3, "changed": False,
    }  # fmt: skip
    assert [type(v) for v in plain.values()] == [str, float, float, float, float, bool, str,
                                                 float, bool]  # fmt: skip
    assert json.loads(json.dumps(plain)) == plain


def test_cached_generations_read_back_for_the_same_examples_only(tmp_path) -> None:
    items = [_needle(64, 0), _struct("close_line", 1)]
    gens = [Generated([3, 4], [0.5, 1.5]), Generated([], [])]
    path = tmp_path / "g.parquet"
    ev._save_generations(gens, items, path)
    back = ev._load_generations(path, items)
    assert back == [Generated([3, 4], [0.5, 1.5]), Generated([], [])]
    with pytest.raises(ValueError, match="holds other examples"):
        ev._load_generations(path, items[::-1])


def test_metric_names_and_their_example_counts() -> None:
    me = SimpleNamespace(
        fidelity_rows=np.zeros((2, 8)),
        needle_items=[_needle(64, 0), _needle(64, 1), _needle(128, 0)],
        structured_items=[_struct("close_line", 0), _struct("indent_block", 0)],
    )
    assert ev.Evaluator.expected_metrics(me) == [
        "fidelity.kl_mean", "fidelity.ppl_ratio", "fidelity.top1_agree_delta",
        "needle.acc_delta.len128", "needle.acc_delta.len64", "structured.acc_delta",
        "structured.acc_delta.close_line", "structured.acc_delta.indent_block",
    ]  # fmt: skip
    assert ev.Evaluator._gate_examples(me) == {
        "needle.acc_delta.len64": 2, "needle.acc_delta.len128": 1, "structured.acc_delta": 2,
        "structured.acc_delta.close_line": 1, "structured.acc_delta.indent_block": 1,
    }  # fmt: skip
    me.fidelity_rows = None
    assert "fidelity.kl_mean" not in ev.Evaluator.expected_metrics(me)
    with pytest.raises(ValueError) as err:
        ev._check_gates(
            _suite(("fidelity.kl_mean", 0.01, False)), ["needle.acc_delta.len64", "structured.n"]
        )
    assert str(err.value) == (
        "suite 't' gates 'fidelity.kl_mean', which it does not measure; measured deltas: "
        "needle.acc_delta.len64, structured.n"
    )
    ev._check_gates(_suite(("fidelity.kl_mean", 0.01, False)), ["fidelity.kl_mean"])


def test_engine_settings_name_the_dtype_and_the_options_sorted() -> None:
    me = SimpleNamespace(dtype="float32", engine_options={"z": 1, "a": 2})
    settings = ev.Evaluator.engine_settings(me)
    assert settings == {"dtype": "float32", "a": 2, "z": 1}
    assert list(settings) == ["dtype", "a", "z"]


def test_a_phase_counts_wall_time_less_the_compiles_inside_it(monkeypatch) -> None:
    clock = iter([10.0, 13.5])
    monkeypatch.setattr(ev.time, "perf_counter", lambda: next(clock))
    engine = SimpleNamespace(stats=SimpleNamespace(compile_s=1.0))
    timings = {"needles": 0.25}
    with ev._phase(timings, "needles", engine):
        engine.stats.compile_s = 2.5  # 1.5 s of the 3.5 s compiled
    assert timings["needles"] == pytest.approx(0.25 + 3.5 - 1.5)
    clock = iter([0.0, 2.0])
    with ev._phase(timings, "needles"):
        pass
    assert timings["needles"] == pytest.approx(4.25)


def test_a_pool_too_small_for_the_suite_is_a_one_line_value_error() -> None:
    from tenantq.engine import CacheFull

    def full(plan):
        raise CacheFull("needs 9 pages, has 4")

    with pytest.raises(ValueError, match=r"does not fit .*needs 9 pages, has 4.*pool_bytes"):
        ev.Evaluator.evaluate(SimpleNamespace(_evaluate=full), object())
    sentinel = object()
    assert ev.Evaluator.evaluate(SimpleNamespace(_evaluate=lambda p: (sentinel, p)), 7) == (
        sentinel, 7
    )  # fmt: skip


class _KeyMe:
    """What `baseline_key` reads."""

    def __init__(self, suite: Suite, **kw):
        self.identity, self.dataset_hash = kw.get("identity", "m1"), kw.get("dataset", "d1")
        self.suite, self._engine = suite, kw.get("engine", {"dtype": "bfloat16"})
        self.step_tokens, self.kv_window_tokens, self.fidelity_kv_tokens = kw.get(
            "steps", (256, 1024, 1024)
        )

    def engine_settings(self):
        return self._engine


def test_a_cached_baseline_is_keyed_by_everything_its_numbers_depend_on() -> None:
    suite = _suite(("fidelity.kl_mean", 0.01, False))
    key = ev.Evaluator.baseline_key(_KeyMe(suite))
    changed = [
        _KeyMe(suite, identity="m2"),
        _KeyMe(suite, dataset="d2"),
        _KeyMe(suite, engine={"dtype": "float32"}),
        _KeyMe(suite, steps=(None, 1024, 1024)),
        _KeyMe(suite, steps=(256, 2048, 1024)),
        _KeyMe(suite, steps=(256, 1024, 256)),
        _KeyMe(suite.model_copy(update={"seed": 1})),
        _KeyMe(suite.model_copy(update={"fidelity": FidelitySpec(rows=2, row_tokens=64, top_k=8)})),
    ]
    keys = [ev.Evaluator.baseline_key(me) for me in changed]
    assert key not in keys and len(set(keys)) == len(keys)
    # what only judges the numbers (name, resamples, gates, the pass-rate bar) shares them
    same = suite.model_copy(
        update={"name": "other", "resamples": 500, "gates": (), "min_baseline_pass_rate": 0.1}
    )
    assert ev.Evaluator.baseline_key(_KeyMe(same)) == key
    assert ev.CACHE_VERSION == 2


def test_a_new_cache_version_never_reads_an_older_baseline(monkeypatch) -> None:
    suite = _suite(("fidelity.kl_mean", 0.01, False))
    key = ev.Evaluator.baseline_key(_KeyMe(suite))
    monkeypatch.setattr(ev, "CACHE_VERSION", ev.CACHE_VERSION + 1)
    assert ev.Evaluator.baseline_key(_KeyMe(suite)) != key


def test_generations_run_needles_then_structured_items_in_one_list(monkeypatch) -> None:
    needles = [_needle(64, 0), _needle(64, 1)]
    others = [_struct("close_line", 0)]
    calls = []

    def run_items(engine, items, max_new_tokens):
        calls.append(("structured", engine, len(items), max_new_tokens))
        return [Generated([9], [])] * len(items)

    def run_needles(engine, items, *, chunk_tokens=None, kv_tokens=None):
        calls.append(("needles", engine, len(items), chunk_tokens, kv_tokens))
        return [Generated([k], []) for k in range(len(items))]

    monkeypatch.setattr(ev.structured, "run_items", run_items)
    monkeypatch.setattr(ev.needle_grid, "run_needles", run_needles)

    class Me:
        _needles = ev.Evaluator._needles
        _structured = ev.Evaluator._structured
        step_tokens, kv_window_tokens = 128, 512
        suite = SimpleNamespace(structured=SimpleNamespace(max_new_tokens=7))

    out = ev.Evaluator._generate(Me(), "E", [others[0], needles[0], needles[1]])
    assert calls == [("needles", "E", 2, 128, 512), ("structured", "E", 1, 7)]
    assert [g.tokens for g in out] == [[0], [1], [9]]
    calls.clear()
    assert ev.Evaluator._generate(Me(), "E", needles) == [Generated([0], []), Generated([1], [])]
    assert [c[0] for c in calls] == ["needles"]
    calls.clear()
    assert ev.Evaluator._generate(Me(), "E", others) == [Generated([9], [])]
    assert [c[0] for c in calls] == ["structured"]


class _BaselineMe:
    """What `Evaluator.baseline` reads; the engine and the generations are recorded."""

    baseline = ev.Evaluator.baseline

    def __init__(self, cache_dir, *, vocab=64, fidelity=True, items=True, key="k1"):
        self._baseline, self.cache_dir, self.key = None, cache_dir, key
        self.suite = Suite(
            name="t", seed=4,
            fidelity=FidelitySpec(rows=2, row_tokens=8, exact_vocab_limit=64, top_k=3,
                                  tail_samples=5),
            needles=(NeedleSpec(lengths=(64,), per_length=2),),
        )  # fmt: skip
        self.config = SimpleNamespace(vocab_size=vocab)
        self.fidelity_rows = np.array([[1, 5, 6, 7], [1, 8, 9, 10]], np.int32) if fidelity else None
        self.fidelity_kv_tokens = 16
        self.needle_items = [_needle(64, 0), _needle(64, 1)] if items else []
        self.structured_items = []
        self.engines, self.generated = [], []

    def baseline_key(self):
        return self.key

    def build_engine(self, plan):
        self.engines.append(plan)
        return "engine"

    def _generate(self, engine, items):
        self.generated.append((engine, len(items)))
        return [Generated([7, k], [0.5, 1.0 + k]) for k in range(len(items))]


def _fake_baseline(calls):
    def compute(engine, rows, *, exact, top_k, tail_samples, seed, kv_tokens):
        calls.append((engine, rows.shape, exact, top_k, tail_samples, seed, kv_tokens))
        n, p = rows.shape[0], rows.shape[1] - 1
        base = ev.fidelity.FidelityBaseline(
            rows[:, 1:].astype(np.int32), np.full((n, p), -1.5, np.float32),
            np.zeros((n, p), np.int32), np.ones((n, p), np.float32),
        )  # fmt: skip
        base.logp = np.log(np.full((n, p, 4), 0.25, np.float32))
        return base

    return compute


def test_the_baseline_is_computed_once_then_read_from_memory_and_disk(tmp_path, monkeypatch):
    from tenantq.quant.plan import QuantPlan

    calls = []
    monkeypatch.setattr(ev.fidelity, "compute_baseline", _fake_baseline(calls))
    me = _BaselineMe(tmp_path / "cache")
    first = me.baseline()
    assert calls == [("engine", (2, 4), True, 3, 5, 4, 16)]  # vocab 64 <= 64: exact
    assert me.engines == [QuantPlan()] and me.generated == [("engine", 2)]
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [
        "baseline-k1-fidelity.parquet", "baseline-k1-generations.parquet"
    ]  # fmt: skip
    assert me.baseline() is first and len(calls) == 1  # memory
    again = _BaselineMe(tmp_path / "cache")
    second = again.baseline()  # disk: nothing computed, no engine built
    assert again.engines == [] and again.generated == [] and len(calls) == 1
    np.testing.assert_array_equal(np.asarray(second["fidelity"].logp), first["fidelity"].logp)
    assert second["generations"] == first["generations"] == [
        Generated([7, 0], [0.5, 1.0]), Generated([7, 1], [0.5, 2.0])
    ]  # fmt: skip
    # another key is another baseline
    other = _BaselineMe(tmp_path / "cache", key="k2")
    other.baseline()
    assert len(calls) == 2 and other.generated == [("engine", 2)]


def test_a_damaged_or_stale_baseline_cache_is_recomputed(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(ev.fidelity, "compute_baseline", _fake_baseline(calls))
    _BaselineMe(tmp_path).baseline()
    (tmp_path / "baseline-k1-fidelity.parquet").write_bytes(b"not parquet")
    me = _BaselineMe(tmp_path)
    me.baseline()
    assert len(calls) == 2 and me.generated == [("engine", 2)]  # both recomputed
    # generations of other examples under the same key: not trusted
    me = _BaselineMe(tmp_path)
    me.needle_items = [_needle(64, 5), _needle(64, 6)]
    me.baseline()
    assert len(calls) == 3 and me.generated == [("engine", 2)]


def test_a_baseline_without_items_or_without_fidelity_computes_only_what_it_has(
    tmp_path, monkeypatch
):
    calls = []
    monkeypatch.setattr(ev.fidelity, "compute_baseline", _fake_baseline(calls))
    me = _BaselineMe(tmp_path / "a", items=False, vocab=65)
    out = me.baseline()
    assert out["generations"] == [] and me.generated == []
    assert calls[0][2] is False  # vocab 65 > the limit: top-k
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["baseline-k1-fidelity.parquet"]
    assert _BaselineMe(tmp_path / "a", items=False).baseline()["fidelity"] is not None
    me = _BaselineMe(tmp_path / "b", fidelity=False)
    out = me.baseline()
    assert out["fidelity"] is None and len(calls) == 1 and me.generated == [("engine", 2)]
    assert [p.name for p in (tmp_path / "b").iterdir()] == ["baseline-k1-generations.parquet"]
    cached = _BaselineMe(tmp_path / "b", fidelity=False)
    cached.baseline()
    assert cached.engines == []


class _Tok:
    def decode(self, ids):
        return "".join(chr(i) for i in ids)


class _EvalMe:
    """An evaluator whose baseline, engine and generation paths are stand-ins."""

    _evaluate = ev.Evaluator._evaluate
    tasks = ev.Evaluator.tasks
    _needles = ev.Evaluator._needles
    _structured = ev.Evaluator._structured
    _gate_examples = ev.Evaluator._gate_examples

    def __init__(self):
        self.suite = Suite(
            name="tiny", resamples=200,
            fidelity=FidelitySpec(rows=3, row_tokens=8),
            needles=(NeedleSpec(lengths=(64,), per_length=4),),
            structured=StructuredSpec(tasks=("close_line",), per_task=2, max_new_tokens=5),
            gates=(GateSpec(metric="fidelity.kl_mean", tolerance=0.05, higher_is_better=False),
                   GateSpec(metric="needle.acc_delta.len64", tolerance=0.9,
                            higher_is_better=True)),
        )  # fmt: skip
        self.progress, self.load_s, self._evaluations = False, 7.0, 0
        self.identity, self.dataset_hash = "m" * 20 + "x", "d" * 20 + "y"
        self.tokenizer = _Tok()
        self.fidelity_rows = np.zeros((3, 8), np.int32)
        self.fidelity_kv_tokens, self.step_tokens, self.kv_window_tokens = 32, 8, 64
        self.needle_items = [
            NeedleItem("needle", f"needle/len64/{k}", 64, k / 3, [1] * 60, np.array([5, 6]))
            for k in range(4)
        ]
        self.structured_items = [
            StructuredItem("close_line", f"structured/close_line/{k}", [1, 2], "f(a", "")
            for k in range(2)
        ]
        base_fid = SimpleNamespace(
            target_logp=np.full((3, 7), -2.0), margin=np.ones((3, 7)), exact=True
        )
        base_gens = [Generated([5, 6], [1.0, 1.0])] * 4 + [Generated([ord(")")], [1.0])] * 2
        self._base = {"fidelity": base_fid, "generations": base_gens}
        self.engine = SimpleNamespace(
            stats=SimpleNamespace(compile_s=1.25), mesh=None,
            memory_report=lambda: SimpleNamespace(as_dict=lambda: {"pool_bytes": 10}),
        )  # fmt: skip

    def baseline(self):
        return self._base

    def build_engine(self, plan):
        self.plan = plan
        return self.engine


def test_an_evaluation_summarizes_every_task_and_its_gates(monkeypatch) -> None:
    from tenantq.quant.plan import QuantPlan, Rule

    def compare(engine, rows, base, *, kv_tokens=None):
        assert kv_tokens == 32 and base is me._base["fidelity"]
        assert engine is me.engine and rows is me.fidelity_rows
        return {"kl": np.full((3, 7), 0.01), "top1_agree": np.ones((3, 7), bool),
                "target_logp": np.full((3, 7), -2.0)}  # fmt: skip

    def run_needles(engine, items, *, chunk_tokens=None, kv_tokens=None):
        assert (chunk_tokens, kv_tokens) == (8, 64) and engine is me.engine
        engine.stats.compile_s += 1000.0  # compiled while the needles ran
        # needle 0 loses its answer; the others keep it
        return [Generated([5, 7], [0.1, 0.2])] + [Generated([5, 6], [2.0, 2.0])] * 3

    def run_items(engine, items, max_new_tokens):
        assert max_new_tokens == 5 and engine is me.engine and items == me.structured_items
        return [Generated([ord(")")], [1.0]), Generated([ord(",")], [1.0])]

    monkeypatch.setattr(ev.fidelity, "compare", compare)
    monkeypatch.setattr(ev.needle_grid, "run_needles", run_needles)
    monkeypatch.setattr(ev.structured, "run_items", run_items)
    me = _EvalMe()
    plan = QuantPlan(rules=(Rule(".*", "int8"),))
    result = me._evaluate(plan)
    s = result.summary
    assert me.plan is plan
    assert s["fidelity.kl_mean"] == pytest.approx(0.01) and s["fidelity.ppl_ratio"] == 1.0
    assert s["needle.acc_delta.len64"] == -0.25 and s["needle.flips.len64.correct_to_wrong"] == 1
    assert s["structured.acc_delta"] == -0.5 and s["structured.acc_delta.close_line"] == -0.5
    assert s["verdict.fidelity.kl_mean"] == "non-inferior"
    assert s["verdict.needle.acc_delta.len64"] == "non-inferior"  # within the loose 0.9
    assert s["changed.needle.acc_delta.len64"] == "no"  # one flip: McNemar p = 1
    assert set(result.gates) == {"fidelity.kl_mean", "needle.acc_delta.len64"}
    assert s["passed"] == 1 and result.passed
    assert (s["suite.name"], s["suite.split"]) == ("tiny", "search")
    assert s["identity.model"] == "m" * 16 and s["identity.dataset"] == "d" * 16
    assert s["identity.plan"] == plan.fingerprint() and s["examples.n"] == 3 + 4 + 2
    # a 0.9 tolerance is reachable with 4 needles (Tango's no-flip bound is -0.49), and
    # every group's bf16 pass rate is 1: no warning
    assert not any(k.startswith("warning.") for k in s)
    rows = result.examples.to_pylist()
    assert [r["task"] for r in rows] == ["fidelity"] * 3 + ["needle"] * 4 + ["structured"] * 2
    assert rows[3]["flip"] == "correct_to_wrong" and rows[8]["flip"] == "correct_to_wrong"
    assert result.memory_report == {"pool_bytes": 10}
    t = result.timings_s
    assert set(t) == set(ev.PHASES) and t["load"] == 7.0
    # the 1,000 s compiled inside the needles phase are taken out of it (the stand-in's
    # needles take well under 10 s of wall time)
    assert -1000.0 <= t["needles"] < -990.0 and t["compile"] == 1001.25
    assert t["total"] >= 7.0
    again = me._evaluate(plan)  # the load is counted in the first evaluation only
    assert again.timings_s["load"] == 0.0 and again.timings_s["total"] < 7.0
    assert me._evaluate(plan).timings_s["load"] == 0.0  # nor in the third
    me.suite = me.suite.model_copy(
        update={"gates": (GateSpec(metric="needle.acc_delta.len64", tolerance=0.01,
                                   higher_is_better=True),)}
    )  # fmt: skip
    tight = me._evaluate(plan)
    assert tight.summary["passed"] == 0 and not tight.passed
    assert "warning.gate.needle.acc_delta.len64" in tight.summary  # 4 needles: unreachable
    # a gate whose CI bound sits exactly on its tolerance (constraint 0) is within it: the
    # summary's "passed" says what `EvalResult.passed` and the verdict say
    edge = s["fidelity.kl_mean.ci_high"]
    me.suite = me.suite.model_copy(
        update={"gates": (GateSpec(metric="fidelity.kl_mean", tolerance=edge),)}
    )
    at_edge = me._evaluate(plan)
    assert at_edge.gates["fidelity.kl_mean"].constraint == 0.0
    assert at_edge.passed and at_edge.summary["passed"] == 1
    assert at_edge.summary["verdict.fidelity.kl_mean"] == "non-inferior"


def test_each_engine_phase_leaves_out_the_compile_seconds_counted_inside_it(monkeypatch):
    # fidelity, needles and structured each compile while they run (distinct amounts): each
    # phase is its wall time (well under 10 s with stand-ins) less its own compile seconds
    def compare(engine, rows, base, *, kv_tokens=None):
        engine.stats.compile_s += 100.0
        return {"kl": np.full((3, 7), 0.01), "top1_agree": np.ones((3, 7), bool),
                "target_logp": np.full((3, 7), -2.0)}  # fmt: skip

    def run_needles(engine, items, *, chunk_tokens=None, kv_tokens=None):
        engine.stats.compile_s += 1000.0
        return [Generated([5, 6], [2.0, 2.0])] * 4

    def run_items(engine, items, max_new_tokens):
        engine.stats.compile_s += 10000.0
        return [Generated([ord(")")], [1.0])] * 2

    monkeypatch.setattr(ev.fidelity, "compare", compare)
    monkeypatch.setattr(ev.needle_grid, "run_needles", run_needles)
    monkeypatch.setattr(ev.structured, "run_items", run_items)
    from tenantq.quant.plan import QuantPlan

    t = _EvalMe()._evaluate(QuantPlan()).timings_s
    assert -100.0 <= t["fidelity"] < -90.0
    assert -1000.0 <= t["needles"] < -990.0
    assert -10000.0 <= t["structured"] < -9990.0
    assert t["compile"] == 11101.25


def test_an_evaluation_of_only_needles_reports_no_fidelity(monkeypatch) -> None:
    monkeypatch.setattr(
        ev.needle_grid, "run_needles", lambda e, items, **kw: [Generated([5, 6], [])] * len(items)
    )
    me = _EvalMe()
    me.fidelity_rows, me.structured_items = None, []
    me.suite = me.suite.model_copy(update={"fidelity": None, "structured": None, "gates": ()})
    me._base["generations"] = me._base["generations"][:4]
    from tenantq.quant.plan import QuantPlan

    result = me._evaluate(QuantPlan())
    assert not any(k.startswith("fidelity.") for k in result.summary)
    assert result.summary["needle.acc_delta.len64"] == 0.0 and result.summary["examples.n"] == 4
    assert result.gates == {} and result.summary["passed"] == 1
    # phases that did not run took no time
    assert result.timings_s["fidelity"] == result.timings_s["structured"] == 0.0


def test_an_evaluation_missing_a_needles_record_is_an_error(monkeypatch) -> None:
    monkeypatch.setattr(
        ev.needle_grid, "run_needles", lambda e, items, **kw: [Generated([5, 6], [])] * 3
    )
    me = _EvalMe()
    me.fidelity_rows, me.structured_items = None, []
    me.suite = me.suite.model_copy(update={"fidelity": None, "structured": None, "gates": ()})
    me._base["generations"] = me._base["generations"][:4]  # the baseline of the 4 needles
    from tenantq.quant.plan import QuantPlan

    with pytest.raises(ValueError, match="zip"):
        me._evaluate(QuantPlan())


def test_a_baseline_missing_a_needles_record_is_an_error(monkeypatch) -> None:
    monkeypatch.setattr(
        ev.needle_grid, "run_needles", lambda e, items, **kw: [Generated([5, 6], [])] * 4
    )
    me = _EvalMe()
    me.fidelity_rows, me.structured_items = None, []
    me.suite = me.suite.model_copy(update={"fidelity": None, "structured": None, "gates": ()})
    me._base["generations"] = me._base["generations"][:3]
    from tenantq.quant.plan import QuantPlan

    with pytest.raises(ValueError, match="zip"):
        me._evaluate(QuantPlan())


@pytest.mark.parametrize("short", ["candidate", "baseline"])
def test_a_structured_record_missing_on_either_side_is_an_error(monkeypatch, short) -> None:
    # a lost record must not pair the remaining ones with the wrong items
    monkeypatch.setattr(
        ev.needle_grid, "run_needles", lambda e, items, **kw: [Generated([5, 6], [])] * 4
    )
    line_end = Generated([ord(")")], [1.0])
    n = 1 if short == "candidate" else 2
    monkeypatch.setattr(ev.structured, "run_items", lambda e, items, m: [line_end] * n)
    me = _EvalMe()
    me.fidelity_rows = None
    me.suite = me.suite.model_copy(update={"fidelity": None, "gates": ()})
    if short == "baseline":
        me._base["generations"] = me._base["generations"][:-1]
    from tenantq.quant.plan import QuantPlan

    with pytest.raises(ValueError, match="zip"):
        me._evaluate(QuantPlan())


def test_an_evaluations_progress_names_each_task_and_counts_to_its_total(
    monkeypatch, capsys
) -> None:
    monkeypatch.setattr(ev.fidelity, "compare", lambda e, r, b, **kw: {
        "kl": np.zeros((3, 7)), "top1_agree": np.ones((3, 7), bool),
        "target_logp": np.full((3, 7), -2.0)})  # fmt: skip
    monkeypatch.setattr(
        ev.needle_grid, "run_needles", lambda e, items, **kw: [Generated([5, 6], [])] * 4
    )
    monkeypatch.setattr(
        ev.structured, "run_items", lambda e, items, n: [Generated([ord(")")], [])] * 2
    )
    shown = []

    class Bar:
        def __init__(self, *, total, disable, **kw):
            shown.append(("total", total, disable))

        def set_description(self, text):
            shown.append(("task", text))

        def update(self, n):
            shown.append(("update", n))

        def close(self):
            shown.append(("close",))

    import tqdm

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    me = _EvalMe()
    me.progress = True
    from tenantq.quant.plan import QuantPlan

    me._evaluate(QuantPlan())
    # one step for fidelity, one per needle spec, one for structured: 1 + 1 + 1
    assert shown == [
        ("total", 3, False), ("task", "fidelity"), ("update", 1), ("task", "needles"),
        ("update", 1), ("task", "structured"), ("update", 1), ("close",),
    ]  # fmt: skip


def test_an_evaluations_kl_interval_resamples_windows_with_the_suites_seed_and_count(
    monkeypatch,
) -> None:
    # the KL CI is the paired bootstrap of the per-window mean KL against 0, drawn with the
    # suite's seed and resamples (the same draw as the other fidelity CIs): a seed dropped on
    # the way to `kl_against_baseline` gives another interval on these uneven windows
    kl = np.random.default_rng(5).exponential(0.02, size=(12, 7))

    def compare(engine, rows, base, *, kv_tokens=None):
        return {"kl": kl, "top1_agree": np.ones((12, 7), bool),
                "target_logp": np.full((12, 7), -2.0)}  # fmt: skip

    monkeypatch.setattr(ev.fidelity, "compare", compare)
    monkeypatch.setattr(
        ev.needle_grid, "run_needles", lambda e, items, **kw: [Generated([5, 6], [])] * 4
    )
    monkeypatch.setattr(
        ev.structured, "run_items", lambda e, items, n: [Generated([ord(")")], [])] * 2
    )
    from tenantq.quant.plan import QuantPlan

    me = _EvalMe()
    me.suite = me.suite.model_copy(update={"seed": 11, "resamples": 50})
    me.fidelity_rows = np.zeros((12, 8), np.int32)
    me._base["fidelity"] = SimpleNamespace(
        target_logp=np.full((12, 7), -2.0), margin=np.ones((12, 7)), exact=True
    )
    s = me._evaluate(QuantPlan()).summary
    per_window = kl.mean(axis=1)
    want = stats.paired_bootstrap(np.zeros(12), per_window, resamples=50, seed=11)
    other = stats.paired_bootstrap(np.zeros(12), per_window, resamples=50, seed=0)
    assert (want.ci_low, want.ci_high) != (other.ci_low, other.ci_high)  # the seed matters
    assert s["fidelity.kl_mean"] == want.delta
    assert (s["fidelity.kl_mean.ci_low"], s["fidelity.kl_mean.ci_high"]) == (
        want.ci_low, want.ci_high,
    )  # fmt: skip


def test_an_evaluation_warns_of_each_group_whose_bf16_pass_rate_is_below_the_bar(
    monkeypatch,
) -> None:
    # bf16 answers 1 of 4 needles (25%) and both structured lines: only the needles' group
    # is under the suite's 60% bar, and the warning reaches the evaluation's summary
    monkeypatch.setattr(ev.fidelity, "compare", lambda e, r, b, **kw: {
        "kl": np.zeros((3, 7)), "top1_agree": np.ones((3, 7), bool),
        "target_logp": np.full((3, 7), -2.0)})  # fmt: skip
    monkeypatch.setattr(
        ev.needle_grid, "run_needles", lambda e, items, **kw: [Generated([5, 6], [])] * 4
    )
    monkeypatch.setattr(
        ev.structured, "run_items", lambda e, items, n: [Generated([ord(")")], [])] * 2
    )
    from tenantq.quant.plan import QuantPlan

    me = _EvalMe()
    me.suite = me.suite.model_copy(update={"min_baseline_pass_rate": 0.6})
    wrong = Generated([5, 7], [])
    me._base["generations"] = [Generated([5, 6], [])] + [wrong] * 3 + me._base["generations"][4:]
    s = me._evaluate(QuantPlan()).summary
    warnings = {k: v for k, v in s.items() if k.startswith("warning.")}
    assert warnings == {
        "warning.needle.len64": "bf16 pass rate 25% (1 of 4) is below the suite's 60%"
    }


def test_a_baseline_holding_a_record_too_many_is_an_error(monkeypatch) -> None:
    # the baseline's one list of generations pairs with the needles then the structured
    # items, position by position: a record too many means it was drawn for other examples
    monkeypatch.setattr(
        ev.needle_grid, "run_needles", lambda e, items, **kw: [Generated([5, 6], [])] * 4
    )
    monkeypatch.setattr(
        ev.structured, "run_items", lambda e, items, m: [Generated([ord(")")], [])] * 2
    )
    me = _EvalMe()
    me.fidelity_rows = None
    me.suite = me.suite.model_copy(update={"fidelity": None, "gates": ()})
    me._base["generations"] = me._base["generations"] + [Generated([ord(")")], [])]
    from tenantq.quant.plan import QuantPlan

    with pytest.raises(ValueError, match="7 generations for 6 needle and structured items"):
        me._evaluate(QuantPlan())


def test_paired_verdicts_are_read_by_their_truth_value() -> None:
    # a scorer may answer with any truthy value (a count of matched tokens, numpy's bool): a
    # pass is a pass, whatever its size, so the figures are those of the booleans
    items = [_needle(64, k) for k in range(6)]
    gens = [Generated([1], [1.0]) for _ in items]
    as_bool = PassFailTask("needles", items, "len", None, None)
    want = as_bool.pair(
        [True, True, False, True, False, True],
        [True, False, False, True, True, False],
        gens,
        gens,
        rows := [],
    )
    loose = PassFailTask("needles", items, "len", None, None)
    got = loose.pair([2, 5, 0, 1, 0, 3], [7, 0, 0, 2, 9, 0], gens, gens, loose_rows := [])
    assert got == want and loose.baseline_passes == as_bool.baseline_passes == {
        "needle.len64": (4, 6)
    }
    drop = ("kl", "top1_agree")  # nan in both
    assert [{k: v for k, v in r.items() if k not in drop} for r in loose_rows] == [
        {k: v for k, v in r.items() if k not in drop} for r in rows
    ]
    assert [r["flip"] for r in loose_rows] == [
        "",
        "correct_to_wrong",
        "",
        "",
        "wrong_to_correct",
        "correct_to_wrong",
    ]
    assert [r["baseline_score"] for r in loose_rows] == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]


def test_a_pass_fail_row_without_a_length_or_depth_takes_its_prompts_length() -> None:
    rows = []
    me = PassFailTask(
        "structured",
        [SimpleNamespace(task="structured", task_name="t", example_id="s/0", prompt=[1, 2, 3])],
        "task",
        None,
        None,
    )
    me.pair([True], [True], [Generated([1], [])], [Generated([1], [])], rows)
    assert rows[0]["length"] == 3 and math.isnan(rows[0]["depth"])


@pytest.mark.parametrize(
    ("everyone_has", "computed"),
    [
        ((True, True), []),  # every host holds both caches: all read them
        ((False, True), ["fidelity"]),  # a host lacks the fidelity cache: all recompute it
        ((True, False), ["generations"]),
        ((False, False), ["fidelity", "generations"]),
    ],
)
def test_hosts_of_a_slice_take_the_cached_baseline_only_when_every_host_has_it(
    tmp_path, monkeypatch, everyone_has, computed
) -> None:
    from tenantq.engine import sharding

    calls = []
    monkeypatch.setattr(ev.fidelity, "compute_baseline", _fake_baseline(calls))
    _BaselineMe(tmp_path).baseline()  # both caches on this host's disk
    calls.clear()
    asked, answers = [], iter(everyone_has)

    def on_every_host(flag):
        inspect.signature(sharding.on_every_host).bind(flag)
        asked.append(flag)
        return next(answers)

    monkeypatch.setattr(sharding, "on_every_host", on_every_host)
    monkeypatch.setattr(ev.jax, "process_count", lambda: 2)
    me = _BaselineMe(tmp_path)
    out = me.baseline()
    assert asked == [True, True]  # this host's own answer for each cache, fidelity first
    assert ("fidelity" in computed) == (len(calls) == 1)
    assert me.generated == ([("engine", 2)] if "generations" in computed else [])
    assert out["fidelity"] is not None and len(out["generations"]) == 2
    # one process: nobody else to ask
    monkeypatch.setattr(ev.jax, "process_count", lambda: 1)
    asked.clear()
    _BaselineMe(tmp_path).baseline()
    assert asked == []


@pytest.mark.parametrize(("mesh", "processes", "host"), [
    ("mesh", 2, True), (None, 2, False), ("mesh", 1, False),
])  # fmt: skip
def test_a_sharded_evaluation_on_a_slice_reports_this_hosts_memory(
    monkeypatch, mesh, processes, host
) -> None:
    monkeypatch.setattr(ev.fidelity, "compare", lambda e, r, b, **kw: {
        "kl": np.zeros((3, 7)), "top1_agree": np.ones((3, 7), bool),
        "target_logp": np.full((3, 7), -2.0)})  # fmt: skip
    monkeypatch.setattr(
        ev.needle_grid, "run_needles", lambda e, items, **kw: [Generated([5, 6], [])] * 4
    )
    monkeypatch.setattr(
        ev.structured, "run_items", lambda e, items, n: [Generated([ord(")")], [])] * 2
    )
    monkeypatch.setattr(ev.jax, "process_count", lambda: processes)
    from tenantq.quant.plan import QuantPlan

    me = _EvalMe()
    me.engine.mesh, me.engine.host_memory = mesh, lambda: {"rss_bytes": 5}
    memory = me._evaluate(QuantPlan()).memory_report
    assert memory == ({"pool_bytes": 10, "host": {"rss_bytes": 5}} if host else {"pool_bytes": 10})


def test_the_progress_bar_counts_tasks_and_leaves_no_line(monkeypatch) -> None:
    from tenantq.model import terminal

    real, seen = terminal.progress_bar, []

    def progress_bar(*args, **kwargs):
        bound = inspect.signature(real).bind(*args, **kwargs)
        bound.apply_defaults()
        seen.append(dict(bound.arguments))
        return "bar"

    monkeypatch.setattr(terminal, "progress_bar", progress_bar)
    assert ev._progress(True, 5) == "bar" and ev._progress(False, 0) == "bar"
    assert seen == [
        {"total": 5, "enabled": True, "initial": 0, "options": {"unit": "task", "leave": False}},
        {"total": 0, "enabled": False, "initial": 0, "options": {"unit": "task", "leave": False}},
    ]


def test_a_results_parquet_keeps_the_tables_own_metadata(tmp_path) -> None:
    table = ev._examples_table([]).replace_schema_metadata({b"origin": b"test"})
    result = ev.EvalResult({"a": 1}, {}, table, {"total": 1.0}, {})
    meta = pq.read_table(result.to_parquet(tmp_path / "r.parquet")).schema.metadata
    assert meta[b"origin"] == b"test" and b"tenantq.summary" in meta


def test_a_groups_mcnemar_p_is_found_when_its_name_holds_acc_delta() -> None:
    # the p-value's key replaces the figure's name only (`pass_fail_key`), so a structured
    # task whose own name begins with "acc_delta" keeps it: structured.mcnemar_p.acc_delta
    items = [_struct("acc_delta", k) for k in range(8)]
    gens = [Generated([1], [])] * 8
    summary = PassFailTask("structured", items, "task", None, None).pair(
        [1] * 8, [0] * 7 + [1], gens, gens, []
    )
    assert "structured.mcnemar_p.acc_delta" in summary
    metric = "structured.acc_delta.acc_delta"
    # model_copy: the suite's validation does not know this task's name
    suite = _suite().model_copy(
        update={"gates": (GateSpec(metric=metric, tolerance=0.2, higher_is_better=True),)}
    )
    gate = ev.gates_for(suite, summary)[metric]
    # 7 correct->wrong flips of 8: McNemar p = 2 / 2^7 = 1/64 <= 0.05
    assert summary["structured.mcnemar_p.acc_delta"] == 1 / 64 and gate.changed
    assert gate.value == -7 / 8


def test_cached_generations_keep_int32_tokens_and_float64_margins(tmp_path) -> None:
    # the columns' types are fixed, not inferred from the records: a cache whose records
    # happen to hold no margins (a needle failed at its first token) still reads as floats
    items = [_needle(64, 0), _struct("close_line", 1)]
    path = tmp_path / "g.parquet"
    ev._save_generations([Generated([3, 4], [0.5]), Generated([7], [])], items, path)
    schema = pq.read_schema(path)
    assert schema.field("tokens").type == pa.list_(pa.int32())
    assert schema.field("margins").type == pa.list_(pa.float64())
    ev._save_generations([Generated([], []), Generated([1], [])], items, path)
    assert pq.read_schema(path).field("margins").type == pa.list_(pa.float64())
    assert pq.read_schema(path).field("tokens").type == pa.list_(pa.int32())


def test_the_baseline_cache_folder_is_made_with_its_parents(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(ev.fidelity, "compute_baseline", _fake_baseline([]))
    folder = tmp_path / "a" / "b" / "cache"
    _BaselineMe(folder).baseline()
    assert sorted(p.name for p in folder.iterdir()) == [
        "baseline-k1-fidelity.parquet", "baseline-k1-generations.parquet"
    ]  # fmt: skip
    # an existing folder is used as it is (another key's baseline into the same folder)
    _BaselineMe(folder, key="k2").baseline()
    assert len(list(folder.iterdir())) == 4


@pytest.mark.parametrize("short", ["baseline", "candidate"])
def test_pairing_verdicts_with_a_record_missing_is_an_error(short) -> None:
    # four items, four verdicts each side, one generation record short on one side: the
    # rows would pair the rest with the wrong items (or drop the last) without a word
    items = [_needle(64, k) for k in range(4)]
    gens = [Generated([k], [1.0]) for k in range(4)]
    base_gens, cand_gens = (gens[:3], gens) if short == "baseline" else (gens, gens[:3])
    me = PassFailTask("needles", items, "len", None, None)
    with pytest.raises(ValueError, match="zip"):
        me.pair([1, 1, 0, 1], [1, 0, 0, 1], base_gens, cand_gens, [])


def test_an_evaluations_timings_are_each_phases_seconds_to_a_tenth_of_a_millisecond(
    monkeypatch,
) -> None:
    # a clock that moves only when a stand-in works: each phase's seconds are known exactly,
    # and reported rounded to 4 decimals (0.1 ms)
    clock = {"now": 50.0}
    monkeypatch.setattr(ev.time, "perf_counter", lambda: clock["now"])

    def spend(seconds, compiled=0.0):
        clock["now"] += seconds
        me.engine.stats.compile_s += compiled

    def compare(engine, rows, base, *, kv_tokens=None):
        spend(0.123456, compiled=0.1)
        return {"kl": np.zeros((3, 7)), "top1_agree": np.ones((3, 7), bool),
                "target_logp": np.full((3, 7), -2.0)}  # fmt: skip

    def run_needles(engine, items, **kw):
        spend(2.0000444)
        return [Generated([5, 6], [])] * 4

    def run_items(engine, items, n):
        spend(1.5)
        return [Generated([ord(")")], [])] * 2

    monkeypatch.setattr(ev.fidelity, "compare", compare)
    monkeypatch.setattr(ev.needle_grid, "run_needles", run_needles)
    monkeypatch.setattr(ev.structured, "run_items", run_items)
    from tenantq.quant.plan import QuantPlan

    me = _EvalMe()
    base, build = me.baseline, me.build_engine
    monkeypatch.setattr(me, "baseline", lambda: spend(4.25) or base())
    monkeypatch.setattr(me, "build_engine", lambda plan: spend(0.00006) or build(plan))
    t = me._evaluate(QuantPlan()).timings_s
    assert t == {
        "load": 7.0, "baseline": 4.25, "quantize": 0.0001, "compile": 1.35,
        "fidelity": round(0.123456 - 0.1, 4), "needles": 2.0, "structured": 1.5,
        "total": round(7.0 + 4.25 + 0.00006 + 0.123456 + 2.0000444 + 1.5, 4),
    }  # fmt: skip
    assert t["fidelity"] == pytest.approx(0.0235) and t["total"] == pytest.approx(14.8736)
