"""The paged KV pool, by arithmetic: pages per tenant and the pool's bytes per layer.

A page of layer l costs `page_bytes_l` and a sequence slot `slot_bytes_l`, both read from
`tenantq.storage.kv.LayerKVStorage` (the description the engine's pool allocates from).
A sequence of C tokens holds ceil(kv_tokens_l(C) / page_tokens) pages in layer l, where a
sliding-window layer keeps at most its window (`ModelConfig.layer_kv_tokens`): pages are
counted per layer, so local layers stop growing at the window. Everything here is per chip:
a chip holds num_kv_heads / tp heads of every token.
"""

from __future__ import annotations

from collections.abc import Sequence

from tenantq.model.config import ModelConfig
from tenantq.quant.plan import QuantPlan
from tenantq.storage.kv import LayerKVStorage, kv_storage


def pages_per_sequence(
    config: ModelConfig, layer: int, context_tokens: int, page_tokens: int
) -> int:
    """Pages one sequence of `context_tokens` holds in `layer` (page rounding per sequence)."""
    return -(-config.layer_kv_tokens(layer, context_tokens) // page_tokens)


def tenant_pages(config: ModelConfig, context_tokens: int, page_tokens: int) -> tuple[int, ...]:
    """Per layer, the pages one tenant of `context_tokens` holds."""
    if not isinstance(context_tokens, int) or context_tokens < 1:
        raise ValueError(f"context must be a positive number of tokens, got {context_tokens!r}")
    return tuple(
        pages_per_sequence(config, layer, context_tokens, page_tokens)
        for layer in range(config.num_layers)
    )


def pool_bytes_from_layers(
    layers: Sequence[LayerKVStorage], num_pages: int | Sequence[int], num_slots: int
) -> dict:
    """`kv_pool_bytes` on precomputed per-layer storage (see there)."""
    pages = [num_pages] * len(layers) if isinstance(num_pages, int) else list(num_pages)
    if len(pages) != len(layers):
        raise ValueError(f"num_pages has {len(pages)} entries for {len(layers)} layers")
    if any(p < 0 for p in pages) or num_slots < 0:
        raise ValueError("page and slot counts must not be negative")
    rows = [lay.bytes_row(n, num_slots) for lay, n in zip(layers, pages, strict=True)]
    keys = ("pages_bytes", "residual_bytes", "sink_bytes", "static_bytes", "total_bytes")
    return {"layers": rows, **{k: sum(r[k] for r in rows) for k in keys}}


def kv_pool_bytes(
    config: ModelConfig,
    plan: QuantPlan,
    num_pages: int | Sequence[int],
    num_slots: int,
    page_tokens: int,
    tp: int = 1,
    *,
    store_dtype: str = "bfloat16",
) -> dict:
    """Bytes one chip's KV pool holds: `num_pages` pages per layer (an int for every layer,
    or one count per layer) and `num_slots` sequence slots; `store_dtype` is what the engine
    keeps unquantized KV in (bfloat16; float32 for a float32 engine).

    Returns `{"layers": [row, ...], "pages_bytes", "residual_bytes", "sink_bytes",
    "static_bytes", "total_bytes"}` (static: tensor/head scales, once per layer) with rows
    from `LayerKVStorage.bytes_row`; the engine's `memory_report()` rows must equal them byte
    for byte.
    """
    layers = kv_storage(config, plan, page_tokens, tp, store_dtype=store_dtype)
    return pool_bytes_from_layers(layers, num_pages, num_slots)
