"""The KV cache behind a small interface, and its first implementation: contiguous slots.

The runner talks to a cache only through `KVCache` (host side: allocate / free / table,
plus a device `state` it threads through jit) and its static `layout` (device side: write
and read-for-attention inside jit). The paged pool (pages of 16 tokens, per-layer formats
from `plan.kv`) replaces `ContiguousCache` by implementing the same two halves; nothing in
the runner's public methods knows which one it holds: what differs (settings, KV reports,
tenants, which KV tensors are quantized, which plans the cache can hold) is asked of the
cache through the protocol, never decided by its type.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from tenantq.model.config import ModelConfig
from tenantq.quant.plan import LayerKV, QuantPlan


class CacheFull(RuntimeError):
    """No room for another sequence (or for a sequence this long)."""


class CacheLayout(Protocol):
    """Static (hashable) half of a cache: shapes and formats, and the jit-side operations.

    `table` is the per-batch lookup the host half built (slots, or page tables);
    `positions`/`valid` [B, S] say where each new token goes and which are real (padding
    rows and tokens must not be written). `read` returns keys and values [B, T, Hkv, d] in
    the compute dtype and the position held in each of the T slots ([B, T], < 0 if empty),
    where T covers at least positions 0..kv_tokens-1.
    """

    def write(self, state, layer: int, table, positions, valid, keys, values) -> Any: ...

    def read(self, state, layer: int, table, kv_tokens: int) -> tuple[Any, Any, Any]: ...


class KVCache(Protocol):
    """Host half: owns the device `state` pytree and who holds which part of it."""

    layout: CacheLayout
    state: Any
    max_seqs: int  # sequences that can be live at once (the runner's batch limit)
    max_seq_tokens: int  # longest sequence one allocation may hold

    def allocate(self, num_tokens: int, tenant: str = "default") -> int: ...  # CacheFull if no room

    # Before a step: make room for each sequence to hold `end_tokens` (CacheFull if refused).
    def make_room(self, seq_ids: Sequence[int], end_tokens: Sequence[int]) -> None: ...

    def free(self, seq_id: int) -> None: ...

    def table(self, seq_ids: Sequence[int | None]) -> np.ndarray: ...  # None: padding row

    @property
    def nbytes(self) -> int: ...

    # What the engine reports and checks, answered by the cache itself.
    def check_plan(self, plan: QuantPlan, config: ModelConfig) -> None: ...  # can it hold
    def settings(self, compute_dtype: str) -> dict[str, Any]: ...  # results/memory identity
    def kv_layers(self) -> Sequence[LayerKV]: ...  # each layer's KV formats ([]: compute dtype)
    def kv_report(self) -> list[dict]: ...  # per layer bytes ([]: none to report)
    def kv_clip_report(self) -> list[dict]: ...  # per static-scale tensor ([]: none)
    def add_tenant(self, name: str, guaranteed_pages: int = 0) -> None: ...  # or ValueError


class CacheView:
    """Adapter handed to the decoder inside jit: `KVAccess` over a layout and its state."""

    def __init__(self, layout: CacheLayout, state, table, positions, valid, kv_tokens: int):
        self.layout, self.state, self.table = layout, state, table
        self.positions, self.valid, self.kv_tokens = positions, valid, kv_tokens

    def write(self, layer: int, keys, values) -> None:
        self.state = self.layout.write(
            self.state, layer, self.table, self.positions, self.valid, keys, values
        )

    def read(self, layer: int):
        return self.layout.read(self.state, layer, self.table, self.kv_tokens)


@dataclasses.dataclass(frozen=True)
class ContiguousLayout:
    """Per layer keys and values [slots, max_seq_tokens, Hkv, d]; a sequence owns one slot."""

    num_layers: int
    slots: int
    max_seq_tokens: int
    kv_heads: int
    head_dim: int
    dtype: str

    def init_state(self) -> tuple[tuple[jax.Array, jax.Array], ...]:
        shape = (self.slots, self.max_seq_tokens, self.kv_heads, self.head_dim)
        return tuple(
            (jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype))
            for _ in range(self.num_layers)
        )

    @property
    def nbytes(self) -> int:
        per_tensor = self.slots * self.max_seq_tokens * self.kv_heads * self.head_dim
        return 2 * self.num_layers * per_tensor * jnp.dtype(self.dtype).itemsize

    def write(self, state, layer, table, positions, valid, keys, values):
        # Invalid tokens are sent to an out-of-range position and dropped by the scatter.
        pos = jnp.where(valid, positions, self.max_seq_tokens)
        slots = jnp.broadcast_to(table[:, None], pos.shape)
        k_all, v_all = state[layer]
        k_all = k_all.at[slots, pos].set(keys.astype(k_all.dtype), mode="drop")
        v_all = v_all.at[slots, pos].set(values.astype(v_all.dtype), mode="drop")
        return state[:layer] + ((k_all, v_all),) + state[layer + 1 :]

    def read(self, state, layer, table, kv_tokens):
        k_all, v_all = state[layer]
        keys = k_all[table, :kv_tokens]
        values = v_all[table, :kv_tokens]
        key_pos = jnp.broadcast_to(
            jnp.arange(kv_tokens, dtype=jnp.int32), (table.shape[0], kv_tokens)
        )
        return keys, values, key_pos


class ContiguousCache:
    """`KVCache` with one fixed slot of `max_seq_tokens` per sequence, in the compute dtype.

    Positions 0..n-1 of a sequence live at indices 0..n-1 of its slot; stale entries past
    a sequence's end are never visible because attention is causal in positions.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: str,
        max_seqs: int = 16,
        max_seq_tokens: int | None = None,
    ):
        tokens = int(max_seq_tokens or min(config.max_position_embeddings, 2048))
        if max_seqs <= 0 or tokens <= 0:
            raise ValueError(
                f"cache needs max_seqs > 0 and max_seq_tokens > 0, got {max_seqs}, {tokens}"
            )
        self.layout = ContiguousLayout(
            config.num_layers,
            max_seqs,
            tokens,
            config.num_kv_heads,
            config.head_dim,
            str(jnp.dtype(dtype)),
        )
        self.state = self.layout.init_state()
        self.max_seqs, self.max_seq_tokens = max_seqs, tokens
        self._free = list(range(max_seqs - 1, -1, -1))
        self._live: set[int] = set()

    def allocate(self, num_tokens: int, tenant: str = "default") -> int:
        if tenant != "default":
            raise ValueError(
                f"the contiguous cache has no tenants (got {tenant!r}); use the paged pool"
            )
        if num_tokens > self.max_seq_tokens:
            raise CacheFull(
                f"a sequence of {num_tokens} tokens exceeds max_seq_tokens={self.max_seq_tokens}"
            )
        if not self._free:
            raise CacheFull(f"all {self.max_seqs} cache slots are in use")
        slot = self._free.pop()
        self._live.add(slot)
        return slot

    def make_room(self, seq_ids: Sequence[int], end_tokens: Sequence[int]) -> None:
        # Slots are allocated whole; the runner never steps past a sequence's capacity.
        if max(end_tokens, default=0) > self.max_seq_tokens:
            raise CacheFull(f"a step would pass max_seq_tokens={self.max_seq_tokens}")

    def free(self, seq_id: int) -> None:
        if seq_id not in self._live:
            raise ValueError(f"sequence {seq_id} is not allocated")
        self._live.remove(seq_id)
        self._free.append(seq_id)

    def table(self, seq_ids: Sequence[int | None]) -> np.ndarray:
        # Padding rows read slot 0 (their output is discarded) and write nothing.
        return np.array([0 if s is None else s for s in seq_ids], dtype=np.int32)

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def check_plan(self, plan: QuantPlan, config: ModelConfig) -> None:
        quantized = [i for i, kv in enumerate(plan.kv_layers(config)) if not kv.is_bf16]
        if quantized:
            raise NotImplementedError(
                f"plan stores the KV cache of layers {quantized} in "
                f"{plan.kv.key_format}/{plan.kv.value_format}; the contiguous cache holds only "
                "the compute dtype (the paged KV pool implements KV formats)"
            )

    def settings(self, compute_dtype: str) -> dict[str, Any]:
        return {
            "cache": type(self).__name__,
            "kv_store_dtype": compute_dtype,
            "page_tokens": None,
            "pool_pages": None,
            "max_seqs": self.max_seqs,
            "max_seq_tokens": self.max_seq_tokens,
        }

    def kv_layers(self) -> list[LayerKV]:
        return []  # keys and values in the compute dtype, nothing quantized

    def kv_report(self) -> list[dict]:
        return []

    def kv_clip_report(self) -> list[dict]:
        return []

    def add_tenant(self, name: str, guaranteed_pages: int = 0) -> None:
        raise ValueError("this engine's cache has no tenants; use the paged pool")
