"""The engine's forward step as a chain of small executables, each compiled once per layout.

A step (tokens [B, S] at positions [B, S] through the decoder and the KV cache) runs `embed`;
per layer `pre` (norm, q/k/v), `kv` (q/k norms, RoPE, this step's K/V written into that
layer's cache and read back, attention), `o` (o_proj + residual), `mlp` (norm, MLP +
residual); `final` (final norm, the last real token's logits and argmax); for full logits
`head`. A piece is compiled ahead of time per (its own modules' layout: graph, tree, leaf
shapes/dtypes/shardings; its static settings; its inputs' shapes), so a weight format or a KV
format keys only the pieces it touches: layers stored alike share executables, and a plan
compiles only the pieces no earlier plan had (on XLA:CPU a layer's compile is mostly its KV
write/read code). The cuts lie where XLA's fusion cannot change the numbers: the pieces give
the whole-model step's bits. Decode steps share one shape: the batch padded to the cache's
`max_seqs`, the KV window at least `DECODE_MIN_KV_TOKENS`.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import OrderedDict
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tenantq.engine.cache import CacheView
from tenantq.model.decoder import cached_attention, head_logits, mlp_residual, output_projection

# "all": (logits [B, S, V], log p(targets[b, t] | tokens[b, :t+1]) [B, S]);
# "last": (logits of each row's last real token [B, V], their argmax [B]).
OUTPUTS = ("all", "last")


def _embed(graphdef, state, tokens):
    (embed,) = nnx.merge(graphdef, state)
    return embed(tokens)


def _pre(graphdef, state, x):
    """q [B, S, H, d], k and v [B, S, Hkv, d] (before q/k norms and RoPE) of x [B, S, D]."""
    norm, qkv = nnx.merge(graphdef, state)
    return qkv(norm(x))


def _kv(graphdef, layout, kv_tokens, window, rope, state, layer_state, table, positions, valid,
        q, k, v):  # fmt: skip
    """Attention output [B, S, H, d] through one layer's cache, and that layer's new state
    (`graphdef`/`state`: the layer's q/k norms, or (None, None))."""
    view = CacheView(layout, layer_state, table, positions, valid, kv_tokens)
    qk_norms = nnx.merge(graphdef, state)
    return cached_attention(qk_norms, q, k, v, positions, view, 0, window, rope), view.state


def _o(graphdef, state, x, out):
    (o_proj,) = nnx.merge(graphdef, state)
    return x + output_projection(o_proj, out, o_proj.dtype)


def _mlp(graphdef, state, x):
    norm, mlp = nnx.merge(graphdef, state)
    return mlp_residual(norm, mlp, x)


def _final(graphdef, state, x, valid):
    """Final hidden states [B, S, D], the last real token's logits [B, V], their argmax [B]."""
    norm, head = nnx.merge(graphdef, state)
    hidden = norm(x)
    last = jnp.maximum(valid.sum(axis=1) - 1, 0)
    logits = head_logits(head, hidden[jnp.arange(hidden.shape[0]), last])
    return hidden, logits, jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _head(graphdef, state, hidden, targets):
    """Logits [B, S, V] of every position and log p(targets[b, t] | tokens[b, :t+1]) [B, S]."""
    (head,) = nnx.merge(graphdef, state)
    logits = head_logits(head, hidden)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return logits, jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


_PIECES = {
    "embed": jax.jit(_embed, static_argnums=0),
    "pre": jax.jit(_pre, static_argnums=0),
    "kv": jax.jit(_kv, static_argnums=(0, 1, 2, 3, 4), donate_argnums=(6,)),
    "o": jax.jit(_o, static_argnums=0),
    "mlp": jax.jit(_mlp, static_argnums=0),
    "final": jax.jit(_final, static_argnums=0),
    "head": jax.jit(_head, static_argnums=0),
}
# A decode step reads at least this many KV tokens (or the cache's whole window if shorter),
# so every decode of sequences up to this length runs one executable; longer windows grow
# in powers of two rather than reading a long context's whole window at every step.
DECODE_MIN_KV_TOKENS = 1024


@dataclasses.dataclass
class StepStats:
    """Seconds spent compiling and running, and tokens processed, since the last reset.
    `compiles` counts executables (pieces) compiled."""

    compiles: int = 0
    compile_s: float = 0.0
    prefill_s: float = 0.0
    prefill_tokens: int = 0
    decode_s: float = 0.0
    decode_tokens: int = 0

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)

    def reset(self) -> None:
        """Zero every figure (before a measurement)."""
        for f in dataclasses.fields(self):
            setattr(self, f.name, f.default)


@dataclasses.dataclass(frozen=True)
class Piece:
    """The modules one executable merges: their graph, their state, and a layout id."""

    layout: int
    graphdef: Any
    state: Any


@dataclasses.dataclass(frozen=True)
class LayerPieces:
    pre: Piece  # input norm + q/k/v
    kv: Piece  # q/k norms (Qwen3), or (None, None)
    o: Piece  # o_proj
    mlp: Piece  # post-attention norm + MLP
    window: int | None  # sliding-window length of this layer's attention, None: global
    rope: tuple  # `rope_settings`, applied in the KV piece


@dataclasses.dataclass(frozen=True)
class SplitModel:
    """A `Decoder` cut into the pieces a step runs (same arrays: nothing is copied)."""

    embed: Piece
    layers: tuple[LayerPieces, ...]
    final: Piece  # final norm + head
    head: Piece  # lm_head, or the embedding when tied
    # step shape -> its executables in call order (filled by `run_step`)
    executables: dict = dataclasses.field(default_factory=dict, compare=False)


