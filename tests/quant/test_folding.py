"""Folding a per-input-channel scale into a linear and its producer keeps the layer's function.

Each site kind is checked on the computation it belongs to, written out in numpy (an RMSNorm's
gain, grouped-query attention's value mix into o_proj, SwiGLU's up branch into down_proj),
before and after `fold`: float32 rounding only (1e-5 relative). Tiny config, numpy params.
"""

from __future__ import annotations

import numpy as np
import pytest

from tenantq.quant.folding import (
    FoldSite,
    fold,
    fold_sites,
    folded_stats,
    share_within_groups,
    site_of,
    source_column_scale,
    weight_row_absmax,
)
from tenantq.quant.input_stats import InputStats
from tenantq.testing import tiny_config

RTOL = 1e-5  # float32 rounding of (w * s) and (b / s)


def _params(config, seed=0):
    rng = np.random.default_rng(seed)
    return {
        p: (rng.standard_normal(info.shape) * 0.5 + (info.kind == "norm")).astype(np.float32)
        for p, info in config.tensors().items()
    }


def _scale(n, seed=5, shared=None):
    s = np.exp(np.random.default_rng(seed).uniform(-1.5, 1.5, n))
    return s if shared is None else share_within_groups(*shared, s)


def test_every_layer_has_four_foldable_sites_and_an_untied_head_a_fifth():
    config = tiny_config()
    sites = fold_sites(config)
    p = "layers/1"
    assert sites[f"{p}/attn/in"] == FoldSite(
        f"{p}/attn/in", (f"{p}/attn/q_proj", f"{p}/attn/k_proj", f"{p}/attn/v_proj"),
        f"{p}/input_norm", "norm",
    )  # fmt: skip
    assert sites[f"{p}/attn/o_in"] == FoldSite(
        f"{p}/attn/o_in", (f"{p}/attn/o_proj",), f"{p}/attn/v_proj", "value_heads"
    )
    assert sites[f"{p}/mlp/in"] == FoldSite(
        f"{p}/mlp/in", (f"{p}/mlp/gate_proj", f"{p}/mlp/up_proj"), f"{p}/post_attn_norm", "norm"
    )
    assert sites[f"{p}/mlp/down_in"] == FoldSite(
        f"{p}/mlp/down_in", (f"{p}/mlp/down_proj",), f"{p}/mlp/up_proj", "columns"
    )
    assert sites["head/in"] == FoldSite("head/in", ("lm_head",), "final_norm", "norm")
    assert len(sites) == 4 * config.num_layers + 1
    # A tied head shares its weight with the embedding: scaling it would scale the embedding.
    tied = fold_sites(tiny_config(tie_word_embeddings=True))
    assert "head/in" not in tied and len(tied) == 4 * config.num_layers


def test_site_of_finds_the_site_reading_a_linear():
    config = tiny_config()
    assert site_of(config, "layers/1/mlp/up_proj").site == "layers/1/mlp/in"
    assert site_of(config, "layers/0/attn/o_proj").site == "layers/0/attn/o_in"
    assert site_of(config, "lm_head").site == "head/in"
    assert site_of(config, "embed") is None


def test_o_proj_channels_share_the_maximum_of_their_kv_group():
    # 4 query heads over 2 KV heads of dim 8: channel (h, j) takes max over the heads of
    # KV group h // 2, dim j. Other sites are returned unchanged.
    config = tiny_config()
    sites = fold_sites(config)
    x = np.arange(32, dtype=np.float64)[::-1].copy()  # head 0 > head 1 in group 0, etc.
    got = share_within_groups(config, sites["layers/0/attn/o_in"], x)
    want = np.concatenate([x[0:8], x[0:8], x[16:24], x[16:24]])
    np.testing.assert_array_equal(got, want)
    y = np.arange(32, dtype=np.float64)  # now the second head of each group is larger
    want = np.concatenate([y[8:16], y[8:16], y[24:32], y[24:32]])
    np.testing.assert_array_equal(share_within_groups(config, sites["layers/0/attn/o_in"], y), want)
    np.testing.assert_array_equal(share_within_groups(config, sites["layers/0/attn/in"], x), x)


