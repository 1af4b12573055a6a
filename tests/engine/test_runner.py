"""Engine behaviour on a tiny random model: generation, scoring, batching, jit reuse, memory."""

from __future__ import annotations

import numpy as np
import pytest

# tests/engine is on sys.path (pytest's rootdir import mode), as for _sharding_check.
from test_numpy_forward import numpy_logits

from tenantq.engine import CacheFull, ContiguousCache, Engine
from tenantq.model.decoder import init_params
from tenantq.numerics import storage_nbytes
from tenantq.quant.plan import KVPlan, QuantPlan, Rule

PROMPTS = [[5, 9, 13, 1], [7, 3], [11, 12, 60, 4, 30, 8]]


@pytest.fixture(scope="module")
def engine(config, params):
    return Engine(config, params, dtype="float32", max_seqs=4, max_seq_tokens=64)


def test_greedy_generation_is_deterministic(engine, config, params):
    first = engine.generate(PROMPTS, 8, stop_tokens=())
    assert [len(g) for g in first] == [8, 8, 8]
    assert engine.generate(PROMPTS, 8, stop_tokens=()) == first
    fresh = Engine(config, params, dtype="float32", max_seqs=4, max_seq_tokens=64)
    assert fresh.generate(PROMPTS, 8, stop_tokens=()) == first


def test_greedy_decode_through_cache_matches_full_prefill_argmax(engine):
    generated = engine.generate([PROMPTS[2]], 5, stop_tokens=())[0]
    seq = list(PROMPTS[2])
    for token in generated:
        assert int(np.argmax(engine.logits([seq])[0, -1])) == token
        seq.append(token)


def test_stop_tokens_end_generation_before_the_stop(engine):
    full = engine.generate(PROMPTS, 6, stop_tokens=())
    stop = full[0][2]
    cut = engine.generate(PROMPTS, 6, stop_tokens=[stop])
    assert cut[0] == full[0][: full[0].index(stop)]
    for row, whole in zip(cut[1:], full[1:], strict=True):
        assert row == (whole[: whole.index(stop)] if stop in whole else whole)
    assert engine.generate(PROMPTS, 0) == [[], [], []]


def test_score_is_the_log_softmax_of_prefill_logits(engine):
    prompts, conts = [[5, 9], [7]], [[13, 1, 40], [3, 3]]
    scores = engine.score(prompts, conts)
    for p, c, s in zip(prompts, conts, scores, strict=True):
        logits = engine.logits([p + c])[0].astype(np.float64)
        logp = logits - np.log(
            np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)
        )
        logp -= logits.max(-1, keepdims=True)
        want = [logp[len(p) - 1 + i, t] for i, t in enumerate(c)]
        assert s.dtype == np.float32 and s.shape == (len(c),)
        np.testing.assert_allclose(s, want, atol=1e-5)


def test_batches_pad_and_chunk_without_changing_results(engine):
    rows = PROMPTS + [[1, 2, 3], [9] * 7, [4]]  # six rows: chunks of four and two
    together = engine.logits(rows)
    generated = engine.generate(rows, 3, stop_tokens=())
    for i, r in enumerate(rows):
        np.testing.assert_allclose(together[i, : len(r)], engine.logits([r])[0], atol=1e-5)
        assert not together[i, len(r) :].any()
        assert generated[i] == engine.generate([r], 3, stop_tokens=())[0]


def test_same_layout_reuses_compiled_steps_and_new_format_compiles(config, params):
    plan = QuantPlan.uniform("int8")
    warm = Engine(config, params, plan, max_seqs=2, max_seq_tokens=32)
    warm.generate([[1, 2, 3]], 3)
    assert warm.stats.compiles > 0 and warm.stats.compile_s > 0
    other_values = Engine(config, init_params(config, seed=7), plan, max_seqs=2, max_seq_tokens=32)
    other_values.generate([[4, 5, 6]], 3)
    assert other_values.stats.compiles == 0  # same plan layout, different weights: no compile
    assert other_values.stats.prefill_tokens == 3 and other_values.stats.decode_tokens == 2
    int4 = Engine(config, params, QuantPlan.uniform("int4"), max_seqs=2, max_seq_tokens=32)
    int4.generate([[1, 2, 3]], 3)
    assert int4.stats.compiles > 0


