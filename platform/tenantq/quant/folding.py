"""Moving a per-input-channel scale s out of a linear's input and into its weight.

x @ W = (x / s) @ (diag(s) W): the weight rows are multiplied by s and the division by s
is folded into whatever produced x, so the model computes the same function. The producer
is the RMSNorm before q/k/v, gate/up and the LM head (its weight divided by s), v_proj for
o_proj (attention output is a convex mix of values, so scaling v's output channels scales
it; under GQA the heads of one KV group share a scale), and up_proj for down_proj
(silu(gate) * up is linear in up). SmoothQuant and AWQ both choose s and fold it here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from tenantq.model.config import ModelConfig
from tenantq.quant.input_stats import InputStats, head_site, input_sites


@dataclass(frozen=True)
class FoldSite:
    """One input shared by `consumers`, produced by `source` (a norm weight or projection)."""

    site: str
    consumers: tuple[str, ...]
    source: str
    source_kind: str  # "norm", "columns" (up_proj), "value_heads" (v_proj under GQA)


def fold_sites(config: ModelConfig) -> dict[str, FoldSite]:
    """Every input site of `config` whose scale can be folded, by site name."""
    out: dict[str, FoldSite] = {}
    for layer in range(config.num_layers):
        p = f"layers/{layer}"
        sources = {
            f"{p}/attn/in": (f"{p}/input_norm", "norm"),
            f"{p}/attn/o_in": (f"{p}/attn/v_proj", "value_heads"),
            f"{p}/mlp/in": (f"{p}/post_attn_norm", "norm"),
            f"{p}/mlp/down_in": (f"{p}/mlp/up_proj", "columns"),
        }
        for site, consumers in input_sites(config, layer).items():
            source, kind = sources[site]
            out[site] = FoldSite(site, consumers, source, kind)
    if not config.tie_word_embeddings:  # a tied head shares its weight with the embedding
        ((site, consumers),) = head_site(config).items()
        out[site] = FoldSite(site, consumers, "final_norm", "norm")
    return out


def site_of(config: ModelConfig, path: str) -> FoldSite | None:
    for site in fold_sites(config).values():
        if path in site.consumers:
            return site
    return None


def share_within_groups(config: ModelConfig, site: FoldSite, per_channel: np.ndarray):
    """Make a per-input-channel array foldable: for o_proj, the max over each KV group's heads.

    o_proj's input channel (head h, dim j) comes from value head h // (heads / kv_heads), so
    all heads of a group must take one scale; other sites are returned unchanged.
    """
    if site.source_kind != "value_heads":
        return per_channel
    hkv, d = config.num_kv_heads, config.head_dim
    grouped = np.asarray(per_channel).reshape(hkv, config.num_heads // hkv, d)
    shared = grouped.max(axis=1, keepdims=True)
    return np.broadcast_to(shared, grouped.shape).reshape(-1)


def weight_row_absmax(params: Mapping[str, Any], site: FoldSite) -> np.ndarray:
    """max |W[j, :]| over every consumer's output columns, per input channel j."""
    rows = [np.abs(np.asarray(params[p], np.float32)).max(axis=1) for p in site.consumers]
    return np.max(rows, axis=0)


def fold(
    params: Mapping[str, Any], config: ModelConfig, site: FoldSite, scale: np.ndarray
) -> dict[str, Any]:
    """Params with consumers' rows multiplied by `scale` and the producer divided by it.

    Computed in float32 from the given values; returns float32 numpy arrays for the tensors
    it changed (the caller casts). `scale` must already be shared within KV groups.
    """
    s = np.asarray(scale, np.float64)
    if s.shape != (np.shape(params[site.consumers[0]])[0],) or not np.all(np.isfinite(s) & (s > 0)):
        raise ValueError(f"{site.site}: a fold scale must be finite, > 0, one per input channel")
    out = dict(params)
    for path in site.consumers:
        out[path] = (np.asarray(params[path], np.float64) * s[:, None]).astype(np.float32)
    src = np.asarray(params[site.source], np.float64)
    if site.source_kind == "norm":
        out[site.source] = (src / s).astype(np.float32)
        return out
    s = source_column_scale(config, site, s)
    out[site.source] = (src / s[None, :]).astype(np.float32)
    bias = site.source.rsplit("_", 1)[0] + "_bias"  # layers/i/attn/v_proj -> v_bias
    if bias in params:
        out[bias] = (np.asarray(params[bias], np.float64) / s).astype(np.float32)
    return out


def source_column_scale(config: ModelConfig, site: FoldSite, scale: np.ndarray) -> np.ndarray:
    """The divisor of each output column of a projection source (v_proj: one per KV channel)."""
    s = np.asarray(scale, np.float64)
    if site.source_kind != "value_heads":
        return s
    hkv, d = config.num_kv_heads, config.head_dim
    grouped = s.reshape(hkv, config.num_heads // hkv, d)
    if not np.allclose(grouped, grouped[:, :1], rtol=1e-6):
        raise ValueError(f"{site.site}: scales differ within a KV group; share them first")
    return grouped[:, 0, :].reshape(-1)


def folded_stats(stats: InputStats, scale: np.ndarray) -> InputStats:
    """The statistics of x / s, given those of x (exact: every figure is per channel)."""
    s = np.asarray(scale, np.float64)
    return InputStats(
        stats.site, stats.paths, stats.tokens,
        (stats.absmax / s).astype(np.float32), (stats.percentile / s).astype(np.float32),
        (stats.mean_abs / s).astype(np.float32), stats.gram / np.outer(s, s),
    )  # fmt: skip
