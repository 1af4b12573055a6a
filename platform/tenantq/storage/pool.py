"""Pool arithmetic: the page, slot and static byte sums over a chip's layers, written once.

The engine sizes its `PagedPool` and the capacity planner its budget from `kv_sums` and
`pages_that_fit` on the same `LayerKVStorage` rows, so both buy the same number of pages
from the same bytes. Pure Python: no JAX.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from tenantq.storage.kv import LayerKVStorage

# The default runtime reserve: 10% of each chip's memory, the headroom vLLM leaves by default
# (gpu_memory_utilization=0.9) for activations, the compiler's workspace and the runtime.
DEFAULT_RESERVE_FRACTION = Fraction(1, 10)


def pool_bytes_left(memory_bytes: int, weights_bytes: int, reserve_bytes: int) -> int:
    """The KV pool of one chip: its memory less the weights it holds and the runtime reserve."""
    return max(0, memory_bytes - weights_bytes - reserve_bytes)


@dataclass(frozen=True)
class KVSums:
    """One chip's KV bytes summed over its layers: the one place these sums are written."""

    page_bytes: int  # one page in every layer (elements and page scales)
    slot_bytes: int  # one sequence slot in every layer (residual windows and sink copies)
    static_bytes: int  # static scales and clip counters, once per layer whatever the pool

    def fixed_bytes(self, max_seqs: int) -> int:
        """Bytes a pool pays before its first page: `max_seqs` slots and the static part."""
        return max_seqs * self.slot_bytes + self.static_bytes


def kv_sums(layers: Sequence[LayerKVStorage]) -> KVSums:
    """The page, slot and static bytes of `layers` (one chip's `kv_storage`), summed."""
    return KVSums(
        page_bytes=sum(lay.page_bytes for lay in layers),
        slot_bytes=sum(lay.slot_bytes for lay in layers),
        static_bytes=sum(lay.static_bytes for lay in layers),
    )


def pages_that_fit(layers: Sequence[LayerKVStorage], pool_bytes: int, max_seqs: int) -> int:
    """Pages (one in every layer) that `pool_bytes` buys once the static scales and
    `max_seqs` slots' residual and sink buffers are paid for; ValueError naming the figures
    when not even one page fits."""
    sums = kv_sums(layers)
    page, slots = sums.page_bytes, sums.fixed_bytes(max_seqs)
    if pool_bytes < slots + page:
        raise ValueError(
            f"a KV pool of {pool_bytes:,} bytes cannot hold the {max_seqs} sequence slots' "
            f"residual/sink buffers and static scales ({slots:,} bytes) and one page in every "
            f"layer ({page:,} bytes); give it more memory or fewer max_seqs"
        )
    return (pool_bytes - slots) // page