def split_model(model) -> SplitModel:
    """The pieces of a `tenantq.model.decoder.Decoder`, each with its layout id."""

    def piece(*modules) -> Piece:
        graphdef, state = nnx.split(modules)
        return Piece(layout_id(graphdef, state), graphdef, state)

    layers = tuple(
        LayerPieces(
            piece(block.input_norm, block.attn.qkv),
            piece(block.attn.q_norm, block.attn.k_norm),
            piece(block.attn.o_proj),
            piece(block.post_attn_norm, block.mlp),
            block.attn.window,
            block.attn.rope,
        )  # fmt: skip
        for block in model.layers
    )
    return SplitModel(
        piece(model.embed), layers, piece(model.final_norm, model.head), piece(model.head)
    )


# (piece name, layout id or None, static settings, input signature) -> compiled executable,
# least recently used first; bounded so a long study over many layouts does not grow forever.
_EXECUTABLES: OrderedDict[tuple, Any] = OrderedDict()
MAX_EXECUTABLES = 1024
_LAYOUT_IDS: dict[tuple, int] = {}


def layout_id(graphdef, state) -> int:
    """A small int naming a modules' layout (hashing the graph once, not every step).

    The layout includes each leaf's sharding: the same plan placed over a different mesh
    (or over none) compiles to different executables."""
    leaves, treedef = jax.tree_util.tree_flatten(state)
    key = (
        graphdef,
        treedef,
        tuple((tuple(x.shape), str(x.dtype), getattr(x, "sharding", None)) for x in leaves),
    )
    return _LAYOUT_IDS.setdefault(key, len(_LAYOUT_IDS))


def compiled_count() -> int:
    return len(_EXECUTABLES)


def run_step(
    *,
    model: SplitModel,
    cache,
    output: str,
    kv_tokens: int,
    table,
    tokens,
    positions,
    valid,
    targets,
    stats: StepStats,
):
    """Run one step through `cache` (its state is replaced by the updated one); returns out."""
    if output not in OUTPUTS:
        raise ValueError(f"output={output!r}; valid: {', '.join(OUTPUTS)}")
    rows = tokens.shape[0]
    if tokens.shape[1] == 1:  # decode: one shape for every batch and (short) window
        kv_tokens = max(kv_tokens, min(DECODE_MIN_KV_TOKENS, cache.max_seq_tokens))
        table, tokens, positions, valid = _pad_rows(
            cache, cache.max_seqs - rows, table, tokens, positions, valid
        )
    # on the device once per step, not once per piece
    table, tokens, positions, valid = (jnp.asarray(a) for a in (table, tokens, positions, valid))
    # The executables of a step shape, in call order, after its first run: later steps of
    # that shape only call them (no key is built per piece).
    shape = (cache.layout, output, kv_tokens, table.shape, tokens.shape, np.shape(targets))
    known = model.executables.get(shape)
    chain: list = [] if known is None else known
    calls = iter(chain)

    def run(name: str, piece: Piece, static: tuple, *arrays):
        if known is not None:
            return next(calls)(piece.state, *arrays)
        key = (name, piece.layout, static, _signature(arrays))
        lower = functools.partial(
            _PIECES[name].lower, piece.graphdef, *static, piece.state, *arrays
        )
        chain.append(_compiled(key, stats, lower))
        return chain[-1](piece.state, *arrays)

    x = run("embed", model.embed, (), tokens)
    for i, layer in enumerate(model.layers):
        q, k, v = run("pre", layer.pre, (), x)
        views = () if known else (cache.layout.layer_view(i), kv_tokens, layer.window, layer.rope)
        out, (new,) = run(
            "kv", layer.kv, views, (cache.state[i],), table, positions, valid, q, k, v
        )
        cache.state = (*cache.state[:i], new, *cache.state[i + 1 :])
        x = run("o", layer.o, (), x, out)
        x = run("mlp", layer.mlp, (), x)
    hidden, logits, top1 = run("final", model.final, (), x, valid)
    out = (
        (logits[:rows], top1[:rows])
        if output == "last"
        else run("head", model.head, (), hidden, jnp.asarray(targets))
    )
    if known is None:
        model.executables[shape] = chain
    return out


def _signature(arrays) -> tuple:
    return tuple(
        (x.shape, x.dtype, getattr(x, "sharding", None)) for x in jax.tree_util.tree_leaves(arrays)
    )


def _pad_rows(cache, extra: int, table, tokens, positions, valid):
    """Append `extra` padding rows (the cache's own padding table rows: never written)."""
    if extra <= 0:
        return table, tokens, positions, valid
    pad_table = np.asarray(cache.table([None] * extra), table.dtype)

    def grow(a, fill):
        return np.concatenate([a, np.full((extra, *a.shape[1:]), fill, a.dtype)])

    return (np.concatenate([table, pad_table]), grow(tokens, 0), grow(positions, 0),
            grow(valid, False))  # fmt: skip


def _compiled(key: tuple, stats: StepStats, lower):
    """The executable for `key`, compiled (and counted in `stats`) on first use."""
    compiled = _EXECUTABLES.get(key)
    if compiled is not None:
        _EXECUTABLES.move_to_end(key)
        return compiled
    start = time.perf_counter()
    compiled = lower().compile()
    stats.compile_s += time.perf_counter() - start
    stats.compiles += 1
    _EXECUTABLES[key] = compiled
    while len(_EXECUTABLES) > MAX_EXECUTABLES:
        _EXECUTABLES.popitem(last=False)
    return compiled


@functools.cache
def pow2_at_least(n: int, floor: int = 1) -> int:
    size = max(floor, 1)
    while size < n:
        size *= 2
    return size