def test_memory_report_counts_true_storage_bytes(config, params):
    plan = QuantPlan(rules=(Rule("layers/.*/mlp/.*", "int4"), Rule("lm_head", "nvfp4")))
    eng = Engine(config, params, plan, max_seqs=3, max_seq_tokens=32)
    report = eng.memory_report()
    tensors = config.tensors()
    for path, info in tensors.items():
        if "/mlp/" in path:
            want = storage_nbytes(info.shape, "int4", axis=0, group_size=128)
        elif path == "lm_head":
            want = storage_nbytes(info.shape, "nvfp4", axis=0)
        else:
            want = info.numel * 2  # bf16
        assert report.weight_bytes[path] == want, path
    assert report.weight_formats["layers/1/mlp/down_proj"] == "int4"
    assert report.weight_formats["embed"] == "bf16"
    kv = config.num_kv_heads * config.head_dim
    assert report.cache_bytes == 2 * config.num_layers * 3 * 32 * kv * 2


def _moved_logits(config, params64, tokens, nudge, seed) -> float:
    """max |logits| change of the float64 numpy forward when every quantizable weight w moves
    by nudge(path, w) with random signs: how this model amplifies errors of that size."""
    rng = np.random.default_rng(seed)
    tensors = config.tensors()
    moved = {
        k: v + nudge(tensors[k], v) * rng.choice([-1.0, 1.0], v.shape)
        if tensors[k].quant_axis is not None
        else v
        for k, v in params64.items()
    }
    want = numpy_logits(config, params64, tokens)
    return float(np.abs(numpy_logits(config, moved, tokens) - want).max())


def _bf16_bound(config, params64, tokens) -> float:
    """bf16 keeps 8 significant bits: one rounding moves a value by at most 2^-8 relative.
    Each matmul product carries two such roundings (its bf16 weight and its bf16 input), so
    weights moved by 2 x 2^-8 relative bound their effect; the logits' own bf16 rounding
    adds 2^-8 of the largest logit."""
    want = numpy_logits(config, params64, tokens)
    moved = _moved_logits(config, params64, tokens, lambda info, w: 2 * 2.0**-8 * np.abs(w), 1)
    return moved + 2.0**-8 * float(np.abs(want).max())


def _w8a8_bound(config, params64, tokens) -> float:
    """W8A8 int8: a weight rounds to half a step of its channel's scale, amax / 127 / 2
    (one scale per output channel), and each input to half a step of its token's scale, of
    the same relative size for rows and columns of similar spread (tests/engine/
    test_w8a8_tokens.py): weights moved by one full step, amax / 127, bound both. Everything
    between the matmuls is still bf16: the bf16 bound is added."""

    def step(info, w):
        return np.abs(w).max(axis=info.quant_axis, keepdims=True) / 127

    return _moved_logits(config, params64, tokens, step, 2) + _bf16_bound(config, params64, tokens)


