"""The one jit-compiled forward step, and the cache of its executables by layout.

Prefill, decode and scoring run the same body (tokens [B, S] at positions [B, S] through the
decoder and the KV cache; it returns the hidden states and the last real token's logits);
full logits for scoring come from a small per-layout head on those hidden states, so one
body executable serves every output. Executables are compiled ahead of time and kept per
(model layout, cache layout, shapes), where the model layout is the NNX graph plus the
params' tree structure and leaf shapes/dtypes: formats live in that structure, so a trial
whose plan reuses a layout reuses the executable, and compile time is measured apart from
run time. Decode steps share one shape: the batch padded to the cache's `max_seqs`, the KV
window at least `DECODE_MIN_KV_TOKENS`.
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

# "all": (logits [B, S, V], log p(targets[b, t] | tokens[b, :t+1]) [B, S]);
# "last": (logits of each row's last real token [B, V], their argmax [B]).
OUTPUTS = ("all", "last")


def _body(graphdef, cache_layout, kv_tokens, state, cache_state, table, tokens, positions, valid):
    """Hidden states [B, S, D], the last real token's logits [B, V] and their argmax [B]."""
    model = nnx.merge(graphdef, state)
    view = CacheView(cache_layout, cache_state, table, positions, valid, kv_tokens)
    hidden = model(tokens, positions, view)
    last = jnp.maximum(valid.sum(axis=1) - 1, 0)
    logits = model.logits(hidden[jnp.arange(hidden.shape[0]), last])
    return (hidden, logits, jnp.argmax(logits, axis=-1).astype(jnp.int32)), view.state


def _head(graphdef, state, hidden, targets):
    """Logits [B, S, V] of every position and log p(targets[b, t] | tokens[b, :t+1]) [B, S]."""
    model = nnx.merge(graphdef, state)
    logits = model.logits(hidden)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return logits, jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


_BODY = jax.jit(_body, static_argnums=(0, 1, 2), donate_argnums=(4,))
_HEAD = jax.jit(_head, static_argnums=(0,))
# A decode step reads at least this many KV tokens (or the cache's whole window if shorter),
# so every decode of sequences up to this length runs one executable; longer windows grow
# in powers of two rather than reading a long context's whole window at every step.
DECODE_MIN_KV_TOKENS = 1024


@dataclasses.dataclass
class StepStats:
    """Seconds spent compiling and running, and tokens processed, since the last reset."""

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


# ("body", model layout id, cache layout, kv_tokens, input shapes) or ("head", model layout
# id, shapes) -> compiled executable,
# least recently used first; bounded so a long study over many layouts does not grow forever.
_EXECUTABLES: OrderedDict[tuple, Any] = OrderedDict()
MAX_EXECUTABLES = 256
_LAYOUT_IDS: dict[tuple, int] = {}


def layout_id(graphdef, state) -> int:
    """A small int naming the model layout (hashing the graph once, not every step).

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


def release_compiled() -> int:
    """Drop every compiled executable this process holds: this LRU and JAX's jit and staging
    caches (`jax.clear_caches`); the next step compiles afresh. Each executable holds memory
    mappings, so a process measuring hundreds of plans calls this now and then (ground-truth
    passes: `search.ground_truth`). Returns how many of this LRU's executables were dropped."""
    import gc

    dropped = len(_EXECUTABLES)
    _EXECUTABLES.clear()
    jax.clear_caches()
    gc.collect()  # an executable's mappings go with its last reference
    return dropped


def run_step(
    *,
    layout: int,
    graphdef,
    state,
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
    args = (state, cache.state, table, tokens, positions, valid)
    shapes = tuple(tuple(a.shape) for a in (table, tokens))
    body = _compiled(
        ("body", layout, cache.layout, kv_tokens, shapes), stats,
        lambda: _BODY.lower(graphdef, cache.layout, kv_tokens, *args),
    )  # fmt: skip
    (hidden, logits, top1), cache.state = body(*args)
    if output == "last":
        return logits[:rows], top1[:rows]
    head = _compiled(
        ("head", layout, tuple(hidden.shape), tuple(targets.shape)), stats,
        lambda: _HEAD.lower(graphdef, state, hidden, targets),
    )  # fmt: skip
    return head(state, hidden, targets)


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
