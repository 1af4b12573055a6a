"""Teacher-forced continuation logits (`Engine.continuation_logits`) on the tiny random model.

Bounds: float32 compute is exact arithmetic up to reassociation (a chunked prefill and decode
sum the same terms in other orders), so logits agree to 1e-4 absolute on logits of size < 10
(~1000 float32 ulps; measured <= 2e-6). bf16 compute rounds activations to 8 significant
bits; chunked and single prefills use different shapes, so their logits may differ by a few
bf16 steps at the logits' size (bound: 4 steps of the largest |logit|). The greedy record's
tokens must be equal, not close: their margins here are far above those bounds (checked).
"""

from __future__ import annotations

import numpy as np
import pytest

from tenantq.engine import Engine
from tenantq.evals.generation import generate_with_margins, teacher_forced_with_margins
from tenantq.quant.plan import KVPlan, QuantPlan

# Three prompts of different lengths; the longest crosses two 16-token steps.
PROMPTS = [[5, 9, 13, 1, 22, 40, 7], [7, 3, 8], [11, 12, 60, 4, 30, 8] * 4 + [2]]
KV_TOKEN_INT8 = QuantPlan(kv=KVPlan("int8", "token", "int8", "token"))


def _engine(config, params, plan=None, dtype="float32"):
    return Engine(config, params, plan, dtype=dtype, max_seqs=4, max_seq_tokens=64, page_tokens=8)


@pytest.fixture(scope="module")
def engine(config, params):
    return _engine(config, params)


def test_chunked_prefill_equals_one_prefill_in_float32(engine):
    conts = [[3, 4, 5], [6], [9, 10]]
    whole = engine.continuation_logits(PROMPTS, conts)
    chunked = engine.continuation_logits(PROMPTS, conts, chunk_tokens=16, kv_tokens=64)
    for p, c, a, b in zip(PROMPTS, conts, whole, chunked, strict=True):
        assert a.shape == b.shape == (len(c), engine.config.vocab_size)
        np.testing.assert_allclose(b, a, atol=1e-4, rtol=0)
        # and both equal a plain prefill's logits at the positions that choose c
        full = engine.logits([p + c[:-1]])[0]
        np.testing.assert_allclose(a, full[len(p) - 1 :], atol=1e-4, rtol=0)


def test_chunked_prefill_in_bf16_within_a_few_bf16_steps(config, params):
    eng = _engine(config, params, dtype="bfloat16")
    conts = [[3, 4, 5], [6], [9, 10]]
    whole = eng.continuation_logits(PROMPTS, conts)
    chunked = eng.continuation_logits(PROMPTS, conts, chunk_tokens=16, kv_tokens=64)
    for a, b in zip(whole, chunked, strict=True):
        step = 2.0 ** (np.floor(np.log2(np.abs(a).max())) - 7)  # bf16: 8 significant bits
        assert np.abs(a - b).max() <= 4 * step


@pytest.mark.parametrize("plan", [None, KV_TOKEN_INT8], ids=["bf16_kv", "int8_token_kv"])
def test_teacher_forced_record_is_greedy_up_to_the_first_wrong_token(config, params, plan):
    eng = _engine(config, params, plan)
    greedy = generate_with_margins(eng, PROMPTS, 4)
    assert all(eng.teacher_forcing_exact(len(p), 4) for p in PROMPTS)
    answers = [g.tokens for g in greedy]
    forced = teacher_forced_with_margins(eng, PROMPTS, answers, chunk_tokens=16, kv_tokens=64)
    for g, f in zip(greedy, forced, strict=True):
        assert f.tokens == g.tokens
        np.testing.assert_allclose(f.margins, g.margins, atol=1e-4, rtol=0)
        assert min(g.margins) > 1e-3  # so the argmaxes are not decided by reassociation
    # an answer wrong from its third token: the record stops there, equal to greedy's start
    wrong = [a[:2] + [(a[2] + 1) % config.vocab_size, a[3]] for a in answers]
    cut = teacher_forced_with_margins(eng, PROMPTS, wrong, chunk_tokens=16, kv_tokens=64)
    for g, f in zip(greedy, cut, strict=True):
        assert f.tokens == g.tokens[:3] and len(f.margins) == 3
        np.testing.assert_allclose(f.margins, g.margins[:3], atol=1e-4, rtol=0)


def test_one_step_shape_compiles_once_for_any_prompt_lengths(config, params):
    eng = _engine(config, params, QuantPlan(kv=KVPlan("int8", "channel", "fp8_e4m3", "token")))
    eng.continuation_logits(PROMPTS, [[1, 2]] * 3, chunk_tokens=16, kv_tokens=64)
    after_first = eng.stats.compiles
    assert after_first <= 2  # the body [4, 16] at window 64, and the head [4, 16]
    later = [[4] * 40, [5] * 3, [6] * 17]
    eng.continuation_logits(later, [[6, 7, 8], [9], [1]], chunk_tokens=16, kv_tokens=64)
    assert eng.stats.compiles == after_first


