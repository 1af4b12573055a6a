"""The engine against an independent numpy forward pass of the same Llama, in float64.

The engine's other tests compare it with itself (prefill vs decode, paged vs contiguous);
a mistake shared by every path (RoPE turning the wrong way, keys paired with the wrong
query heads, a norm epsilon misplaced) passes them all. This file writes the decoder once
more from the published definitions, with nothing taken from `tenantq.model`:
RMSNorm (Zhang & Sennrich 2019), RoPE as a rotation of the pairs (x_j, x_{j+d/2}) by
position * theta^(-2j/d) (Su et al. 2021, in the Hugging Face Llama layout), grouped-query
causal attention (query head h reads KV head h // (heads / kv_heads)), SwiGLU MLP.
"""

from __future__ import annotations

import numpy as np
import pytest

from tenantq.engine import Engine

PROMPTS = [[5, 9, 13, 1, 40, 22, 7, 3, 61, 17, 2, 30], [7, 3, 33, 8, 19]]


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, positions: np.ndarray, theta: float, sign: float = 1.0) -> np.ndarray:
    """x [S, heads, d] rotated pairwise: (a, b) -> (a cos - b sin, a sin + b cos)."""
    d = x.shape[-1]
    freq = theta ** (-np.arange(0, d, 2) / d)  # [d/2]
    angle = sign * positions[:, None, None] * freq  # [S, 1, d/2]
    a, b = x[..., : d // 2], x[..., d // 2 :]
    cos, sin = np.cos(angle), np.sin(angle)
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def numpy_logits(config, params, tokens, *, rope_sign: float = 1.0) -> np.ndarray:
    """Float64 logits [S, vocab] of one sequence, from the flat params dict."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    h, hkv, d, eps = config.num_heads, config.num_kv_heads, config.head_dim, config.rms_norm_eps
    s = len(tokens)
    pos = np.arange(s, dtype=np.float64)
    x = p["embed"][np.asarray(tokens)]
    causal = np.tril(np.ones((s, s), bool))
    for i in range(config.num_layers):
        pre = f"layers/{i}"
        y = _rms_norm(x, p[f"{pre}/input_norm"], eps)
        q = (y @ p[f"{pre}/attn/q_proj"]).reshape(s, h, d)
        k = (y @ p[f"{pre}/attn/k_proj"]).reshape(s, hkv, d)
        v = (y @ p[f"{pre}/attn/v_proj"]).reshape(s, hkv, d)
        q = _rope(q, pos, config.rope_theta, rope_sign)
        k = _rope(k, pos, config.rope_theta, rope_sign)
        out = np.empty((s, h, d))
        for head in range(h):
            kv = head // (h // hkv)
            scores = q[:, head] @ k[:, kv].T / np.sqrt(d)
            scores = np.where(causal, scores, -np.inf)
            weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
            weights /= weights.sum(axis=-1, keepdims=True)
            out[:, head] = weights @ v[:, kv]
        x = x + out.reshape(s, h * d) @ p[f"{pre}/attn/o_proj"]
        y = _rms_norm(x, p[f"{pre}/post_attn_norm"], eps)
        gate = y @ p[f"{pre}/mlp/gate_proj"]
        x = (
            x
            + (gate / (1 + np.exp(-gate)) * (y @ p[f"{pre}/mlp/up_proj"]))
            @ p[f"{pre}/mlp/down_proj"]
        )
    x = _rms_norm(x, p["final_norm"], eps)
    head = p["embed"].T if config.tie_word_embeddings else p["lm_head"]
    return x @ head


@pytest.fixture(scope="module")
def engine(config, params):
    return Engine(config, params, dtype="float32", max_seqs=2, max_seq_tokens=32)


def _bound(config, params, tokens) -> float:
    """How far float32 rounding may move this model's logits, measured, not guessed.

    Float32 rounds each weight and each intermediate by at most 2^-24 relative. The float64
    forward with every weight moved by 4 x 2^-24 relative (random signs) shows how this
    model amplifies rounding of that size; the engine rounds weights once and activations
    at a handful of places per layer, so it must stay within that response plus 2^-20 of
    the logit scale (the final float32 rounding and the lm_head sum order, n = 32 terms).
    """
    rng = np.random.default_rng(1)
    nudged = {
        k: np.asarray(v, np.float64) * (1 + 4 * 2.0**-24 * rng.choice([-1.0, 1.0], np.shape(v)))
        for k, v in params.items()
    }
    want = numpy_logits(config, params, tokens)
    moved = np.abs(numpy_logits(config, nudged, tokens) - want).max()
    return float(moved + 2.0**-20 * np.abs(want).max())


def test_engine_logits_equal_an_independent_numpy_forward(engine, config, params) -> None:
    got = engine.logits(PROMPTS)
    for i, tokens in enumerate(PROMPTS):
        want = numpy_logits(config, params, tokens)
        bound = _bound(config, params, tokens)
        err = np.abs(got[i, : len(tokens)] - want).max()
        assert err <= bound, (i, err, bound)
        # The anchor can see a real error: RoPE turning the other way moves the logits by
        # orders of magnitude more than the bound (position 0 is unrotated either way).
        reversed_rope = numpy_logits(config, params, tokens, rope_sign=-1.0)
        assert np.abs(reversed_rope - want).max() > 1000 * bound


def test_decode_through_the_pool_equals_the_numpy_forward(engine, config, params) -> None:
    # Prefill 5 tokens, then decode 3 one at a time: each step's logits are the numpy
    # forward's last position over the whole sequence so far.
    tokens = list(PROMPTS[1])
    batch, first = engine.prefill([tokens], reserve_tokens=3)
    steps = [np.asarray(first)[0]]
    for token in (11, 4, 50):
        steps.append(np.asarray(engine.decode(batch, [token]))[0])
        tokens.append(token)
    engine.release(batch)
    for n, got in zip(range(5, 9), steps, strict=True):
        want = numpy_logits(config, params, tokens[:n])[-1]
        assert np.abs(got - want).max() <= _bound(config, params, tokens[:n]), n