def test_weight_row_maximum_is_over_every_consumer():
    config = tiny_config()
    params = _params(config)
    site = fold_sites(config)["layers/0/attn/in"]
    want = np.abs(np.concatenate([params[p] for p in site.consumers], axis=1)).max(axis=1)
    np.testing.assert_array_equal(weight_row_absmax(params, site), want)


def test_weight_row_maxima_of_bf16_weights_come_back_as_float32():
    import ml_dtypes

    config = tiny_config()
    params = {p: v.astype(ml_dtypes.bfloat16) for p, v in _params(config).items()}
    site = fold_sites(config)["layers/0/mlp/in"]
    got = weight_row_absmax(params, site)
    want = np.max([np.abs(params[p].astype(np.float32)).max(axis=1) for p in site.consumers], 0)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)


def _rms(x):
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + 1e-6)


@pytest.mark.parametrize("site_name", ["layers/0/attn/in", "layers/1/mlp/in", "head/in"])
def test_a_norm_fold_keeps_every_consumers_output(site_name):
    # y = (rms(x) * g) @ W = (rms(x) * g / s) @ (diag(s) W).
    config = tiny_config()
    params, site = _params(config), fold_sites(config)[site_name]
    s = _scale(config.hidden_size)
    folded = fold(params, config, site, s)
    x = _rms(np.random.default_rng(1).standard_normal((6, config.hidden_size)))
    for path in site.consumers:
        before = (x * params[site.source]) @ params[path]
        after = (x * folded[site.source]) @ folded[path]
        np.testing.assert_allclose(after, before, rtol=RTOL, atol=RTOL * np.abs(before).max())
        np.testing.assert_allclose(folded[path], params[path] * s[:, None], rtol=RTOL)
    np.testing.assert_allclose(folded[site.source], params[site.source] / s, rtol=RTOL)
    changed = {p for p in params if not np.array_equal(folded[p], params[p])}
    assert changed == {site.source, *site.consumers}
    assert all(folded[p].dtype == np.float32 for p in changed)


def _attention_out(config, params, x, mix):
    """o_proj's output under GQA: query head h mixes the values of KV head h // group."""
    v = x @ params["layers/0/attn/v_proj"] + params.get("layers/0/attn/v_bias", 0.0)
    d, group = config.head_dim, config.num_heads // config.num_kv_heads
    heads = [
        mix[h] @ v[:, (h // group) * d : (h // group + 1) * d] for h in range(config.num_heads)
    ]
    return np.concatenate(heads, axis=1) @ params["layers/0/attn/o_proj"]


@pytest.mark.parametrize("bias", [False, True])
def test_an_o_proj_fold_moves_into_the_value_heads_of_its_kv_group(bias):
    config = tiny_config(attention_bias=bias)
    params, site = _params(config), fold_sites(config)["layers/0/attn/o_in"]
    s = _scale(config.num_heads * config.head_dim, shared=(config, site))
    folded = fold(params, config, site, s)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, config.hidden_size))
    mix = rng.dirichlet(np.ones(5), size=(config.num_heads, 5))  # rows: convex weights
    before = _attention_out(config, params, x, mix)
    after = _attention_out(config, folded, x, mix)
    np.testing.assert_allclose(after, before, rtol=RTOL, atol=RTOL * np.abs(before).max())
    kv = s.reshape(2, 2, 8)[:, 0, :].ravel()
    np.testing.assert_allclose(folded[site.source], params[site.source] / kv, rtol=RTOL)
    assert folded[site.source].dtype == folded["layers/0/attn/o_proj"].dtype == np.float32
    if bias:
        np.testing.assert_allclose(
            folded["layers/0/attn/v_bias"], params["layers/0/attn/v_bias"] / kv, rtol=RTOL
        )
        assert folded["layers/0/attn/v_bias"].dtype == np.float32
        assert np.array_equal(folded["layers/0/attn/k_bias"], params["layers/0/attn/k_bias"])


