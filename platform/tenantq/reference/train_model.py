"""A compact functional Llama forward for training the reference model (no KV cache).

It follows the Hugging Face Llama conventions the engine loads (rotate-half RoPE, float32
RMSNorm, SwiGLU, grouped-query attention), keeps params under the `ModelConfig.tensors()`
paths with linear weights `[in, out]`, and adds packed-document segments so several short
training documents share one row without attending to each other.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tenantq.model.config import ModelConfig

Params = dict[str, jax.Array]


def init_params(config: ModelConfig, seed: int) -> Params:
    """Normal(0, 0.02) weights, residual outputs scaled by 1/sqrt(2 * layers), unit norms."""
    rng = np.random.default_rng(seed)
    out_scale = 1.0 / np.sqrt(2 * config.num_layers)
    params: Params = {}
    for path, info in config.tensors().items():
        if info.kind == "norm":
            params[path] = jnp.ones(info.shape, jnp.float32)
            continue
        std = 0.02 * (out_scale if path.endswith(("o_proj", "down_proj")) else 1.0)
        params[path] = jnp.asarray(rng.normal(0.0, std, info.shape).astype(np.float32))
    return params


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin `[..., seq, head_dim]` in the HF layout (frequencies repeated over both halves)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x `[batch, seq, heads, head_dim]`; HF rotate_half: (x1, x2) -> (-x2, x1)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return (x.astype(jnp.float32) * c + rotated.astype(jnp.float32) * s).astype(x.dtype)


def forward(
    params: Params,
    config: ModelConfig,
    tokens: jax.Array,
    segments: jax.Array | None = None,
    positions: jax.Array | None = None,
    dtype: jnp.dtype = jnp.float32,
) -> jax.Array:
    """Logits float32 `[batch, seq, vocab]`. Tokens attend causally within their segment."""
    return lm_head(
        params, config, hidden_states(params, config, tokens, segments, positions, dtype)
    )


def lm_head(params: Params, config: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Final norm and LM head: hidden `[..., hidden]` -> float32 logits `[..., vocab]`."""
    x = rms_norm(hidden, params["final_norm"], config.rms_norm_eps)
    head = params["embed"].T if config.tie_word_embeddings else params["lm_head"]
    return jnp.dot(x, head.astype(hidden.dtype), preferred_element_type=jnp.float32)


def hidden_states(
    params: Params,
    config: ModelConfig,
    tokens: jax.Array,
    segments: jax.Array | None = None,
    positions: jax.Array | None = None,
    dtype: jnp.dtype = jnp.float32,
) -> jax.Array:
    """The residual stream after the last layer (before the final norm)."""
    batch, seq = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
    causal = jnp.tril(jnp.ones((seq, seq), bool))[None]
    if segments is not None:
        causal = causal & (segments[:, :, None] == segments[:, None, :])
    mask = causal[:, None, None]  # [batch, 1 (kv head), 1 (q per kv), q, k]
    cos, sin = rope_tables(positions, config.head_dim, config.rope_theta)
    nh, nkv, hd = config.num_heads, config.num_kv_heads, config.head_dim
    eps = config.rms_norm_eps

    def w(path: str) -> jax.Array:
        return params[path].astype(dtype)

    x = params["embed"].astype(dtype)[tokens]
    for i in range(config.num_layers):
        p = f"layers/{i}"
        h = rms_norm(x, params[f"{p}/input_norm"], eps)
        q = (h @ w(f"{p}/attn/q_proj")).reshape(batch, seq, nh, hd)
        k = (h @ w(f"{p}/attn/k_proj")).reshape(batch, seq, nkv, hd)
        v = (h @ w(f"{p}/attn/v_proj")).reshape(batch, seq, nkv, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q = q.reshape(batch, seq, nkv, nh // nkv, hd)
        scores = jnp.einsum("bqgrd,bkgd->bgrqk", q, k, preferred_element_type=jnp.float32)
        scores = jnp.where(mask, scores / np.sqrt(hd), -1e30)
        probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
        attn = jnp.einsum("bgrqk,bkgd->bqgrd", probs, v).reshape(batch, seq, nh * hd)
        x = x + attn @ w(f"{p}/attn/o_proj")
        h = rms_norm(x, params[f"{p}/post_attn_norm"], eps)
        gate = jax.nn.silu(h @ w(f"{p}/mlp/gate_proj"))
        x = x + (gate * (h @ w(f"{p}/mlp/up_proj"))) @ w(f"{p}/mlp/down_proj")
    return x