@pytest.mark.parametrize(
    ("plan", "bound_of"),
    [
        (None, _bf16_bound),
        (QuantPlan((Rule(".*", "int8", activations="int8"),)), _w8a8_bound),
    ],
    ids=["bf16", "w8a8-int8"],
)
def test_bf16_and_w8a8_engines_track_the_float64_forward(config, params, plan, bound_of):
    # Anchored on the independent numpy forward (tests/engine/test_numpy_forward.py), not on
    # the float32 engine: an error every engine path shares cannot hide. On the tiny model:
    # bf16 error 0.021-0.023 within bounds 0.066-0.110 (was 5% of the largest logit, 0.15);
    # W8A8 error 0.056-0.077 within 0.19-0.26 (was 10%, 0.30); RoPE reversed: 0.63-1.12.
    params64 = {k: np.asarray(v, np.float64) for k, v in params.items()}
    got = Engine(config, params, plan, max_seqs=4, max_seq_tokens=64).logits(PROMPTS)
    for i, tokens in enumerate(PROMPTS):
        want = numpy_logits(config, params64, tokens)
        bound = bound_of(config, params64, tokens)
        err = np.abs(got[i, : len(tokens)] - want).max()
        assert err <= bound, (i, err, bound)
        # The bound can see a real error: RoPE reversed lands outside it.
        reversed_rope = numpy_logits(config, params64, tokens, rope_sign=-1.0)
        assert np.abs(reversed_rope - want).max() > bound, i


def test_w4a8_engine_tracks_the_float64_forward_of_its_int4_weights(config, params):
    # W4A8 (int4 weights in groups of 16, int8 per-token inputs) against the numpy forward of
    # the weights it stores (int4, dequantized in float64): what remains is the int8 input
    # rounding, bounded as W8A8's (one int8 step per channel), plus bf16 between matmuls.
    from tenantq.numerics import dequantize, quantize

    plan = QuantPlan((Rule(".*_proj|lm_head", "int4", group_size=16, activations="int8"),))
    resolved = plan.resolve(config)
    params64 = {
        k: np.asarray(
            dequantize(quantize(v, "int4", axis=0, group_size=16)) if k in resolved else v,
            np.float64,
        )
        for k, v in params.items()
    }
    got = Engine(config, params, plan, max_seqs=4, max_seq_tokens=64).logits(PROMPTS)
    for i, tokens in enumerate(PROMPTS):
        want = numpy_logits(config, params64, tokens)
        bound = _w8a8_bound(config, params64, tokens)
        err = np.abs(got[i, : len(tokens)] - want).max()
        assert err <= bound, (i, err, bound)
        reversed_rope = numpy_logits(config, params64, tokens, rope_sign=-1.0)
        assert np.abs(reversed_rope - want).max() > bound, i


def test_quantized_kv_plans_need_the_paged_pool(config, params):
    plan = QuantPlan(kv=KVPlan(key_format="fp8_e4m3"))
    with pytest.raises(NotImplementedError, match="paged KV pool"):
        Engine(config, params, plan, cache=ContiguousCache(config, dtype="bfloat16"))
    assert Engine(config, params, plan).memory_report().kv_layers[0]["key_format"] == "fp8_e4m3"


def test_too_long_and_too_many_sequences_fail_clearly(config, params):
    eng = Engine(config, params, dtype="float32", max_seqs=2, max_seq_tokens=16)
    with pytest.raises(CacheFull, match="max_seq_tokens=16"):
        eng.generate([[1] * 10], 10)
    with pytest.raises(ValueError, match="max_seqs=2"):
        eng.prefill([[1], [2], [3]])
    batch, _ = eng.prefill([[1, 2]], reserve_tokens=2)  # a failed call leaked no slot
    eng.prefill([[3]])
    with pytest.raises(CacheFull, match="slots are in use"):
        eng.prefill([[4]])
    eng.release(batch)


def test_every_architecture_switch_runs_end_to_end(make_config):
    # Bias (Qwen2), q/k norm (Qwen3) and a sliding window (Mistral) at once; parity with
    # transformers checks each architecture's numbers, this checks they run quantized.
    cfg = make_config(
        model_type="qwen3",
        attention_bias=True,
        qk_norm=True,
        layer_types=("sliding", "full"),
        sliding_window=3,
    )
    eng = Engine(cfg, init_params(cfg, seed=3), QuantPlan.uniform("mxfp4"), max_seqs=1)
    out = eng.generate([[1, 2, 3, 4, 5]], 4, stop_tokens=())
    assert len(out[0]) == 4 and all(0 <= t < cfg.vocab_size for t in out[0])
