"""SmoothQuant's scales against the paper's formula, written out here in numpy (Xiao et al.
2023, eq. 4: s_j = max|X_j|^α / max|W_j|^(1-α)), and `smooth`/`smoothquant_weight` on a
tiny config with numpy params and hand-made statistics (no model run, no jit: milliseconds).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from tenantq.numerics import dequantize, quantize
from tenantq.quant.folding import fold, fold_sites
from tenantq.quant.input_stats import CalibrationStats, InputStats
from tenantq.quant.plan import TensorQuant
from tenantq.quant.smoothquant import site_scales, smooth, smoothing_scales, smoothquant_weight
from tenantq.testing import tiny_config


def paper_scales(act_absmax, weight_absmax, alpha):
    """Eq. 4, channel by channel, in float64."""
    return np.array(
        [a**alpha / w ** (1 - alpha) for a, w in zip(act_absmax, weight_absmax, strict=True)]
    )


def _params(config, seed=0):
    rng = np.random.default_rng(seed)
    return {
        p: (rng.standard_normal(info.shape) * 0.5 + (info.kind == "norm")).astype(np.float32)
        for p, info in config.tensors().items()
    }


def _stats(config, params, seed=1):
    # Per site, max |x| per input channel spread over two decades (SmoothQuant's outliers).
    rng = np.random.default_rng(seed)
    sites = {}
    for name, site in fold_sites(config).items():
        n = np.shape(params[site.consumers[0]])[0]
        absmax = np.exp(rng.uniform(-2, 3, n)).astype(np.float32)
        sites[name] = InputStats(name, site.consumers, 16, absmax, absmax, absmax / 3, np.eye(n))
    return CalibrationStats("m", "d", sites)


@pytest.mark.parametrize("alpha", [0.0, 0.25, 0.5, 0.85, 1.0])
def test_scales_follow_the_papers_formula_for_every_alpha(alpha):
    # α = 0 and α = 1 are allowed (s = 1 / max|W|, s = max|X|); float64 throughout: 1e-12.
    rng = np.random.default_rng(3)
    a, w = np.exp(rng.uniform(-3, 3, 12)), np.exp(rng.uniform(-3, 3, 12))
    np.testing.assert_allclose(smoothing_scales(a, w, alpha), paper_scales(a, w, alpha), rtol=1e-12)


def test_the_default_alpha_is_one_half():
    a, w = np.array([4.0, 9.0, 2.0]), np.array([1.0, 4.0, 8.0])
    np.testing.assert_allclose(smoothing_scales(a, w), [2.0, 1.5, 0.5], rtol=1e-12)


@pytest.mark.parametrize("alpha", [-0.01, 1.01])
def test_alpha_outside_zero_to_one_is_refused(alpha):
    with pytest.raises(ValueError) as err:
        smoothing_scales(np.ones(2), np.ones(2), alpha=alpha)
    assert str(err.value) == f"SmoothQuant alpha must lie in [0, 1], got {alpha}"


@pytest.mark.parametrize("alpha", [0.5, 1.0, 0.0])
def test_a_channel_with_a_zero_side_keeps_scale_one(alpha):
    # A channel that never fires (max|X| = 0) or an all-zero weight row (max|W| = 0) would
    # give s = 0 or s = inf: it takes s = 1 (no fold) at every α; the live channel does not.
    s = smoothing_scales(np.array([0.0, 3.0, 5.0]), np.array([2.0, 0.0, 4.0]), alpha)
    np.testing.assert_array_equal(s[:2], [1.0, 1.0])
    assert s[2] == pytest.approx(5.0**alpha / 4.0 ** (1 - alpha), rel=1e-12)


def test_float32_statistics_give_float64_scales_without_warnings():
    # The calibration statistics are float32; the scales are computed in float64 (bound
    # 1e-12 relative to eq. 4 in float64: float32 arithmetic is off by ~1e-7). A channel
    # with a zero side raises no divide-by-zero warning (warnings are errors here).
    rng = np.random.default_rng(6)
    a = np.exp(rng.uniform(-3, 3, 16)).astype(np.float32)
    w = np.exp(rng.uniform(-3, 3, 16)).astype(np.float32)
    w[3], a[7] = 0.0, 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = smoothing_scales(a, w, 0.37)
    assert s.dtype == np.float64
    want = paper_scales(a.astype(np.float64), w.astype(np.float64), 0.37)
    want[[3, 7]] = 1.0
    np.testing.assert_allclose(s, want, rtol=1e-12)


def test_scales_are_clipped_to_the_guard_range():
    # 1e12^0.5 = 1e6 -> 1e5; 1e-12^0.5 = 1e-6 -> 1e-5; 4e4 lies inside and is kept.
    s = smoothing_scales(np.array([1e12, 1e-12, 1.6e9]), np.array([1.0, 1.0, 1.0]), 0.5)
    np.testing.assert_array_equal(s, [1e5, 1e-5, 4e4])


def test_a_sites_scale_shares_act_and_weight_maxima_within_each_kv_group():
    # o_proj's input (4 query heads over 2 KV heads, head_dim 8): s must be one per
    # (KV group, dim), so both maxima are taken over the group's heads first, then eq. 4.
    config = tiny_config()
    params, site = _params(config), fold_sites(config)["layers/0/attn/o_in"]
    stats = _stats(config, params)
    act = stats.sites[site.site].absmax.astype(np.float64).reshape(2, 2, 8).max(axis=1)
    w = np.abs(params["layers/0/attn/o_proj"]).max(axis=1).reshape(2, 2, 8).max(axis=1)
    want = np.repeat(paper_scales(act.ravel(), w.ravel(), 0.3).reshape(2, 1, 8), 2, axis=1)
    got = site_scales(params, config, site, stats, alpha=0.3)
    np.testing.assert_allclose(got, want.ravel(), rtol=1e-6)


def test_a_sites_weight_maximum_is_over_every_linear_reading_it():
    # q, k and v read one input: max|W_j| is over all three's rows j.
    config = tiny_config()
    params, site = _params(config), fold_sites(config)["layers/1/attn/in"]
    stats = _stats(config, params)
    w = np.max([np.abs(params[p]).max(axis=1) for p in site.consumers], axis=0)
    want = paper_scales(stats.sites[site.site].absmax.astype(np.float64), w, 0.5)
    np.testing.assert_allclose(site_scales(params, config, site, stats), want, rtol=1e-6)


def test_smooth_folds_every_site_by_default_with_the_given_alpha():
    config = tiny_config()
    params = _params(config)
    stats = _stats(config, params)
    smoothed, scales = smooth(params, config, stats, alpha=0.7)
    assert list(scales) == list(fold_sites(config))  # 4 per layer and the LM head's input
    want = params
    for name, site in fold_sites(config).items():
        np.testing.assert_allclose(scales[name], site_scales(want, config, site, stats, 0.7))
        want = fold(want, config, site, scales[name])
    assert set(smoothed) == set(params)
    for p in params:
        np.testing.assert_array_equal(np.asarray(smoothed[p]), np.asarray(want[p]), err_msg=p)
    assert not np.array_equal(smoothed["final_norm"], params["final_norm"])
    _, default = smooth(params, config, stats)  # α = 0.5 unless told
    site = fold_sites(config)["head/in"]
    np.testing.assert_allclose(default["head/in"], site_scales(params, config, site, stats, 0.5))


def test_each_sites_scale_is_taken_from_the_weights_as_already_smoothed():
    # o_in first divides v_proj's columns; attn/in then reads v_proj's rows as they are now
    # (max|W| of the folded v), as the fold of o_in left them, not the original params.
    config = tiny_config()
    params = _params(config)
    stats = _stats(config, params)
    order = ["layers/0/attn/o_in", "layers/0/attn/in"]
    smoothed, scales = smooth(params, config, stats, sites=order)
    assert list(scales) == order
    sites = fold_sites(config)
    after_o = fold(params, config, sites[order[0]], scales[order[0]])
    want = site_scales(after_o, config, sites[order[1]], stats)
    np.testing.assert_allclose(scales[order[1]], want, rtol=1e-6)
    assert not np.allclose(want, site_scales(params, config, sites[order[1]], stats), rtol=1e-3)
    untouched = [p for p in params if np.array_equal(smoothed[p], params[p])]
    assert "layers/0/mlp/up_proj" in untouched and "final_norm" in untouched


def test_smoothing_an_unknown_site_names_it():
    config = tiny_config()
    params = _params(config)
    with pytest.raises(ValueError) as err:
        smooth(params, config, _stats(config, params), sites=["layers/0/attn/in", "layers/9/x"])
    assert str(err.value) == "cannot smooth ['layers/9/x']: not foldable sites of this model"


@pytest.mark.parametrize(("axis", "group", "symmetric"), [(0, 8, False), (1, None, True)])
def test_a_smoothed_weight_is_rounded_to_nearest_as_its_rule_says(axis, group, symmetric):
    w = np.random.default_rng(4).standard_normal((16, 8)).astype(np.float32)
    how = TensorQuant("layers/0/mlp/up_proj", "int4", axis, group, symmetric, "smoothquant", None)
    got = smoothquant_weight(w, how, smoothed=True)
    want = quantize(w, "int4", axis=axis, group_size=group, symmetric=symmetric)
    assert (got.axis, got.group_size, got.fmt) == (want.axis, want.group_size, "int4")
    assert (got.zero_point is None) == symmetric
    np.testing.assert_array_equal(np.asarray(dequantize(got)), np.asarray(dequantize(want)))


def test_an_unsmoothed_weight_is_refused_naming_the_tensor_and_what_to_run():
    how = TensorQuant("layers/0/mlp/up_proj", "int8", 0, None, True, "smoothquant", None)
    with pytest.raises(ValueError) as err:
        smoothquant_weight(np.ones((4, 4), np.float32), how)
    assert str(err.value) == (
        "layers/0/mlp/up_proj: algorithm 'smoothquant' needs the model smoothed first; run "
        "tenantq.quant.site_inputs.site_inputs(params, plan, config, stats) and pass its inputs to "
        "apply_plan"
    )
