"""Host half of the paged KV pool: sequences, slots, tenants and the block tables.

`PagedPool` is the engine's default `KVCache`. Pages are granted on demand as a sequence
grows (`prepare` before each step), through `PageAllocator`'s tenant quotas; a refusal is a
`PoolExhausted`, a sequence whose pages were taken by another tenant's guarantee raises
`SequencePreempted` at its next step. Sizes come from the plan's `LayerKV` formulas, the
same the capacity planner uses, and `kv_report` reads the bytes back from the real arrays.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from tenantq.engine.allocator import DEFAULT_TENANT, PageAllocator, PoolExhausted
from tenantq.engine.cache import CacheFull
from tenantq.engine.paged import PagedLayout, TensorSpec, layout_nbytes
from tenantq.model.config import ModelConfig
from tenantq.quant.plan import QuantPlan

__all__ = ["PagedPool", "PoolExhausted", "SequencePreempted", "pool_layer_bytes"]


class SequencePreempted(CacheFull):
    """A sequence lost its pages to another tenant's guarantee; release it and retry."""


def pool_layer_bytes(
    config: ModelConfig, plan: QuantPlan, page_tokens: int
) -> list[tuple[int, int]]:
    """Per layer (page bytes, per-slot residual + sink bytes), from the plan's formulas."""
    h, d, sinks = config.num_kv_heads, config.head_dim, plan.kv.sink_tokens
    out = []
    for kv in plan.kv_layers(config):
        slot = kv.residual_bytes(page_tokens, h, d) + kv.sink_bytes(sinks, h, d)
        out.append((kv.page_bytes(page_tokens, h, d), slot))
    return out


