"""The paged KV pool, by arithmetic: per-layer page bytes, per-slot overhead, per-tenant bytes.

The pool holds pages of `page_tokens` tokens; a page of layer l costs `page_bytes_l`, from
the plan's `LayerKV.page_bytes` (the formula the engine's pool allocates with). A sequence
of C tokens holds ceil(kv_tokens_l(C) / page_tokens) pages in layer l, where a sliding-
window layer keeps at most its window (`ModelConfig.layer_kv_tokens`): pages are counted
per layer, so local layers stop growing at the window. Each sequence slot also holds, per
layer, a bf16 residual window (per-channel quantized tensors) and a bf16 sink copy.
Everything here is per chip: a chip holds num_kv_heads / tp heads of every token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tenantq.model.config import ModelConfig
from tenantq.quant.plan import QuantPlan


@dataclass(frozen=True)
class LayerKVBytes:
    """One layer's KV storage on one chip."""

    layer: int
    kind: str  # "full" | "sliding"
    window_tokens: int | None
    key_format: str
    key_axis: str
    value_format: str
    value_axis: str
    page_bytes: int  # one page of `page_tokens` tokens, keys and values, scales included
    residual_bytes: int  # per sequence slot
    sink_bytes: int  # per sequence slot

    @property
    def slot_bytes(self) -> int:
        return self.residual_bytes + self.sink_bytes


def kv_heads_per_chip(config: ModelConfig, tp: int) -> int:
    if config.num_kv_heads % tp:
        raise ValueError(
            f"{tp} chips do not divide num_key_value_heads={config.num_kv_heads}; "
            "KV heads are sharded, not replicated"
        )
    return config.num_kv_heads // tp


def kv_layers(
    config: ModelConfig, plan: QuantPlan, page_tokens: int, tp: int = 1
) -> tuple[LayerKVBytes, ...]:
    """Per-layer page, residual and sink bytes on one of `tp` chips."""
    if not isinstance(page_tokens, int) or page_tokens < 1:
        raise ValueError(f"page_tokens must be a positive integer, got {page_tokens!r}")
    heads = kv_heads_per_chip(config, tp)
    out = []
    for layer in range(config.num_layers):
        kv = plan.kv.for_layer(layer, config.num_layers)
        kind = config.layer_types[layer]
        out.append(
            LayerKVBytes(
                layer=layer,
                kind=kind,
                window_tokens=config.sliding_window if kind == "sliding" else None,
                key_format=kv.key_format,
                key_axis=kv.key_axis,
                value_format=kv.value_format,
                value_axis=kv.value_axis,
                page_bytes=kv.page_bytes(page_tokens, heads, config.head_dim),
                residual_bytes=kv.residual_bytes(page_tokens, heads, config.head_dim),
                sink_bytes=kv.sink_bytes(plan.kv.sink_tokens, heads, config.head_dim),
            )
        )
    return tuple(out)


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
    layers: Sequence[LayerKVBytes], num_pages: int | Sequence[int], num_slots: int
) -> dict:
    """`kv_pool_bytes` on precomputed per-layer figures (see there)."""
    pages = [num_pages] * len(layers) if isinstance(num_pages, int) else list(num_pages)
    if len(pages) != len(layers):
        raise ValueError(f"num_pages has {len(pages)} entries for {len(layers)} layers")
    if any(p < 0 for p in pages) or num_slots < 0:
        raise ValueError("page and slot counts must not be negative")
    rows = []
    for lay, n in zip(layers, pages, strict=True):
        row = {
            "layer": lay.layer,
            "pages": n,
            "page_bytes": lay.page_bytes,
            "pages_bytes": n * lay.page_bytes,
            "residual_bytes": num_slots * lay.residual_bytes,
            "sink_bytes": num_slots * lay.sink_bytes,
        }
        row["total_bytes"] = row["pages_bytes"] + row["residual_bytes"] + row["sink_bytes"]
        rows.append(row)
    keys = ("pages_bytes", "residual_bytes", "sink_bytes", "total_bytes")
    return {"layers": rows, **{k: sum(r[k] for r in rows) for k in keys}}


def kv_pool_bytes(
    config: ModelConfig,
    plan: QuantPlan,
    num_pages: int | Sequence[int],
    num_slots: int,
    page_tokens: int,
    tp: int = 1,
) -> dict:
    """Bytes one chip's KV pool holds: `num_pages` pages per layer (an int for every layer,
    or one count per layer) and `num_slots` sequence slots.

    Returns `{"layers": [{"layer", "pages", "page_bytes", "pages_bytes", "residual_bytes",
    "sink_bytes", "total_bytes"}, ...], "pages_bytes", "residual_bytes", "sink_bytes",
    "total_bytes"}`; the engine's `memory_report()` must equal it byte for byte.
    """
    return pool_bytes_from_layers(kv_layers(config, plan, page_tokens, tp), num_pages, num_slots)
