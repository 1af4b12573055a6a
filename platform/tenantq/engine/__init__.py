"""tenantq.engine: run a model under a plan (prefill, decode, generate, score, memory).

`Engine` is the public entry; the KV cache sits behind `tenantq.engine.cache.KVCache` so
the paged pool (the default: `PagedPool`) and the contiguous cache are interchangeable.
"""

from tenantq.engine.allocator import PoolExhausted
from tenantq.engine.cache import CacheFull, ContiguousCache, KVCache
from tenantq.engine.engine import Batch, Engine
from tenantq.engine.memory import MemoryReport
from tenantq.engine.pool import PagedPool, SequencePreempted

__all__ = [
    "Batch",
    "CacheFull",
    "ContiguousCache",
    "Engine",
    "KVCache",
    "MemoryReport",
    "PagedPool",
    "PoolExhausted",
    "SequencePreempted",
]
