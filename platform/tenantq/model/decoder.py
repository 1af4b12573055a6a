"""The Llama-family decoder as a Flax NNX module tree built from a flat params dict.

Llama 2/3/3.1, Mistral, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm before RoPE)
differ only in switches read from `ModelConfig`. Params are keyed by the tensor paths of
`config.tensors()`, the same keys plans match and memory reports count. Attention never
sees the fresh K/V projections: each layer writes them into the KV store it is handed and
attends over what the store reads back, so a lossy cache's error reaches every token.
`forward` runs the same modules without a cache (`OwnTokensKV`: each call attends over its
own tokens, optionally split into packed segments) for training and whole-text scoring.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tenantq.model.config import ENGINE_MODEL_TYPES, ModelConfig
from tenantq.model.layers import Embedding, Linear, RMSNorm, apply_rope, rope_inv_freq

_MASKED = -1e30  # finite, so a fully masked (padding) row gives a uniform softmax, not NaN


class KVAccess(Protocol):
    """What a decoder layer needs from the KV cache, inside jit (see tenantq.engine.cache).

    `write` stores this step's keys/values [B, S, kv_heads, head_dim] at the step's token
    positions; `read` returns everything the layer may attend to: keys and values
    [B, T, kv_heads, head_dim] in the compute dtype and the position of each slot [B, T]
    (negative for empty slots).
    """

    def write(self, layer: int, keys: jax.Array, values: jax.Array) -> None: ...

    def read(self, layer: int) -> tuple[jax.Array, jax.Array, jax.Array]: ...


def check_supported(config: ModelConfig) -> None:
    if config.model_type not in ENGINE_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {config.model_type!r} for the engine; "
            f"supported: {', '.join(ENGINE_MODEL_TYPES)}"
        )
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} not supported; supported: silu")


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, layer: int, params, *, dtype, activations):
        p = f"layers/{layer}/attn"

        def linear(name: str, bias: str | None = None) -> Linear:
            b = params.get(f"{p}/{bias}") if bias else None
            return Linear(
                f"{p}/{name}", params[f"{p}/{name}"], b, dtype=dtype,
                activations=activations.get(f"{p}/{name}"),
            )  # fmt: skip

        self.q_proj = linear("q_proj", "q_bias")
        self.k_proj = linear("k_proj", "k_bias")
        self.v_proj = linear("v_proj", "v_bias")
        self.o_proj = linear("o_proj")
        eps = config.rms_norm_eps
        self.q_norm = (
            RMSNorm(params[f"{p}/q_norm"], eps=eps, dtype=dtype) if config.qk_norm else None
        )
        self.k_norm = (
            RMSNorm(params[f"{p}/k_norm"], eps=eps, dtype=dtype) if config.qk_norm else None
        )
        self.layer = layer
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.window = config.sliding_window if config.layer_types[layer] == "sliding" else None
        self.config = config
        self.dtype = dtype

    def __call__(
        self, x: jax.Array, positions: jax.Array, kv: KVAccess, segments: jax.Array | None = None
    ) -> jax.Array:
        b, s, _ = x.shape
        q = self.q_proj(x).reshape(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, s, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = rope_inv_freq(self.config)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        kv.write(self.layer, k, v)
        keys, values, key_pos = kv.read(self.layer)
        out = attend(q, keys, values, positions, key_pos, self.window, segments=segments)
        return self.o_proj(out.reshape(b, s, -1).astype(self.dtype))


def attend(q, keys, values, q_pos, key_pos, window: int | None, *, segments=None) -> jax.Array:
    """Causal grouped-query attention, float32 scores and softmax.

    q [B, S, H, d]; keys/values [B, T, Hkv, d]; q_pos [B, S]; key_pos [B, T] (< 0: empty).
    A key is visible when 0 <= key_pos <= q_pos (and key_pos > q_pos - window). `segments`
    [B, S] (only when the keys are the queries' own tokens, T == S) packs several documents
    in a row: a key is visible only to queries of the same segment.
    """
    b, s, h, d = q.shape
    hkv = keys.shape[2]
    qg = q.reshape(b, s, hkv, h // hkv, d)
    scores = jnp.einsum("bskgd,btkd->bkgst", qg, keys, preferred_element_type=jnp.float32)
    scores = scores * np.float32(1.0 / np.sqrt(d))
    kp, qp = key_pos[:, None, :], q_pos[:, :, None]  # [B, 1, T], [B, S, 1]
    visible = (kp >= 0) & (kp <= qp)
    if window is not None:
        visible &= kp > qp - window
    if segments is not None:
        visible &= segments[:, :, None] == segments[:, None, :]
    scores = jnp.where(visible[:, None, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum(
        "bkgst,btkd->bskgd", probs.astype(values.dtype), values, preferred_element_type=jnp.float32
    )
    return out.reshape(b, s, h, d)


class MLP(nnx.Module):
    """SwiGLU (Shazeer 2020): down(silu(gate(x)) * up(x))."""

    def __init__(self, layer: int, params, *, dtype, activations):
        p = f"layers/{layer}/mlp"
        for name in ("gate_proj", "up_proj", "down_proj"):
            path = f"{p}/{name}"
            setattr(
                self,
                name,
                Linear(path, params[path], dtype=dtype, activations=activations.get(path)),
            )

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    def __init__(self, config: ModelConfig, layer: int, params, *, dtype, activations):
        p = f"layers/{layer}"
        eps = config.rms_norm_eps
        self.input_norm = RMSNorm(params[f"{p}/input_norm"], eps=eps, dtype=dtype)
        self.attn = Attention(config, layer, params, dtype=dtype, activations=activations)
        self.post_attn_norm = RMSNorm(params[f"{p}/post_attn_norm"], eps=eps, dtype=dtype)
        self.mlp = MLP(layer, params, dtype=dtype, activations=activations)

    def __call__(self, x, positions, kv: KVAccess, segments=None):
        x = x + self.attn(self.input_norm(x), positions, kv, segments)
        return x + self.mlp(self.post_attn_norm(x))


class Decoder(nnx.Module):
    """tokens [B, S] and positions [B, S] -> final hidden states [B, S, hidden].

    Built from `params` (path -> array or QArray). `dtype` is the compute dtype and the
    dtype plain tensors are expected in; `activations` maps a weight path to its W8A8
    activation format.
    """

    def __init__(
        self,
        config: ModelConfig,
        params: Mapping[str, Any],
        *,
        dtype=jnp.bfloat16,
        activations: Mapping[str, str] | None = None,
    ):
        check_supported(config)
        missing = [p for p in config.tensors() if p not in params]
        if missing:
            raise ValueError(f"params lack tensors {missing[:5]} ({len(missing)} missing)")
        acts = dict(activations or {})
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.embed = Embedding(params["embed"], dtype=self.dtype, activations=acts.get("embed"))
        self.layers = nnx.List(
            Block(config, i, params, dtype=self.dtype, activations=acts)
            for i in range(config.num_layers)
        )
        self.final_norm = RMSNorm(params["final_norm"], eps=config.rms_norm_eps, dtype=self.dtype)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(
                "lm_head", params["lm_head"], dtype=self.dtype, activations=acts.get("lm_head")
            )
        )

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        kv: KVAccess,
        segments: jax.Array | None = None,
    ) -> jax.Array:
        x = self.embed(tokens)
        for block in self.layers:
            x = block(x, positions, kv, segments)
        return self.final_norm(x)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Float32 logits of hidden states [..., hidden] -> [..., vocab]."""
        if self.lm_head is None:
            return self.embed.attend(hidden)
        return self.lm_head(hidden).astype(jnp.float32)


class OwnTokensKV:
    """A `KVAccess` without a cache: each layer attends over the keys/values of the tokens
    of this very call (training, and scoring whole texts). Keys sit at the queries'
    positions, so `attend`'s position rule is the causal mask."""

    def __init__(self, positions: jax.Array):
        self.positions = positions
        self._layers: dict[int, tuple[jax.Array, jax.Array]] = {}

    def write(self, layer: int, keys: jax.Array, values: jax.Array) -> None:
        self._layers[layer] = (keys, values)

    def read(self, layer: int) -> tuple[jax.Array, jax.Array, jax.Array]:
        keys, values = self._layers.pop(layer)
        return keys, values, self.positions


def forward(
    params: Mapping[str, Any],
    config: ModelConfig,
    tokens: jax.Array,
    *,
    positions: jax.Array | None = None,
    segments: jax.Array | None = None,
    dtype=jnp.float32,
) -> jax.Array:
    """Float32 logits [B, S, vocab] of whole rows, no cache; differentiable in `params`.

    The same `Decoder` modules the engine runs, built from `params` (path -> array, traced
    arrays included). `positions` default to 0..S-1 per row; with `segments` [B, S] tokens
    attend causally within their own segment only (packed training documents; positions
    then restart at each segment).
    """
    tokens = jnp.asarray(tokens)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    model = Decoder(config, params, dtype=dtype)
    hidden = model(tokens, positions, OwnTokensKV(positions), segments)
    return model.logits(hidden).astype(jnp.float32)


def init_params(config: ModelConfig, *, seed: int = 0, dtype=jnp.float32) -> dict[str, jax.Array]:
    """Random params for tests and benchmarks: linears ~ N(0, 1/fan_in), norms near 1."""
    rng = np.random.default_rng(seed)
    out: dict[str, jax.Array] = {}
    for path, info in config.tensors().items():
        if info.kind == "norm":
            value = 1.0 + 0.1 * rng.standard_normal(info.shape)
        elif info.kind == "bias":
            value = 0.02 * rng.standard_normal(info.shape)
        elif info.kind == "embedding":
            value = rng.standard_normal(info.shape)
        else:
            value = rng.standard_normal(info.shape) / np.sqrt(info.shape[0])
        out[path] = jnp.asarray(value.astype(np.float32), dtype=dtype)
    return out
