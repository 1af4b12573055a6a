"""`site_inputs`: turn a plan's calibrated rules plus statistics into what `apply_plan` needs.

SmoothQuant and AWQ change two tensors per input site (the consumers and the producer),
which a per-tensor algorithm cannot do, and GPTQ needs its input's Hessian. So this runs
once over the sites: it folds SmoothQuant's or AWQ's scales into the params, carries the
statistics through the fold (x becomes x / s), and hands each tensor's algorithm its
inputs (and static W8A8 tensors their input's calibrated amax, after any fold). Usage:
`cal = site_inputs(params, plan, config, stats)`, then
`apply_plan(cal.params, plan, config, inputs=cal.inputs)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import jax.numpy as jnp
import numpy as np

from tenantq.model.config import ModelConfig
from tenantq.quant import awq, smoothquant
from tenantq.quant.folding import fold, fold_sites, folded_stats, source_column_scale
from tenantq.quant.input_stats import (
    DEFAULT_PERCENTILE,
    CalibrationStats,
    InputStats,
    head_site,
    input_sites,
)
from tenantq.quant.plan import QuantPlan

_FOLDING = ("smoothquant", "awq")
# Which per-channel statistic a static activation scale covers: the calibration set's
# absmax (nothing seen clips) or its high percentile (the rare outliers clip).
STATIC_STATISTICS = ("absmax", "percentile")


@dataclass
class Calibrated:
    """Params with folds applied, per-tensor algorithm inputs, and each folded site's s."""

    params: dict[str, Any]
    inputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    fold_scales: dict[str, np.ndarray] = field(default_factory=dict)
    awq_alphas: dict[str, float] = field(default_factory=dict)
    site_stats: dict[str, InputStats] = field(default_factory=dict)  # after any fold

    def effective_weight(self, path: str, quantized, config: ModelConfig) -> np.ndarray:
        """The weight as the original model sees it: rows / s of the site `path` reads,
        columns * s of a site `path` produces (v_proj, up_proj), so ‖XW − XŴ‖ compares
        like with like."""
        w = np.asarray(quantized, np.float64)
        sites = fold_sites(config)
        for name, s in self.fold_scales.items():
            if path in sites[name].consumers:
                w = w / s[:, None]
            if path == sites[name].source:
                w = w * source_column_scale(config, sites[name], s)[None, :]
        return w


def site_inputs(
    params: Mapping[str, Any],
    plan: QuantPlan,
    config: ModelConfig,
    stats: CalibrationStats,
    *,
    alpha: float = smoothquant.DEFAULT_ALPHA,
    awq_grid: int = awq.DEFAULT_GRID,
    awq_clip: bool = True,
    act_order: bool = False,
    static_statistic: str = "absmax",
) -> Calibrated:
    """Fold and collect inputs for every site whose consumers use smoothquant/awq/gptq or
    static activation scales (amax = the max over channels of `static_statistic`)."""
    options = _Options(alpha, awq_grid, awq_clip, act_order, static_statistic)  # checks first
    resolved = plan.resolve(config)
    out = Calibrated(dict(params))
    for name, consumers in _all_sites(config).items():
        _prepare_site(out, name, consumers, resolved, config, stats, options)
    return out


def site_inputs_sequential(
    params: Mapping[str, Any],
    plan: QuantPlan,
    config: ModelConfig,
    windows,
    *,
    percentile: float = DEFAULT_PERCENTILE,
    dtype=jnp.bfloat16,
    alpha: float = smoothquant.DEFAULT_ALPHA,
    awq_grid: int = awq.DEFAULT_GRID,
    awq_clip: bool = True,
    act_order: bool = False,
    static_statistic: str = "absmax",
) -> tuple[Calibrated, CalibrationStats]:
    """`site_inputs` with sequential statistics (GPTQ, Frantar et al. 2022, section 4: the inputs
    of layer l are the outputs of the already-quantized layers < l).

    `windows` run through the model one decoder layer at a time, as in
    `input_stats.compute_statistics`; once layer l's statistics are taken, its sites are
    prepared (folds, GPTQ Hessians, static amax) and its planned tensors quantized, and the
    next layer reads layer l's outputs computed with those quantized weights (dequantized;
    activations and attention stay at `dtype`). A planned embedding is rounded before layer
    0 reads it. Within a layer every linear sees that layer's full-precision sublayers (the
    paper's per-layer order, not a per-linear one). Returns (Calibrated, the statistics as
    seen); `apply_plan(cal.params, plan, config, inputs=cal.inputs)` then gives the same
    weights the propagation used. Nothing is cached: the statistics depend on the plan.
    """
    from tenantq.numerics import dequantize
    from tenantq.quant.apply import quantize_tensor
    from tenantq.quant.input_stats import compute_statistics

    options = _Options(alpha, awq_grid, awq_clip, act_order, static_statistic)  # checks first
    resolved = plan.resolve(config)
    out = Calibrated(dict(params))
    seen = CalibrationStats("sequential", "", {})

    def rounded(path: str):
        q = quantize_tensor(out.params[path], resolved[path], **out.inputs.get(path, {}))
        return np.asarray(dequantize(q), np.float32)

    def replace_layer(layer: int, sites: dict[str, InputStats]) -> dict[str, Any]:
        seen.sites.update(sites)
        for name, consumers in input_sites(config, layer).items():
            _prepare_site(out, name, consumers, resolved, config, seen, options)
        prefix = f"layers/{layer}/"
        layer_params = {p: v for p, v in out.params.items() if p.startswith(prefix)}
        return {p: rounded(p) if p in resolved else v for p, v in layer_params.items()}

    start = dict(params)
    if "embed" in resolved:
        start["embed"] = rounded("embed")
    sites, seconds = compute_statistics(
        config, start, windows, percentile=percentile, dtype=dtype, replace_layer=replace_layer
    )
    seen.sites.update(sites)
    seen.seconds_per_layer = seconds
    for name, consumers in head_site(config).items():
        _prepare_site(out, name, consumers, resolved, config, seen, options)
    return out, seen


