"""The quick suite's needles, teacher-forced, against greedy decoding on the reference model.

Bounds: pass/fail must be equal per needle (the argmaxes along the answer decide it, and the
record is greedy's up to the first wrong token). Margins: the engine computes in bf16, and a
[16, 256] prefill step and a [16, 1] decode step round their activations differently, so a
margin (difference of two bf16 logits) may move by a few bf16 steps at the logits' size;
bound 4 steps of the largest |logit| (8 significant bits; measured: at most 2 steps).
The quick suite compiles one body [16, 256] at a KV window of 1024 and one head per layout.
"""

from __future__ import annotations

import numpy as np
import pytest

from tenantq.engine import steps
from tenantq.evals import Evaluator, load_suite, needle_grid
from tenantq.quant.plan import KVPlan, QuantPlan, Rule
from tenantq.reference import reference_model_path

PLANS = {
    "bf16": QuantPlan(),
    "int4w_int8kv_channel": QuantPlan(
        rules=(Rule("layers/.*", "int4", group_size=64),),
        kv=KVPlan("int8", "channel", "int8", "token"),
    ),
    "fp8w_int4kv_token": QuantPlan(
        rules=(Rule(".*", "fp8_e4m3"),), kv=KVPlan("int4", "token", "int4", "token")
    ),
}


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    return Evaluator(
        reference_model_path(), load_suite("quick"), cache_dir=tmp_path_factory.mktemp("tf")
    )


@pytest.mark.slow
def test_quick_suite_compiles_one_body_and_one_head_per_layout(quick):
    assert (quick.step_tokens, quick.kv_window_tokens) == (256, 1024)
    quick.baseline()
    steps._EXECUTABLES.clear()  # the plan's layout is new to this process from here on
    result = quick.evaluate(PLANS["int4w_int8kv_channel"])
    assert steps.compiled_count() == 2  # body [16, 256] at window 1024 + head [16, 256]
    assert result.summary["needle.acc_delta.len1019"] is not None


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS))
def test_teacher_forced_needles_equal_greedy(quick, name):
    items = quick.needle_items
    engine = quick.build_engine(PLANS[name])
    assert all(engine.teacher_forcing_exact(len(i.prompt), len(i.answer)) for i in items)
    shape = {"chunk_tokens": quick.step_tokens, "kv_tokens": quick.kv_window_tokens}
    logits = engine.continuation_logits(
        [i.prompt for i in items], [i.answer.tolist() for i in items], **shape
    )
    forced = needle_grid.run_needles(engine, items, **shape)
    greedy = needle_grid.run_needles(engine, items, teacher_forced=False)
    step = 2.0 ** (np.floor(np.log2(max(np.abs(x).max() for x in logits))) - 7)
    for item, f, g in zip(items, forced, greedy, strict=True):
        assert needle_grid.score(item, f) == needle_grid.score(item, g), item.example_id
        n = len(f.tokens)
        assert f.tokens == g.tokens[:n]
        assert np.abs(np.subtract(f.margins, g.margins[:n])).max() <= 4 * step, item.example_id


@pytest.mark.slow
def test_a_suite_whose_rows_are_not_whole_pages_decodes_its_needles(tmp_path):
    # row_tokens 100 on 16-token pages: the needles' 100-token steps end mid-page, so with
    # channel-scaled keys no needle is teacher-forced (the engine's rule says inexact) and
    # every record is greedy decoding's, token for token and margin for margin
    from tenantq.evals.suite import FidelitySpec, NeedleSpec, Suite

    suite = Suite(
        name="misaligned",
        fidelity=FidelitySpec(rows=2, row_tokens=100),
        needles=(NeedleSpec(lengths=(200,), per_length=3),),
    )
    ev = Evaluator(reference_model_path(), suite, cache_dir=tmp_path)
    engine = ev.build_engine(PLANS["int4w_int8kv_channel"])
    assert ev.step_tokens == 100 and engine.cache.page_tokens == 16
    items = ev.needle_items
    assert not any(
        engine.teacher_forcing_exact(len(i.prompt), len(i.answer), ev.step_tokens) for i in items
    )
    forced = needle_grid.run_needles(
        engine, items, chunk_tokens=ev.step_tokens, kv_tokens=ev.kv_window_tokens
    )
    greedy = needle_grid.run_needles(engine, items, teacher_forced=False)
    for f, g in zip(forced, greedy, strict=True):
        assert f.tokens == g.tokens and f.margins == g.margins
