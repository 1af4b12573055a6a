"""AWQ (Lin et al. 2024): protect the weight rows that see large activations by scaling them.

Per input site, s = mean|x|^α (normalised by sqrt(max s · min s), as the authors' code
does) for α on a grid in [0, 1); each α is scored by the output error ‖XW − XŴ‖², computed
exactly from the calibration Gram matrix, of every tensor the fold changes (the consumers,
and a producer that is itself a quantized linear), and the best s is folded into the
producer (`folding.fold`). Then, optionally, each group's range is searched on the same
error: a clipping ratio (amax · r, r from 1 down to 0.5) for int/nvfp4, the block's E8M0
exponent for MX formats (`exponent_search`, which also scores α there).
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
from tenantq.quant.folding import FoldSite, share_within_groups, source_column_scale
from tenantq.quant.input_stats import InputStats
from tenantq.quant.plan import TensorQuant

DEFAULT_GRID = 20  # α in {0, 1/20, ..., 19/20}, the authors' grid
CLIP_RATIOS = tuple(1.0 - 0.025 * k for k in range(21))  # 1.0 ... 0.5
# E8M0 exponents tried per MX block, relative to the OCP rule's floor(log2 amax) - emax_elem.
MX_EXPONENT_STEPS = (0, 1, -1)


def output_error(w_hat, w, gram) -> float:
    """‖X W − X Ŵ‖_F² = tr(Δᵀ G Δ) with G = XᵀX, Δ = Ŵ − W (float64): the column errors
    summed (G Δ as one matrix product)."""
    d = np.asarray(w_hat, np.float64) - np.asarray(w, np.float64)
    return float(np.sum(column_errors(d, gram)))


def _rtn(w, how: TensorQuant) -> np.ndarray:
    q = quantize(w, how.format, axis=0, group_size=how.group_size, symmetric=how.symmetric)
    return np.asarray(dequantize(q))


def _scored(w, how: TensorQuant, gram: np.ndarray, clip: bool) -> np.ndarray:
    """What the search takes `w` to become: for awq at an MX format with `clip`, the
    exponent search (three roundings, cheap); otherwise plain rounding, as the authors'
    scale search does before its separate clipping search."""
    if clip and how.algorithm == "awq" and get_format(how.format).family == "mx":
        return np.asarray(dequantize(exponent_search(w, how, gram)))
    return _rtn(w, how)


def search_scale(
    params: Mapping[str, Any],
    config: ModelConfig,
    site: FoldSite,
    stats: InputStats,
    plans: Mapping[str, TensorQuant],
    *,
    grid: int = DEFAULT_GRID,
    clip: bool = True,
    source: tuple[TensorQuant, np.ndarray] | None = None,
) -> tuple[np.ndarray, float]:
    """AWQ's s for one site and its α: the grid point with the least summed output error.

    `plans` holds the TensorQuant of each consumer that AWQ quantizes; consumers the plan
    leaves in bf16 are not scored (they stay exact whatever s is). `source`: the producer's
    TensorQuant and the Gram of its own input, when the producer is a linear (v_proj for
    o_proj, up_proj for down_proj) that the plan quantizes: its columns are divided by s,
    which changes its rounding wherever block scales are powers of two (MX), so its error
    is scored too. α = 0 (s = 1) leaves every tensor as it was, so the chosen s never
    raises the scored error; at MX formats, scored with `exponent_search` as the tensors
    will be quantized, that error is the one `awq_weight` then gives.
    """
    magnitude = share_within_groups(config, site, stats.mean_abs).astype(np.float64)
    magnitude = np.maximum(magnitude, 1e-8)  # a channel that never fires: tiny, not zero
    # Each candidate is scored on exactly the tensors `folding.fold` would store: products and
    # quotients taken in float64, then rounded to float32 (the weights' own values, whatever
    # their dtype, are the reference).
    weights = {p: np.asarray(params[p], np.float64) for p in site.consumers if p in plans}
    best = (np.inf, np.ones_like(magnitude), 0.0)
    for k in range(grid):
        alpha = k / grid
        s = magnitude**alpha
        s = s / np.sqrt(s.max() * s.min())
        folded_gram = stats.gram / np.outer(s, s)
        err = sum(
            output_error(
                _scored((w * s[:, None]).astype(np.float32), plans[p], folded_gram, clip)
                / s[:, None],
                w,
                stats.gram,
            )
            for p, w in weights.items()
        )
        if source is not None:
            how, gram = source
            w = np.asarray(params[site.source], np.float64)
            t = source_column_scale(config, site, s)
            err += output_error(_scored((w / t).astype(np.float32), how, gram, clip) * t, w, gram)
        if err < best[0]:
            best = (err, s, alpha)
    return best[1], best[2]


def _check_gram(gram, n: int, how: TensorQuant) -> None:
    """A weight's Gram is that of its n input channels: [n, n]."""
    if np.shape(gram) != (n, n):
        raise ValueError(
            f"{how.path}: the Gram of a weight with {n} input rows must be [{n}, {n}], "
            f"got {list(np.shape(gram))}"
        )


