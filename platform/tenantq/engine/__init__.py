"""tenantq.engine: run a model under a plan (prefill, decode, generate, score, memory).

`Engine` is the public entry; the KV cache sits behind `tenantq.engine.cache.KVCache` so
the paged pool can replace the contiguous cache without changing the engine's methods.
"""

from tenantq.engine.cache import CacheFull, ContiguousCache, KVCache
from tenantq.engine.memory import MemoryReport
from tenantq.engine.runner import Batch, Engine

__all__ = ["Batch", "CacheFull", "ContiguousCache", "Engine", "KVCache", "MemoryReport"]
