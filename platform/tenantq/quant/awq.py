"""AWQ (Lin et al. 2024): protect the weight rows that see large activations by scaling them.

Per input site, s = mean|x|^α (normalised by sqrt(max s · min s), as the authors' code
does) for α on a grid in [0, 1); each α is scored by the consumers' output error
‖XW − X Q(W·s)/s‖², computed exactly from the calibration Gram matrix, and the best s is
folded into the producer (`folding.fold`). α = 0 is plain rounding, so the chosen scale
never does worse than RTN on the calibration set. Then, optionally, each group's clipping
range is searched (amax · r, r from 1 down to 0.5) on the same error, group by group.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tenantq.model.config import ModelConfig
from tenantq.numerics import (
    QArray,
    compute_scale_zero_point,
    dequantize,
    get_format,
    quantize,
    quantize_with_scale_zero_point,
)
from tenantq.quant.apply import register_algorithm
from tenantq.quant.calibration import InputStats
from tenantq.quant.folding import FoldSite, share_within_groups
from tenantq.quant.plan import TensorQuant

DEFAULT_GRID = 20  # α in {0, 1/20, ..., 19/20}, the authors' grid
CLIP_RATIOS = tuple(1.0 - 0.025 * k for k in range(21))  # 1.0 ... 0.5


def output_error(w_hat, w, gram) -> float:
    """‖X W − X Ŵ‖_F² = tr(Δᵀ G Δ) with G = XᵀX, Δ = Ŵ − W (float64)."""
    d = np.asarray(w_hat, np.float64) - np.asarray(w, np.float64)
    return float(np.einsum("ic,ij,jc->", d, gram, d, optimize=True))


def _rtn(w, how: TensorQuant) -> np.ndarray:
    q = quantize(w, how.format, axis=0, group_size=how.group_size, symmetric=how.symmetric)
    return np.asarray(dequantize(q))


def search_scale(
    params: Mapping[str, Any],
    config: ModelConfig,
    site: FoldSite,
    stats: InputStats,
    plans: Mapping[str, TensorQuant],
    *,
    grid: int = DEFAULT_GRID,
) -> tuple[np.ndarray, float]:
    """AWQ's s for one site and its α: the grid point with the least summed output error.

    `plans` holds the TensorQuant of each consumer that AWQ quantizes; consumers the plan
    leaves in bf16 are not scored (they stay exact whatever s is).
    """
    magnitude = share_within_groups(config, site, stats.mean_abs).astype(np.float64)
    magnitude = np.maximum(magnitude, 1e-8)  # a channel that never fires: tiny, not zero
    weights = {p: np.asarray(params[p], np.float32) for p in site.consumers if p in plans}
    best = (np.inf, np.ones_like(magnitude), 0.0)
    for k in range(grid):
        alpha = k / grid
        s = magnitude**alpha
        s = s / np.sqrt(s.max() * s.min())
        s32 = s.astype(np.float32)
        err = sum(
            output_error(_rtn(w * s32[:, None], plans[p]) / s32[:, None], w, stats.gram)
            for p, w in weights.items()
        )
        if err < best[0]:
            best = (err, s, alpha)
    return best[1], best[2]


def _block_diagonal(gram: np.ndarray, group: int) -> np.ndarray:
    """The [groups, g, g] diagonal blocks of G (zero-padded to whole groups)."""
    n = gram.shape[0]
    groups = -(-n // group)
    padded = np.zeros((groups * group, groups * group))
    padded[:n, :n] = gram
    idx = np.arange(groups)[:, None] * group + np.arange(group)[None, :]
    return padded[idx[:, :, None], idx[:, None, :]]


@jax.jit
def _group_errors(delta, blocks):
    # delta [groups, g, out], blocks [groups, g, g] -> per (group, column) output error.
    return jnp.einsum("gic,gij,gjc->gc", delta, blocks, delta)


def clip_search(weight, how: TensorQuant, gram: np.ndarray, ratios=CLIP_RATIOS) -> QArray:
    """Quantize with each group's amax shrunk by the ratio that minimises its output error.

    Error per (group, column) counts the group's own inputs only (the cross-group terms of
    G are left out, as in the authors' per-group search), so groups choose independently.
    """
    w = jnp.asarray(weight, jnp.float32)
    spec = get_format(how.format)
    n, out = w.shape
    group = spec.block_size or how.group_size or n
    blocks = jnp.asarray(_block_diagonal(gram, group), jnp.float32)
    groups = blocks.shape[0]
    kwargs = dict(axis=0, group_size=how.group_size, symmetric=how.symmetric)
    fixed = {}
    if spec.family == "nvfp4":  # one tensor scale for every candidate: from the unclipped w
        fixed["tensor_scale"] = compute_scale_zero_point(w, how.format, **kwargs)[0].tensor
    pad = groups * group - n
    wp = jnp.pad(w, ((0, pad), (0, 0))).reshape(groups, group, out)
    # Symmetric formats read amax as max |x|; asymmetric int as the signed max (and amin).
    amax0 = jnp.max(jnp.abs(wp) if how.symmetric else wp, axis=1)  # [groups, out]
    amin0 = None if how.symmetric else jnp.min(wp, axis=1)
    best_err = jnp.full((groups, out), jnp.inf)
    best_ratio = jnp.ones((groups, out))
    for r in ratios:
        extra = {} if amin0 is None else {"amin": amin0 * r}
        scale, zp = compute_scale_zero_point(
            w, how.format, amax=amax0 * r, **kwargs, **extra, **fixed
        )
        q = dequantize(quantize_with_scale_zero_point(w, how.format, scale, zp, axis=0,
                                                      group_size=how.group_size))  # fmt: skip
        delta = jnp.pad(q - w, ((0, pad), (0, 0))).reshape(groups, group, out)
        err = _group_errors(delta, blocks)
        better = err < best_err
        best_err = jnp.where(better, err, best_err)
        best_ratio = jnp.where(better, r, best_ratio)
    extra = {} if amin0 is None else {"amin": amin0 * best_ratio}
    scale, zp = compute_scale_zero_point(
        w, how.format, amax=amax0 * best_ratio, **kwargs, **extra, **fixed
    )
    return quantize_with_scale_zero_point(
        w, how.format, scale, zp, axis=0, group_size=how.group_size
    )


@register_algorithm("awq")
def awq_weight(
    weight, how: TensorQuant, *, gram=None, awq_scaled: bool = False, clip: bool = True, **_: Any
) -> QArray:
    """The `awq` algorithm of a plan rule: the weight arrives scaled (its site folded)."""
    if not awq_scaled or gram is None:
        raise ValueError(
            f"{how.path}: algorithm 'awq' needs its input's scale searched and folded first; "
            "run tenantq.quant.calibrate.prepare(params, plan, config, stats) and pass its "
            "inputs to apply_plan"
        )
    if how.axis != 0:
        raise ValueError(f"{how.path}: AWQ applies to linear weights [in, out] (axis 0)")
    if not clip:
        return quantize(weight, how.format, axis=0, group_size=how.group_size,
                        symmetric=how.symmetric)  # fmt: skip
    return clip_search(weight, how, np.asarray(gram, np.float64))