@dataclass(frozen=True)
class _Options:
    alpha: float
    awq_grid: int
    awq_clip: bool
    act_order: bool
    static_statistic: str

    def __post_init__(self) -> None:
        if self.static_statistic not in STATIC_STATISTICS:
            raise ValueError(
                f"static_statistic={self.static_statistic!r}; valid: {', '.join(STATIC_STATISTICS)}"
            )


def _all_sites(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    sites = dict(head_site(config))
    for layer in range(config.num_layers):
        sites.update(input_sites(config, layer))
    return sites


def _prepare_site(out: Calibrated, name, consumers, resolved, config, stats, options) -> None:
    """Fold (smoothquant/awq) and collect the algorithm inputs of one input site into `out`."""
    foldable = fold_sites(config)
    algorithms = {resolved[p].algorithm for p in consumers if p in resolved}
    static = [p for p in consumers if p in resolved and _static(resolved[p])]
    if not algorithms - {"rtn"} and not static:
        return
    site_stats = stats.sites[name]
    folding = sorted(algorithms & set(_FOLDING))
    if len(folding) > 1:
        raise ValueError(
            f"{', '.join(consumers)} read one input, so they must agree on a scaling "
            f"algorithm; the plan mixes {' and '.join(folding)}"
        )
    if folding and name not in foldable:
        raise ValueError(
            f"{folding[0]} cannot fold a scale into the input of {', '.join(consumers)} "
            "(a tied LM head shares its weight with the embedding); use rtn or gptq there"
        )
    if folding == ["smoothquant"]:
        s = smoothquant.site_scales(out.params, config, foldable[name], stats, options.alpha)
    elif folding == ["awq"]:
        plans = {p: resolved[p] for p in consumers if p in resolved}
        s, out.awq_alphas[name] = awq.search_scale(
            out.params, config, foldable[name], site_stats, plans, grid=options.awq_grid,
            clip=options.awq_clip, source=_awq_source(out, foldable[name].source, resolved, stats),
        )  # fmt: skip
    if folding:
        out.params = fold(out.params, config, foldable[name], s)
        site_stats = folded_stats(site_stats, s)
        out.fold_scales[name] = s
    out.site_stats[name] = site_stats
    for path in consumers:
        algorithm = resolved[path].algorithm if path in resolved else None
        if algorithm == "smoothquant":
            out.inputs[path] = {"smoothed": True}
        elif algorithm == "awq":
            out.inputs[path] = {
                "awq_scaled": True, "gram": site_stats.gram, "clip": options.awq_clip
            }  # fmt: skip
        elif algorithm == "gptq":
            out.inputs[path] = {"hessian": site_stats.hessian, "act_order": options.act_order}
        if path in static:
            per_channel = getattr(site_stats, options.static_statistic)
            out.inputs.setdefault(path, {})["act_amax"] = float(np.max(per_channel))


def _awq_source(out: Calibrated, source: str, resolved, stats: CalibrationStats):
    """(TensorQuant, Gram of its input as folded so far) of a producer that the plan
    quantizes by rounding (rtn, awq), which AWQ's search then scores; else None."""
    how = resolved.get(source)
    if how is None or how.algorithm not in ("rtn", "awq"):
        return None
    own = stats.for_path(source)
    return how, out.site_stats.get(own.site, own).gram


def _static(how) -> bool:
    return how.activation_scale == "static"