def test_teacher_forcing_exact_follows_the_page_rule(config, params):
    # channel-scaled keys wait in a bf16 page until it fills: exact iff the prefill of
    # prompt + answer[:-1] fills no page that was partial when decode read it (page = 8)
    eng = _engine(config, params, QuantPlan(kv=KVPlan("int8", "channel", "bf16", "token")))
    assert eng.teacher_forcing_exact(10, 5)  # writes 0..13: page 1 (8..15) still partial
    assert not eng.teacher_forcing_exact(14, 3)  # writes 0..15: page 1 fills
    assert eng.teacher_forcing_exact(14, 2)  # writes 0..14
    assert eng.teacher_forcing_exact(13, 1)  # one token: nothing beyond the prompt
    assert _engine(config, params, KV_TOKEN_INT8).teacher_forcing_exact(14, 9)
    nvfp4 = _engine(config, params, QuantPlan(kv=KVPlan("bf16", "channel", "nvfp4", "token")))
    assert not nvfp4.teacher_forcing_exact(10, 2) and nvfp4.teacher_forcing_exact(10, 1)


def test_where_the_rule_says_inexact_teacher_forcing_does_differ(config, params):
    # 14 prompt tokens + 4: the prefill fills page 1 (8..15), which decode read from the bf16
    # residual; the margins then differ by more than float32 reassociation (1e-4; measured
    # ~3e-3), which is why run_needles decodes such needles instead
    eng = _engine(config, params, QuantPlan(kv=KVPlan("int8", "channel", "int8", "channel")))
    prompt = [[5] * 6 + [9, 13, 1, 22, 40, 7, 2, 3]]
    assert not eng.teacher_forcing_exact(14, 4)
    greedy = generate_with_margins(eng, prompt, 4)[0]
    forced = teacher_forced_with_margins(eng, prompt, [greedy.tokens], chunk_tokens=16)[0]
    assert np.abs(np.subtract(forced.margins, greedy.margins)).max() > 1e-4


def test_bad_continuations_are_refused(engine):
    with pytest.raises(ValueError, match="2 prompts but 1 continuations"):
        engine.continuation_logits(PROMPTS[:2], [[1]])
    with pytest.raises(ValueError, match="continuations: row 0 is empty"):
        engine.continuation_logits(PROMPTS[:1], [[]])
    with pytest.raises(ValueError, match="chunk_tokens must be a whole number >= 1"):
        engine.continuation_logits(PROMPTS[:1], [[1]], chunk_tokens=0)


def test_teacher_forcing_exact_takes_the_prefill_step(config, params):
    # channel keys, page 8: a 12-token step ends mid-page, so page 1 (8..15) is still filling
    # when positions 8..11 are computed, while generate (a 20-token prompt in one call) read
    # it full; a 16-token step writes whole pages and agrees with decode
    eng = _engine(config, params, QuantPlan(kv=KVPlan("int8", "channel", "bf16", "token")))
    assert not eng.teacher_forcing_exact(20, 2, 12)
    assert eng.teacher_forcing_exact(20, 2, 16)
    assert eng.teacher_forcing_exact(20, 2)  # one prefill of the whole row
    assert eng.teacher_forcing_exact(20, 2, 8)
    # nvfp4 values: the 12-token step opens page 1 with 4 tokens, generate's prompt with 8
    nvfp4 = _engine(config, params, QuantPlan(kv=KVPlan("bf16", "channel", "nvfp4", "token")))
    assert not nvfp4.teacher_forcing_exact(20, 1, 12)
    assert nvfp4.teacher_forcing_exact(20, 1, 16) and nvfp4.teacher_forcing_exact(20, 1, 8)
    # a page opened by the first decoded token: one token either way, so exact
    assert nvfp4.teacher_forcing_exact(16, 2, 8) and not nvfp4.teacher_forcing_exact(16, 3, 8)
    # per-token int8 writes every token alike: any step is exact
    assert _engine(config, params, KV_TOKEN_INT8).teacher_forcing_exact(20, 9, 12)


def test_a_misaligned_step_the_rule_refuses_does_differ_from_decoding(config, params):
    # the case above on the model: forcing anyway moves the margins by more than float32
    # reassociation (1e-4); the aligned step stays within it
    eng = _engine(config, params, QuantPlan(kv=KVPlan("int8", "channel", "int8", "channel")))
    prompt = [[5, 9, 13, 1, 22, 40, 7, 2, 3, 11] * 2]
    greedy = generate_with_margins(eng, prompt, 2)[0]
    misaligned = teacher_forced_with_margins(eng, prompt, [greedy.tokens], chunk_tokens=12)[0]
    aligned = teacher_forced_with_margins(eng, prompt, [greedy.tokens], chunk_tokens=16)[0]
    assert np.abs(np.subtract(misaligned.margins, greedy.margins)).max() > 1e-4
    np.testing.assert_allclose(aligned.margins, greedy.margins, atol=1e-4, rtol=0)