def test_a_down_proj_fold_moves_into_up_projs_columns():
    # y = (silu(x Wg) * (x Wu)) Wd: linear in the up branch, so its columns take 1 / s.
    config = tiny_config()
    params, site = _params(config), fold_sites(config)["layers/0/mlp/down_in"]
    s = _scale(config.intermediate_size)
    folded = fold(params, config, site, s)
    x = np.random.default_rng(3).standard_normal((5, config.hidden_size))

    def mlp(p):
        g = x @ p["layers/0/mlp/gate_proj"]
        return (g / (1 + np.exp(-g)) * (x @ p["layers/0/mlp/up_proj"])) @ p[
            "layers/0/mlp/down_proj"
        ]

    np.testing.assert_allclose(mlp(folded), mlp(params), rtol=RTOL, atol=RTOL * 10)
    np.testing.assert_allclose(
        folded["layers/0/mlp/up_proj"], params["layers/0/mlp/up_proj"] / s[None, :], rtol=RTOL
    )
    assert folded["layers/0/mlp/up_proj"].dtype == np.float32


@pytest.mark.parametrize(
    "bad",
    [np.ones(31), np.r_[np.ones(31), 0.0], np.r_[np.ones(31), -1.0], np.r_[np.ones(31), np.inf]],
)
def test_a_fold_scale_that_is_not_positive_finite_per_channel_is_refused(bad):
    config = tiny_config()
    site = fold_sites(config)["layers/0/attn/in"]
    with pytest.raises(ValueError) as err:
        fold(_params(config), config, site, bad)
    assert str(err.value) == (
        "layers/0/attn/in: a fold scale must be finite, > 0, one per input channel"
    )


def test_value_head_scales_must_agree_within_a_kv_group():
    config = tiny_config()
    site = fold_sites(config)["layers/0/attn/o_in"]
    s = np.ones(32)
    s[9] = 1.01  # head 1 (KV group 0), dim 1 differs from head 0
    with pytest.raises(ValueError) as err:
        source_column_scale(config, site, s)
    assert str(err.value) == "layers/0/attn/o_in: scales differ within a KV group; share them first"
    s[9] = 1.0 + 5e-6  # 5e-6 apart: more than float32 noise (the bound is 1e-6 relative)
    with pytest.raises(ValueError, match="scales differ within a KV group"):
        source_column_scale(config, site, s)
    s[9] = 1.0 + 1e-7  # float32 noise within 1e-6 relative is one scale
    np.testing.assert_array_equal(
        source_column_scale(config, site, s), s.reshape(2, 2, 8)[:, 0].ravel()
    )
    other = fold_sites(config)["layers/0/mlp/down_in"]
    np.testing.assert_array_equal(source_column_scale(config, other, s), s)


def test_folded_statistics_are_those_of_x_over_s():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((40, 6)) * np.array([1, 5, 0.1, 2, 3, 8])
    s = np.exp(rng.uniform(-1, 1, 6))
    stats = InputStats(
        "site", ("a", "b"), 40, np.abs(x).max(0).astype(np.float32),
        np.quantile(np.abs(x), 0.9, axis=0).astype(np.float32),
        np.abs(x).mean(0).astype(np.float32), x.T @ x,
    )  # fmt: skip
    got = folded_stats(stats, s)
    xs = x / s
    assert (got.site, got.paths, got.tokens) == ("site", ("a", "b"), 40)
    np.testing.assert_allclose(got.absmax, np.abs(xs).max(0), rtol=1e-6)
    np.testing.assert_allclose(got.percentile, np.quantile(np.abs(xs), 0.9, axis=0), rtol=1e-6)
    np.testing.assert_allclose(got.mean_abs, np.abs(xs).mean(0), rtol=1e-6)
    np.testing.assert_allclose(got.gram, xs.T @ xs, rtol=1e-12)
    assert got.absmax.dtype == got.percentile.dtype == got.mean_abs.dtype == np.float32
    # A float32 scale (as a search returns it) still divides the Gram in float64: 1e-15.
    s32 = s.astype(np.float32)
    want = stats.gram / (s32.astype(np.float64)[:, None] * s32.astype(np.float64)[None, :])
    np.testing.assert_allclose(folded_stats(stats, s32).gram, want, rtol=1e-15)
