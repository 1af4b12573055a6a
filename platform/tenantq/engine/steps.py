"""The one jit-compiled forward step, and the cache of its executables by layout.

Prefill, decode and scoring are the same function (tokens [B, S] at positions [B, S]
through the decoder and the KV cache) with a different static `output`. Executables are
compiled ahead of time and kept per (model layout, cache layout, shapes), where the model
layout is the NNX graph plus the params' tree structure and leaf shapes/dtypes: formats
live in that structure, so a trial whose plan reuses a layout reuses the executable, and
compile time is measured apart from run time.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import OrderedDict
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tenantq.engine.cache import CacheView

# "all": (logits [B, S, V], log p(targets[b, t] | tokens[b, :t+1]) [B, S]);
# "last": (logits of each row's last real token [B, V], their argmax [B]).
OUTPUTS = ("all", "last")


def _step(
    graphdef, cache_layout, output, kv_tokens, state, cache_state, table, tokens, positions,
    valid, targets,
):  # fmt: skip
    model = nnx.merge(graphdef, state)
    view = CacheView(cache_layout, cache_state, table, positions, valid, kv_tokens)
    hidden = model(tokens, positions, view)
    if output == "all":
        logits = model.logits(hidden)
        logp = jax.nn.log_softmax(logits, axis=-1)
        out = (logits, jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0])
    else:
        last = jnp.maximum(valid.sum(axis=1) - 1, 0)
        logits = model.logits(hidden[jnp.arange(hidden.shape[0]), last])
        out = (logits, jnp.argmax(logits, axis=-1).astype(jnp.int32))
    return out, view.state


_STEP = jax.jit(_step, static_argnums=(0, 1, 2, 3), donate_argnums=(5,))


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


# (model layout id, cache layout, output, kv_tokens, input shapes) -> compiled executable,
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
    args = (state, cache.state, table, tokens, positions, valid, targets)
    shapes = tuple(tuple(a.shape) for a in (table, tokens, targets))
    key = (layout, cache.layout, output, kv_tokens, shapes)
    compiled = _EXECUTABLES.get(key)
    if compiled is not None:
        _EXECUTABLES.move_to_end(key)
    else:
        start = time.perf_counter()
        compiled = _STEP.lower(graphdef, cache.layout, output, kv_tokens, *args).compile()
        stats.compile_s += time.perf_counter() - start
        stats.compiles += 1
        _EXECUTABLES[key] = compiled
        while len(_EXECUTABLES) > MAX_EXECUTABLES:
            _EXECUTABLES.popitem(last=False)
    out, cache.state = compiled(*args)
    return out


@functools.cache
def pow2_at_least(n: int, floor: int = 1) -> int:
    size = max(floor, 1)
    while size < n:
        size *= 2
    return size