def _block_diagonal(gram: np.ndarray, group: int) -> np.ndarray:
    """The [groups, g, g] diagonal blocks of G (a partial last block zero-padded)."""
    n = gram.shape[0]
    groups = -(-n // group)
    idx = np.minimum(np.arange(groups)[:, None] * group + np.arange(group)[None, :], n - 1)
    real = (np.arange(groups)[:, None] * group + np.arange(group)[None, :]) < n
    blocks = gram[idx[:, :, None], idx[:, None, :]]
    return np.where(real[:, :, None] & real[:, None, :], blocks, 0.0)


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
    _check_gram(gram, n, how)
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


def column_errors(delta, gram: np.ndarray) -> np.ndarray:
    """Per output column c: ‖X Δ[:, c]‖² = Δ[:, c]ᵀ G Δ[:, c] (float64)."""
    d = np.asarray(delta, np.float64)
    return np.einsum("ic,ic->c", d, gram @ d)


def exponent_search(weight, how: TensorQuant, gram: np.ndarray, steps=MX_EXPONENT_STEPS) -> QArray:
    """MX formats: each block's E8M0 exponent chosen among the OCP rule's and its
    neighbours by output error, where a clipping ratio could only shrink the range.

    OCP MX v1.0 (section 6.3) sets a block's scale to 2^(floor(log2 amax) - emax_elem):
    amax lands in [4, 8) x scale for E2M1 (in [256, 512) for E4M3), whose largest value is 6
    (448), so the top of the block saturates, by up to 25%; and an amax shrunk by a ratio
    in [0.5, 1) lowers the exponent by one or leaves it unchanged. So the search is over
    exponents: one up (nothing saturates, half the resolution), the OCP rule's, one down
    (more saturation, finer steps), scored per (block, output column) on the block's own
    Gram block. Per column, the choice is then kept only where the full Gram (cross-block
    terms included) agrees it beats the OCP scales, so the result's ‖XW − XŴ‖² on the
    calibration Gram never exceeds plain rounding's (RTN), column by column.
    """
    w = jnp.asarray(weight, jnp.float32)
    fmt = get_format(how.format)
    if fmt.family != "mx":
        raise ValueError(f"{how.path}: the exponent search is for MX formats, not {fmt.name}")
    n, out = w.shape
    _check_gram(gram, n, how)
    group = fmt.block_size
    blocks = jnp.asarray(_block_diagonal(gram, group), jnp.float32)
    groups = blocks.shape[0]
    pad = groups * group - n
    ocp = jnp.asarray(compute_scale_zero_point(w, fmt, axis=0)[0], jnp.int32)

    def rounded(codes):  # codes stay inside E8M0's finite range [0, 254]
        codes = jnp.clip(codes, 0, 254).astype(jnp.uint8)
        return codes, dequantize(quantize_with_scale_zero_point(w, fmt, codes, None, axis=0))

    best_err = jnp.full((groups, out), jnp.inf)
    best_codes = ocp
    for step in steps:  # the OCP rule first: a tie keeps it
        codes, q = rounded(ocp + step)
        delta = jnp.pad(q - w, ((0, pad), (0, 0))).reshape(groups, group, out)
        err = _group_errors(delta, blocks)
        better = err < best_err
        best_err = jnp.where(better, err, best_err)
        best_codes = jnp.where(better, codes.astype(jnp.int32), best_codes)
    w64 = np.asarray(w, np.float64)
    ocp_codes, ocp_q = rounded(ocp)
    searched_codes, searched_q = rounded(best_codes)
    keep = column_errors(np.asarray(searched_q) - w64, gram) <= column_errors(
        np.asarray(ocp_q) - w64, gram
    )
    codes = jnp.where(jnp.asarray(keep)[None, :], searched_codes, ocp_codes)
    return quantize_with_scale_zero_point(w, fmt, codes, None, axis=0)


def awq_weight(
    weight, how: TensorQuant, *, gram=None, awq_scaled: bool = False, clip: bool = True, **_: Any
) -> QArray:
    """The `awq` algorithm of a plan rule: the weight arrives scaled (its site folded)."""
    if not awq_scaled or gram is None:
        raise ValueError(
            f"{how.path}: algorithm 'awq' needs its input's scale searched and folded first; "
            "run tenantq.quant.site_inputs.site_inputs(params, plan, config, stats) and pass its "
            "inputs to apply_plan"
        )
    if how.axis != 0:
        raise ValueError(f"{how.path}: AWQ applies to linear weights [in, out] (axis 0)")
    if not clip:
        return quantize(weight, how.format, axis=0, group_size=how.group_size,
                        symmetric=how.symmetric)  # fmt: skip
    if get_format(how.format).family == "mx":
        return exponent_search(weight, how, np.asarray(gram, np.float64))
    return clip_search(weight, how, np.asarray(gram, np.float64))
