"""SmoothQuant (Xiao et al. 2023): move activation outliers into the weights before W8A8.

Per input channel j, s_j = max|X_j|^α / max|W_j|^(1-α) (eq. 4; α = 0.5 by default), taken
from the calibration statistics and the weight rows of every linear reading that input;
`folding.fold` divides the producer by s and multiplies the weights by s, so the bf16
model is unchanged while the activations W8A8 quantizes per token lose their outlier
channels. The weights are then rounded to nearest with the one codec.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from tenantq.model.config import ModelConfig
from tenantq.numerics import QArray, quantize
from tenantq.quant.folding import (
    FoldSite,
    fold,
    fold_sites,
    share_within_groups,
    weight_row_absmax,
)
from tenantq.quant.input_stats import CalibrationStats
from tenantq.quant.plan import TensorQuant

DEFAULT_ALPHA = 0.5
_SCALE_RANGE = (1e-5, 1e5)  # guards channels that never fire or rows that are all zero


def smoothing_scales(
    act_absmax: np.ndarray, weight_absmax: np.ndarray, alpha: float = DEFAULT_ALPHA
) -> np.ndarray:
    """s = max|X|^α / max|W|^(1-α) per channel; channels with a zero side take s = 1."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"SmoothQuant alpha must lie in [0, 1], got {alpha}")
    a = np.asarray(act_absmax, np.float64)
    w = np.asarray(weight_absmax, np.float64)
    dead = (a <= 0) | (w <= 0)
    s = np.power(np.where(dead, 1.0, a), alpha) / np.power(np.where(dead, 1.0, w), 1.0 - alpha)
    return np.clip(np.where(dead, 1.0, s), *_SCALE_RANGE)


def site_scales(
    params: Mapping[str, Any],
    config: ModelConfig,
    site: FoldSite,
    stats: CalibrationStats,
    alpha: float = DEFAULT_ALPHA,
) -> np.ndarray:
    """SmoothQuant's s for one site, shared within KV groups where the fold needs it."""
    act = share_within_groups(config, site, stats.sites[site.site].absmax)
    w = share_within_groups(config, site, weight_row_absmax(params, site))
    return smoothing_scales(act, w, alpha)


def smooth(
    params: Mapping[str, Any],
    config: ModelConfig,
    stats: CalibrationStats,
    *,
    alpha: float = DEFAULT_ALPHA,
    sites: list[str] | None = None,
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Params with SmoothQuant folded into `sites` (default: every foldable site).

    Returns the new params (changed tensors as float32 numpy) and each site's scale.
    """
    all_sites = fold_sites(config)
    chosen = list(all_sites) if sites is None else sites
    unknown = sorted(set(chosen) - set(all_sites))
    if unknown:
        raise ValueError(f"cannot smooth {unknown}: not foldable sites of this model")
    out = dict(params)
    scales = {}
    for name in chosen:
        site = all_sites[name]
        scales[name] = site_scales(out, config, site, stats, alpha)
        out = fold(out, config, site, scales[name])
    return out, scales


def smoothquant_weight(weight, how: TensorQuant, *, smoothed: bool = False, **_: Any) -> QArray:
    """The weight of a smoothed linear, rounded to nearest in `how`'s format.

    The smoothing itself changes two tensors (this weight and its input's producer), so it
    runs before (`smooth`, or `tenantq.quant.site_inputs.site_inputs`), which passes smoothed=True.
    """
    if not smoothed:
        raise ValueError(
            f"{how.path}: algorithm 'smoothquant' needs the model smoothed first; "
            "run tenantq.quant.site_inputs.site_inputs(params, plan, config, stats) and pass its "
            "inputs to apply_plan"
        )
    return quantize(
        weight, how.format, axis=how.axis, group_size=how.group_size, symmetric=how.symmetric
    )