class PagedPool:
    """`KVCache` over one pool of `num_pages` pages of `page_tokens` tokens per layer.

    Options: `page_tokens` (16); `num_pages`, or `pool_bytes` (as many pages as fit once the
    `max_seqs` slots' residual and sink buffers are paid for); `max_seqs` (16, live
    sequences, each holding one slot); `max_seq_tokens` (the model's context by default).
    Without `num_pages`/`pool_bytes`, every slot can hold `max_seq_tokens` tokens.
    """

    def __init__(
        self,
        config: ModelConfig,
        plan: QuantPlan | None = None,
        *,
        dtype: str = "bfloat16",
        page_tokens: int = 16,
        num_pages: int | None = None,
        pool_bytes: int | None = None,
        max_seqs: int = 16,
        max_seq_tokens: int | None = None,
    ):
        plan = plan or QuantPlan()
        tokens = int(max_seq_tokens or config.max_position_embeddings)
        if page_tokens <= 0 or max_seqs <= 0 or tokens <= 0:
            raise ValueError(
                f"pool needs page_tokens, max_seqs and max_seq_tokens > 0, got "
                f"{page_tokens}, {max_seqs}, {tokens}"
            )
        if tokens > config.max_position_embeddings:
            raise ValueError(
                f"max_seq_tokens={tokens} exceeds the model's context "
                f"({config.max_position_embeddings} tokens)"
            )
        max_pages = -(-tokens // page_tokens)
        if num_pages is not None and pool_bytes is not None:
            raise ValueError("pass num_pages or pool_bytes, not both")
        if pool_bytes is not None:
            num_pages = self.pages_that_fit(config, plan, pool_bytes, page_tokens, max_seqs)
        elif num_pages is None:
            num_pages = max_seqs * max_pages
        if num_pages <= 0:
            raise ValueError(f"the pool needs at least one page, got num_pages={num_pages}")
        kv = plan.kv_layers(config)
        self.layout = PagedLayout(
            num_pages=int(num_pages),
            page_tokens=page_tokens,
            max_seqs=max_seqs,
            max_pages=max_pages,
            kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            sink_tokens=plan.kv.sink_tokens,
            layers=tuple(
                (TensorSpec(k.key_format, k.key_axis), TensorSpec(k.value_format, k.value_axis))
                for k in kv
            ),
            dtype=str(jnp.dtype(dtype)),
            store_dtype="float32" if jnp.dtype(dtype) == jnp.float32 else "bfloat16",
        )
        self.state = self.layout.init_state()
        self.max_seqs, self.max_seq_tokens, self.page_tokens = max_seqs, tokens, page_tokens
        self.num_pages = int(num_pages)
        self.allocator = PageAllocator(self.num_pages, page_tokens)
        self._free_slots = list(range(max_seqs - 1, -1, -1))
        self._slot: dict[int, int] = {}  # live sequence id -> slot
        self._tokens: dict[int, int] = {}  # tokens the next step leaves in the sequence
        self._preempted: set[int] = set()
        self._next_id = 0

    @staticmethod
    def pages_that_fit(
        config: ModelConfig, plan: QuantPlan, pool_bytes: int, page_tokens: int, max_seqs: int
    ) -> int:
        """Pages (in every layer) that `pool_bytes` buys after the slots' buffers."""
        per_layer = pool_layer_bytes(config, plan, page_tokens)
        page = sum(p for p, _ in per_layer)
        slots = max_seqs * sum(s for _, s in per_layer)
        if pool_bytes < slots + page:
            raise ValueError(
                f"pool_bytes={pool_bytes} cannot hold the {max_seqs} slots' residual/sink "
                f"buffers ({slots} bytes) and one page ({page} bytes)"
            )
        return (pool_bytes - slots) // page

    # ---------------------------------------------------------------- tenants
    def add_tenant(self, name: str, guaranteed_pages: int = 0) -> None:
        self.allocator.add_tenant(name, guaranteed_pages)

    def tenant_usage(self) -> dict[str, tuple[int, int]]:
        """tenant -> (pages used, pages guaranteed)."""
        return self.allocator.tenant_usage()

    @property
    def free_pages(self) -> int:
        return self.allocator.free_pages

    # ---------------------------------------------------------------- KVCache
    def allocate(self, num_tokens: int, tenant: str = DEFAULT_TENANT) -> int:
        """Open a sequence that may grow to `num_tokens`; pages come later, in `prepare`."""
        if num_tokens > self.max_seq_tokens:
            raise CacheFull(
                f"a sequence of {num_tokens} tokens exceeds max_seq_tokens={self.max_seq_tokens}"
            )
        if not self._free_slots:
            raise CacheFull(f"all {self.max_seqs} sequence slots are in use")
        seq_id = self._next_id
        self.allocator.open(seq_id, tenant)  # unknown tenant: ValueError, nothing taken
        self._next_id += 1
        self._slot[seq_id] = self._free_slots.pop()
        self._tokens[seq_id] = 0
        return seq_id

    def prepare(self, seq_ids: Sequence[int], end_tokens: Sequence[int]) -> None:
        """Grow each sequence's pages to hold `end_tokens` before a step writes them.

        Raises `SequencePreempted` for a sequence that lost its pages, `PoolExhausted` when
        the pool refuses growth (sequences grown earlier in the call keep their pages).
        """
        for seq_id, end in zip(seq_ids, end_tokens, strict=True):
            if seq_id in self._preempted:
                raise SequencePreempted(
                    f"sequence {seq_id} was preempted: its pages were reclaimed for another "
                    "tenant's guaranteed share; release it and submit it again"
                )
            if end > self.max_seq_tokens:
                raise CacheFull(
                    f"sequence {seq_id} would hold {end} tokens, over max_seq_tokens="
                    f"{self.max_seq_tokens}"
                )
            grant = self.allocator.ensure(seq_id, int(end))
            self._preempted.update(grant.preempted)
            self._tokens[seq_id] = int(end)

    def table(self, seq_ids: Sequence[int | None]) -> np.ndarray:
        lay = self.layout
        out = np.full((len(seq_ids), 2 + lay.max_pages), lay.num_pages, np.int32)
        for row, seq_id in enumerate(seq_ids):
            if seq_id is None:
                out[row, 0], out[row, 1] = lay.max_seqs, 0
                continue
            blocks = self.allocator.block_table(seq_id)
            out[row, 0], out[row, 1] = self._slot[seq_id], self._tokens[seq_id]
            out[row, 2 : 2 + len(blocks)] = blocks
        return out

    def free(self, seq_id: int) -> None:
        if seq_id not in self._slot:
            raise ValueError(f"sequence {seq_id} is not allocated")
        if seq_id in self._preempted:
            self._preempted.remove(seq_id)
        else:
            self.allocator.close(seq_id)
        self._free_slots.append(self._slot.pop(seq_id))
        del self._tokens[seq_id]

    def is_preempted(self, seq_id: int) -> bool:
        return seq_id in self._preempted

    # ---------------------------------------------------------------- bytes
    def kv_report(self) -> list[dict]:
        """Per layer: formats, pages, and true bytes of data, scales, residual and sinks."""
        rows = []
        for layer, (row, (k, v)) in enumerate(
            zip(layout_nbytes(self.state), self.layout.layers, strict=True)
        ):
            pages_bytes = row["data_bytes"] + row["scale_bytes"]
            rows.append(
                {
                    "layer": layer,
                    "key_format": k.fmt,
                    "key_axis": k.axis,
                    "value_format": v.fmt,
                    "value_axis": v.axis,
                    "pages": self.num_pages,
                    **row,
                    "pages_bytes": pages_bytes,
                    "total_bytes": pages_bytes + row["residual_bytes"] + row["sink_bytes"],
                }
            )
        return rows

    @property
    def nbytes(self) -> int:
        return sum(r["total_bytes"] for r in self.kv_report())
