"""AWQ's searches against straightforward numpy searches written from the paper (Lin et al.
2024, section 3.2: s = mean|x|^α over a grid of α, each scored by the layer's output error;
then a per-group clipping search), scored here on explicit activations X instead of the Gram
matrix the library uses, with every candidate tried and the first best kept.

Rounding itself is the codec's (tested in tests/numerics); symmetric int4 is also written out
by hand (codes in [-7, 7], scale = amax / 7). Tiny shapes, no model: about a second in all.
"""

from __future__ import annotations

import numpy as np
import pytest

from tenantq.numerics import (
    compute_scale_zero_point,
    dequantize,
    quantize,
    quantize_with_scale_zero_point,
)
from tenantq.quant.awq import (
    CLIP_RATIOS,
    DEFAULT_GRID,
    awq_weight,
    clip_search,
    column_errors,
    exponent_search,
    output_error,
    search_scale,
)
from tenantq.quant.folding import FoldSite, fold, fold_sites
from tenantq.quant.input_stats import InputStats
from tenantq.testing import tiny_config


def _tq(fmt, group=None, symmetric=True, path="layers/0/mlp/up_proj", axis=0):
    from tenantq.quant.plan import TensorQuant

    return TensorQuant(path, fmt, axis, group, symmetric, "awq", None)


def _x(rng, tokens, n):
    # uneven channels (AWQ's salient ones) and correlated pairs (cross-channel Gram terms)
    x = rng.standard_normal((tokens, n)) * np.exp(rng.uniform(-1.5, 1.5, n))
    x[:, 1::2] += 0.5 * x[:, ::2]
    return x


def _deq(q):
    return np.asarray(dequantize(q), np.float64)


def _err(x, w, w_hat):
    """‖XW − XŴ‖², from the activations themselves."""
    return float(np.sum((x @ (np.asarray(w_hat, np.float64) - w)) ** 2))


def test_column_errors_are_taken_in_float64_whatever_dtype_they_are_given():
    # Float32 Δ and G: the same values in float64 give the same errors, bit for bit.
    rng = np.random.default_rng(19)
    x = _x(rng, 30, 6).astype(np.float32)
    delta, gram = rng.standard_normal((6, 3)).astype(np.float32), x.T @ x
    want = column_errors(delta.astype(np.float64), gram.astype(np.float64))
    np.testing.assert_array_equal(column_errors(delta, gram), want)


def test_output_and_column_errors_are_those_of_the_activations():
    rng = np.random.default_rng(0)
    x, w, w_hat = _x(rng, 30, 6), rng.standard_normal((6, 3)), rng.standard_normal((6, 3))
    gram = x.T @ x
    assert output_error(w_hat, w, gram) == pytest.approx(_err(x, w, w_hat), rel=1e-9)
    want = np.sum((x @ (w_hat - w)) ** 2, axis=0)
    np.testing.assert_allclose(column_errors(w_hat - w, gram), want, rtol=1e-9)


def numpy_scale_search(x, weights, plans, grid, source=None, floor=1e-8):
    """The paper's grid search: s = m^α / sqrt(max · min), the α of least summed error."""
    m = np.maximum(np.abs(x).mean(axis=0), floor)
    best = None
    for k in range(grid):
        s = m ** (k / grid)
        s = s / np.sqrt(s.max() * s.min())
        s32 = s.astype(np.float32)
        err = 0.0
        for p, w in weights.items():
            how = plans[p]
            q = _deq(quantize(w * s32[:, None], how.format, axis=0, group_size=how.group_size,
                              symmetric=how.symmetric))  # fmt: skip
            err += _err(x, w, q / s32[:, None])  # (x / s) @ Q(diag(s) W)
        if source is not None:
            how, x_v, w_v = source
            q = _deq(quantize(w_v / s32[None, :], how.format, axis=0, group_size=how.group_size))
            err += _err(x_v, w_v, q * s32[None, :])
        if best is None or err < best[0]:
            best = (err, s, k / grid)
    return best[1], best[2]


def _site_stats(x, paths=("a", "b")):
    return InputStats(
        "site", paths, len(x), np.abs(x).max(0), np.abs(x).max(0), np.abs(x).mean(0), x.T @ x
    )


@pytest.mark.parametrize(("fmt", "group"), [("int4", 8), ("int8", None)])
def test_the_scale_search_picks_the_papers_alpha(fmt, group):
    # Two consumers of one norm, both quantized; grid of 7 α values.
    rng = np.random.default_rng(1)
    x = _x(rng, 64, 16)
    x[:, 3] = 0.0  # a channel that never fires: m floored at 1e-8, so s stays finite
    weights = {p: rng.standard_normal((16, 12)).astype(np.float32) for p in ("a", "b")}
    plans = {p: _tq(fmt, group) for p in weights}
    site = FoldSite("site", ("a", "b"), "norm", "norm")
    s, alpha = search_scale(weights, None, site, _site_stats(x), plans, grid=7, clip=False)
    want_s, want_alpha = numpy_scale_search(x, weights, plans, 7)
    assert alpha == want_alpha and alpha > 0  # seeded: the search moves off s = 1
    np.testing.assert_allclose(s, want_s, rtol=1e-9)


def test_a_consumer_left_in_bf16_is_not_scored():
    rng = np.random.default_rng(2)
    x = _x(rng, 64, 16)
    weights = {p: rng.standard_normal((16, 12)).astype(np.float32) for p in ("a", "b")}
    weights["b"][5] *= 40  # would dominate the score if it were counted
    plans = {"a": _tq("int4", 8)}
    site = FoldSite("site", ("a", "b"), "norm", "norm")
    s, alpha = search_scale(weights, None, site, _site_stats(x), plans, grid=8, clip=False)
    want_s, want_alpha = numpy_scale_search(x, {"a": weights["a"]}, plans, 8)
    assert alpha == want_alpha
    np.testing.assert_allclose(s, want_s, rtol=1e-9)


def test_a_site_with_nothing_quantized_keeps_scale_one():
    # Every α scores 0: the first grid point (α = 0, s = 1) is kept, no rescaling for nothing.
    rng = np.random.default_rng(3)
    x = _x(rng, 32, 8)
    weights = {"a": rng.standard_normal((8, 4)).astype(np.float32)}
    site = FoldSite("site", ("a",), "norm", "norm")
    s, alpha = search_scale(weights, None, site, _site_stats(x, ("a",)), {}, grid=5)
    assert alpha == 0.0
    np.testing.assert_array_equal(s, np.ones(8))


def test_a_quantized_producer_is_scored_on_its_own_input():
    # down_proj reads x / s; up_proj (the producer, its columns divided by s) is quantized too
    # and scored on ITS input x_v: the reference sums both terms.
    rng = np.random.default_rng(4)
    # The producer is MX: its E8M0 block scales are powers of two, so a column divided by a
    # non-power-of-two s rounds differently (at int formats its scale would just follow s).
    x, x_v = _x(rng, 64, 16), _x(rng, 64, 32)
    params = {
        "down": rng.standard_normal((16, 8)).astype(np.float32),
        "up": (rng.standard_normal((32, 16)) * 3).astype(np.float32),
    }
    how_d, how_u = _tq("int4", 8, path="down"), _tq("mxfp4", path="up")
    site = FoldSite("site", ("down",), "up", "columns")
    s, alpha = search_scale(
        params, None, site, _site_stats(x, ("down",)), {"down": how_d}, grid=10, clip=False,
        source=(how_u, x_v.T @ x_v),
    )  # fmt: skip
    want_s, want_alpha = numpy_scale_search(
        x, {"down": params["down"]}, {"down": how_d}, 10, source=(how_u, x_v, params["up"])
    )
    alone_s, alone_alpha = numpy_scale_search(x, {"down": params["down"]}, {"down": how_d}, 10)
    assert alpha == want_alpha and alpha != alone_alpha  # seeded: the producer's term matters
    np.testing.assert_allclose(s, want_s, rtol=1e-9)


def test_the_default_grid_is_twenty_alphas_from_zero():
    # The authors' grid: α in {0, 1/20, ..., 19/20}.
    assert DEFAULT_GRID == 20
    rng = np.random.default_rng(5)
    x = _x(rng, 64, 16)
    weights = {"a": rng.standard_normal((16, 8)).astype(np.float32)}
    plans = {"a": _tq("int4", 8)}
    site = FoldSite("site", ("a",), "norm", "norm")
    s, alpha = search_scale(weights, None, site, _site_stats(x, ("a",)), plans, clip=False)
    want_s, want_alpha = numpy_scale_search(x, weights, plans, 20)
    assert alpha == want_alpha
    np.testing.assert_allclose(s, want_s, rtol=1e-9)


def _round(w, how, gram, clip):
    """How `awq_weight` will round `w`: the exponent search at MX formats with clip (on the
    Gram of the tensor's own input), plain rounding otherwise."""
    if clip and how.format.startswith("mx"):
        return _deq(exponent_search(w, how, gram))
    kw = dict(axis=0, group_size=how.group_size, symmetric=how.symmetric)
    return _deq(quantize(w, how.format, **kw))


def numpy_folded_scale_search(
    x, params, site, plans, grid, source=None, float32_products=False, *, config=None,
    clip=False, kv_groups=None,
):  # fmt: skip
    """The paper's grid search scored on the tensors `folding.fold` stores for each α: the
    consumers' rows times s and the producer's columns divided by s, taken in float64 and
    rounded to float32, then rounded as `awq_weight` will (`_round`, on the Gram of x / s
    for a consumer, of x_v for the producer); the error is against the checkpoint's own
    values. `kv_groups` (kv heads, heads per kv head, head dim): o_proj's channels take
    their KV group's largest mean |x|, and v_proj's column (g, j) is divided by that s.
    `float32_products`: the float32 arithmetic fold does not do (float32(w) * float32(s))."""
    m = np.maximum(np.abs(x).mean(axis=0), 1e-8)
    if kv_groups is not None:
        m = np.broadcast_to(m.reshape(kv_groups).max(axis=1, keepdims=True), kv_groups).ravel()
    best = None
    for k in range(grid):
        s = m ** (k / grid)
        s = s / np.sqrt(s.max() * s.min())
        t = s if kv_groups is None else s.reshape(kv_groups)[:, 0, :].ravel()
        if float32_products:
            s32 = s.astype(np.float32)
            stored = {p: np.float32(params[p]) * s32[:, None] for p in site.consumers}
            if source is not None:
                stored[site.source] = np.float32(params[site.source]) / s32[None, :]
        else:
            stored = fold(params, config, site, s)
        err = 0.0
        for p, how in plans.items():
            q = _round(stored[p], how, (x / s).T @ (x / s), clip)
            err += _err(x, params[p], q / s[:, None])  # (x / s) @ Q(stored)
        if source is not None:
            how, x_v = source
            q = _round(stored[site.source], how, x_v.T @ x_v, clip)
            err += _err(x_v, params[site.source], q * t[None, :])  # (x_v @ Q(stored)) * t
        if best is None or err < best[0]:
            best = (err, s, k / grid)
    return best[1], best[2]


def _top_of_an_mx_block(near, stored, float32_stored):
    """Per channel, a float64 value within 2^-26 of `near` that fold stores as >= 4 (so an
    E2M1 block holding it takes the scale 2^0 and keeps 4 exactly) while float32 arithmetic
    would store it below 4 (scale 2^-1: it saturates at 3); nan where no candidate does."""
    out = np.full(near.shape, np.nan)
    for d in np.linspace(-(2.0**-26), 2.0**-26, 65):
        v = near * (1 + d)
        ok = np.isnan(out) & (stored(v) >= 4) & (float32_stored(v) < 4)
        out[ok] = v[ok]
    return out


def test_the_scale_search_scores_the_consumers_as_fold_stores_them():
    # A float64 checkpoint whose consumer, folded at α = 2/4, is exactly on the mxfp4 grid at
    # block scale 1, with 4 (the grid's top but one, amax) in many rows: fold stores those
    # as 4.0 (w * s in float64, then float32), so that α costs next to nothing; float32(w) *
    # float32(s) would put them a float32 ulp below 4, the blocks' scale one binade lower and
    # the 4s at 3. The search must score what fold stores.
    rng = np.random.default_rng(13)
    n, grid = 32, 4
    x = _x(rng, 64, n)
    m = np.abs(x).mean(axis=0)
    s = m**0.5 / np.sqrt(m.max() ** 0.5 * m.min() ** 0.5)  # α = 2/4
    s32 = s.astype(np.float32)
    top = _top_of_an_mx_block(
        4 / s, lambda v: np.float32(v * s), lambda v: np.float32(v) * s32
    )  # fmt: skip
    assert 3 <= np.sum(~np.isnan(top)) <= n - 3  # seeded: some rows, not all
    g = rng.choice([0.5, 1.0, 1.5, 2.0, 3.0], (n, 6)) / s[:, None]  # on the grid once folded
    w = np.where(np.isnan(top)[:, None], g, top[:, None]) * rng.choice([-1, 1], (n, 6))
    params = {"a": w, "norm": np.ones(n)}
    plans = {"a": _tq("mxfp4", path="a")}
    site = FoldSite("site", ("a",), "norm", "norm")
    got_s, got = search_scale(params, None, site, _site_stats(x, ("a",)), plans, grid=grid,
                              clip=False)  # fmt: skip
    want_s, want = numpy_folded_scale_search(x, params, site, plans, grid)
    _, float32_alpha = numpy_folded_scale_search(x, params, site, plans, grid, None, True)
    assert got == want == 0.5 and float32_alpha != want  # seeded: the arithmetic decides
    np.testing.assert_allclose(got_s, want_s, rtol=1e-12)


def test_the_scale_search_scores_a_quantized_producer_as_fold_stores_it():
    # The producer's side of the same: up_proj's columns divided by s (float64, then float32)
    # land on 4 exactly at α = 2/4 in the columns `_top_of_an_mx_block` found; the consumer
    # is int8 on plain float64 weights.
    rng = np.random.default_rng(14)
    n, n_v, grid = 16, 32, 4
    x, x_v = _x(rng, 64, n), _x(rng, 64, n_v)
    m = np.abs(x).mean(axis=0)
    s = m**0.5 / np.sqrt(m.max() ** 0.5 * m.min() ** 0.5)
    s32 = s.astype(np.float32)
    top = _top_of_an_mx_block(
        4 * s, lambda v: np.float32(v / s), lambda v: np.float32(v) / s32
    )  # fmt: skip
    assert 3 <= np.sum(~np.isnan(top)) <= n - 3  # seeded: some columns, not all
    g = rng.choice([0.5, 1.0, 1.5, 2.0, 3.0], (n_v, n)) * s[None, :]
    up = np.where(np.isnan(top)[None, :], g, top[None, :]) * rng.choice([-1, 1], (n_v, n))
    params = {"down": rng.standard_normal((n, 8)), "up": up}
    plans = {"down": _tq("int8", path="down")}
    site = FoldSite("site", ("down",), "up", "columns")
    how_u = _tq("mxfp4", path="up")
    got_s, got = search_scale(
        params, None, site, _site_stats(x, ("down",)), plans, grid=grid, clip=False,
        source=(how_u, x_v.T @ x_v),
    )  # fmt: skip
    want_s, want = numpy_folded_scale_search(x, params, site, plans, grid, (how_u, x_v))
    _, float32_alpha = numpy_folded_scale_search(x, params, site, plans, grid, (how_u, x_v), True)
    assert got == want == 0.5 and float32_alpha != want  # seeded: the arithmetic decides
    np.testing.assert_allclose(got_s, want_s, rtol=1e-12)


def test_at_mx_formats_the_scale_search_scores_the_exponent_search():
    # With clip (the default, as for awq_weight) at an MX format each candidate is scored as
    # awq_weight will round it: the exponent search on the Gram of x / s; without clip, by
    # plain rounding. Seeded so the two scorings choose different α, and the Gram of x * s
    # yet another.
    rng = np.random.default_rng(5)
    x = _x(rng, 64, 64)
    weights = {"a": (rng.standard_normal((64, 8)) * 5).astype(np.float32)}
    params = {**weights, "norm": np.ones(64, np.float32)}
    plans, stats = {"a": _tq("mxfp4")}, _site_stats(x, ("a",))
    site = FoldSite("site", ("a",), "norm", "norm")
    want_s, want = numpy_folded_scale_search(x, params, site, plans, 6, clip=True)
    s, alpha = search_scale(weights, None, site, stats, plans, grid=6, clip=True)
    assert alpha == want
    np.testing.assert_allclose(s, want_s, rtol=1e-12)
    assert search_scale(weights, None, site, stats, plans, grid=6)[1] == want  # clip's default
    _, plain_alpha = search_scale(weights, None, site, stats, plans, grid=6, clip=False)
    assert plain_alpha == numpy_folded_scale_search(x, params, site, plans, 6)[1] != want


def test_an_asymmetric_consumer_is_scored_with_its_zero_point():
    # Weights centred off zero: asymmetric int4 (amin and amax, a zero point) rounds them
    # differently from symmetric int4, and the search must score the plan's own rounding.
    rng = np.random.default_rng(0)
    x = _x(rng, 64, 16)
    weights = {"a": (rng.standard_normal((16, 12)) + 0.8).astype(np.float32)}
    params = {**weights, "norm": np.ones(16, np.float32)}
    plans = {"a": _tq("int4", 8, symmetric=False)}
    site = FoldSite("site", ("a",), "norm", "norm")
    s, alpha = search_scale(weights, None, site, _site_stats(x, ("a",)), plans, grid=8, clip=False)
    want_s, want = numpy_folded_scale_search(x, params, site, plans, 8)
    _, symmetric = numpy_folded_scale_search(x, params, site, {"a": _tq("int4", 8)}, 8)
    assert alpha == want != symmetric  # seeded: the zero point changes the choice
    np.testing.assert_allclose(s, want_s, rtol=1e-12)


def test_an_mx_producer_is_scored_by_its_exponent_search_on_its_own_gram():
    # With clip, the producer (mxfp4 up_proj) is scored as awq_weight will round it: the
    # exponent search on the Gram of its own input x_v; both terms count. Seeded so that
    # plain rounding of the producer, or the producer's term alone, would choose another α.
    rng = np.random.default_rng(8)
    x, x_v = _x(rng, 64, 16), _x(rng, 64, 32)
    params = {
        "down": (rng.standard_normal((16, 8)) * 4).astype(np.float32),
        "up": rng.standard_normal((32, 16)).astype(np.float32),
    }
    how_d, how_u = _tq("int4", 8, path="down"), _tq("mxfp4", path="up")
    site = FoldSite("site", ("down",), "up", "columns")
    s, alpha = search_scale(
        params, None, site, _site_stats(x, ("down",)), {"down": how_d}, grid=10, clip=True,
        source=(how_u, x_v.T @ x_v),
    )  # fmt: skip
    want_s, want = numpy_folded_scale_search(
        x, params, site, {"down": how_d}, 10, (how_u, x_v), clip=True
    )
    _, rounded = numpy_folded_scale_search(x, params, site, {"down": how_d}, 10, (how_u, x_v))
    _, alone = numpy_folded_scale_search(x, params, site, {}, 10, (how_u, x_v), clip=True)
    assert alpha == want and rounded != want and alone != want
    np.testing.assert_allclose(s, want_s, rtol=1e-12)


def test_o_proj_is_scored_with_scales_shared_within_kv_groups():
    # GQA (4 query heads over 2 KV heads of dim 8): o_proj's channel (h, j) takes the largest
    # mean |x| of its KV group's heads, and v_proj's column (g, j) is divided by that one s.
    config = tiny_config()
    site = fold_sites(config)["layers/0/attn/o_in"]
    rng = np.random.default_rng(15)
    x, x_v = _x(rng, 64, 32), _x(rng, 64, 32)
    params = {
        "layers/0/attn/o_proj": rng.standard_normal((32, 32)).astype(np.float32),
        "layers/0/attn/v_proj": (rng.standard_normal((32, 16)) * 2).astype(np.float32),
    }
    plans = {"layers/0/attn/o_proj": _tq("int4", 8, path="layers/0/attn/o_proj")}
    how_v = _tq("mxfp4", path="layers/0/attn/v_proj")
    stats = _site_stats(x, site.consumers)
    s, alpha = search_scale(params, config, site, stats, plans, grid=8, clip=False,
                            source=(how_v, x_v.T @ x_v))  # fmt: skip
    want_s, want = numpy_folded_scale_search(
        x, params, site, plans, 8, (how_v, x_v), config=config, kv_groups=(2, 2, 8)
    )
    assert alpha == want > 0  # seeded: the search moves off s = 1
    np.testing.assert_allclose(s, want_s, rtol=1e-12)
    np.testing.assert_array_equal(s.reshape(2, 2, 8)[:, 0], s.reshape(2, 2, 8)[:, 1])


def test_when_no_alpha_scores_a_finite_error_the_scale_stays_one():
    # A Gram with an inf entry (activations overflowing float64): every error is inf or NaN,
    # none is below the starting inf, and the search keeps α = 0, s = 1 (nothing folded).
    rng = np.random.default_rng(16)
    x = _x(rng, 32, 8)
    stats = _site_stats(x, ("a",))
    stats.gram[2, 2] = np.inf
    weights = {"a": rng.standard_normal((8, 4)).astype(np.float32)}
    site = FoldSite("site", ("a",), "norm", "norm")
    with np.errstate(invalid="ignore"):  # inf * 0 in G Δ: NaN, as it should be
        s, alpha = search_scale(weights, None, site, stats, {"a": _tq("int4", 8)}, grid=5,
                                clip=False)  # fmt: skip
    assert alpha == 0.0 and s.shape == (8,)  # one scale per channel, as fold requires
    np.testing.assert_array_equal(s, np.ones(8))


def _int4_by_hand(w, amax):
    """Symmetric int4 of w [n, out] given the scale's amax (broadcastable): codes in ±7."""
    scale = amax / 7.0
    return np.clip(np.round(w / scale), -7, 7) * scale


# 20: the last group of 8 holds 4 rows (seed 8: some of them clip)
@pytest.mark.parametrize(("n", "seed"), [(24, 7), (20, 7), (20, 8)])
def test_the_clip_search_picks_each_groups_best_ratio_int4_by_hand(n, seed):
    rng = np.random.default_rng(seed)
    x = _x(rng, 128, n)
    w = rng.standard_normal((n, 6)).astype(np.float32)
    w[2] *= 6  # outliers make shrinking the range worth it in some groups
    w[n - 1] *= 5
    got = _deq(clip_search(w, _tq("int4", 8), x.T @ x))
    want = np.zeros((n, 6))
    chosen = []
    for start in range(0, n, 8):
        rows = slice(start, min(start + 8, n))
        wg, xg = w[rows].astype(np.float64), x[:, rows]
        for c in range(6):
            amax = np.abs(wg[:, c]).max()
            errors = [
                np.sum((xg @ (_int4_by_hand(wg[:, c], amax * r) - wg[:, c])) ** 2)
                for r in CLIP_RATIOS
            ]
            best = int(np.argmin(errors))  # the first of equal errors: the larger range
            chosen.append(CLIP_RATIOS[best])
            want[rows, c] = _int4_by_hand(wg[:, c], amax * CLIP_RATIOS[best])
    assert min(chosen) < 1.0  # seeded: some groups clip
    if seed == 8:  # and so do columns of the partial last group
        assert min(chosen[-6:]) < 1.0
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_group_whose_inputs_never_fire_keeps_its_full_range():
    # Channels 8-15 are always 0: their Gram block is 0 and every ratio scores 0 there; the
    # first (ratio 1, no clipping) is kept, so that group rounds as plain RTN does.
    rng = np.random.default_rng(21)
    x = _x(rng, 128, 24)
    x[:, 8:16] = 0.0
    w = rng.standard_normal((24, 5)).astype(np.float32)
    w[10] *= 6  # an outlier that clipping would cut, were there any evidence for it
    got = _deq(clip_search(w, _tq("int4", 8), x.T @ x))
    plain = _deq(quantize(w, "int4", axis=0, group_size=8))
    np.testing.assert_array_equal(got[8:16], plain[8:16])


@pytest.mark.parametrize("search", [clip_search, exponent_search])
@pytest.mark.parametrize("shape", [(32, 16), (16, 16), (32,), (32, 32, 1)])
def test_a_gram_not_of_the_weights_input_rows_is_refused(search, shape):
    w = np.ones((32, 2), np.float32)
    with pytest.raises(ValueError) as err:
        search(w, _tq("mxfp4" if search is exponent_search else "int4", 8), np.ones(shape))
    assert str(err.value) == (
        "layers/0/mlp/up_proj: the Gram of a weight with 32 input rows must be [32, 32], "
        f"got {list(shape)}"
    )


def test_the_clip_ratios_run_from_one_down_to_a_half_in_steps_of_one_fortieth():
    assert len(CLIP_RATIOS) == 21 and CLIP_RATIOS[0] == 1.0 and CLIP_RATIOS[-1] == 0.5
    np.testing.assert_allclose(CLIP_RATIOS, np.linspace(1.0, 0.5, 21), rtol=1e-12)


def _by_candidates(w, x, group, candidates):
    """Per (group, column), the candidate with the least error on the group's own inputs."""
    n, out = w.shape
    want = np.zeros((n, out))
    for start in range(0, n, group):
        rows = slice(start, min(start + group, n))
        for c in range(out):
            errors = [np.sum((x[:, rows] @ (q[rows, c] - w[rows, c])) ** 2) for q in candidates]
            want[rows, c] = candidates[int(np.argmin(errors))][rows, c]
    return want


@pytest.mark.parametrize("dtype", [np.int32, np.float16, np.float64, "bfloat16"])
@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
def test_the_clip_search_reads_any_real_weight_as_float32(dtype, fmt):
    rng = np.random.default_rng(20)
    x = _x(rng, 128, 32)
    w = np.round(rng.standard_normal((32, 4)) * 6).astype(dtype)
    how = _tq(fmt, 8 if fmt == "int4" else None)
    got, want = clip_search(w, how, x.T @ x), clip_search(w.astype(np.float32), how, x.T @ x)
    np.testing.assert_array_equal(_deq(got), _deq(want))


def test_an_asymmetric_clip_shrinks_both_ends_of_the_range():
    rng = np.random.default_rng(8)
    x = _x(rng, 128, 16)
    w = (rng.standard_normal((16, 5)) + 0.7).astype(np.float32)
    w[4] *= 6
    kw = dict(axis=0, group_size=8, symmetric=False)
    amax = w.reshape(2, 8, 5).max(axis=1)
    amin = w.reshape(2, 8, 5).min(axis=1)
    candidates = []
    for r in CLIP_RATIOS:
        scale, zp = compute_scale_zero_point(w, "int4", amax=amax * r, amin=amin * r, **kw)
        candidates.append(_deq(quantize_with_scale_zero_point(w, "int4", scale, zp, axis=0,
                                                              group_size=8)))  # fmt: skip
    got = clip_search(w, _tq("int4", 8, symmetric=False), x.T @ x)
    assert got.zero_point is not None
    np.testing.assert_allclose(_deq(got), _by_candidates(w, x, 8, candidates), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", [9, 0])
def test_nvfp4_clipping_keeps_the_unclipped_tensor_scale(seed):
    # nvfp4's second-level (tensor) scale comes from the whole unclipped weight, for every
    # candidate and for the result; only the FP8 block scales shrink. (Seed 0: a candidate
    # scored with its own clipped tensor scale would choose other ratios.)
    rng = np.random.default_rng(seed)
    x = _x(rng, 128, 32)
    w = rng.standard_normal((32, 4)).astype(np.float32)
    w[7] *= 8
    kw = dict(axis=0, group_size=None, symmetric=True)
    tensor = compute_scale_zero_point(w, "nvfp4", **kw)[0].tensor
    amax = np.abs(w).reshape(2, 16, 4).max(axis=1)
    candidates = []
    for r in CLIP_RATIOS:
        scale, zp = compute_scale_zero_point(w, "nvfp4", amax=amax * r, tensor_scale=tensor, **kw)
        candidates.append(_deq(quantize_with_scale_zero_point(w, "nvfp4", scale, zp, axis=0)))
    got = clip_search(w, _tq("nvfp4"), x.T @ x)
    np.testing.assert_array_equal(np.asarray(got.tensor_scale), np.asarray(tensor))
    np.testing.assert_allclose(_deq(got), _by_candidates(w, x, 16, candidates), rtol=1e-6)


def numpy_exponent_search(w, x, steps=(0, 1, -1), fmt="mxfp4"):
    """Per MX block and column, the E8M0 code among OCP's, one up, one down (in int32,
    clipped to E8M0's finite codes [0, 254]) with the least error on the block's inputs, the
    first of equal ones; kept per column only if the full error is not larger."""
    ocp = np.asarray(compute_scale_zero_point(w, fmt, axis=0)[0], np.int32)

    def rounded(codes):
        codes = np.clip(codes, 0, 254).astype(np.uint8)
        return codes, _deq(quantize_with_scale_zero_point(w, fmt, codes, None, axis=0))

    n, out = w.shape
    best = ocp.copy()
    shifted = [rounded(ocp + step)[1] for step in steps]  # blocks round independently
    for b in range(n // 32):
        rows = slice(b * 32, (b + 1) * 32)
        for c in range(out):
            errors = [np.sum((x[:, rows] @ (q[rows, c] - w[rows, c])) ** 2) for q in shifted]
            best[b, c] = ocp[b, c] + steps[int(np.argmin(errors))]
    codes, q = rounded(best)
    ocp_codes, ocp_q = rounded(ocp)
    keep = np.sum((x @ (q - w)) ** 2, axis=0) <= np.sum((x @ (ocp_q - w)) ** 2, axis=0)
    return np.where(keep[None, :], codes, ocp_codes), keep


def test_the_exponent_search_picks_each_blocks_best_code_and_keeps_only_winning_columns():
    rng = np.random.default_rng(10)
    x = _x(rng, 256, 64)
    w = rng.standard_normal((64, 8)).astype(np.float32)
    w[5] *= 12.0
    w[40] *= 7.0
    got = exponent_search(w, _tq("mxfp4"), x.T @ x)
    want_codes, keep = numpy_exponent_search(w.astype(np.float64), x)
    ocp = np.asarray(compute_scale_zero_point(w, "mxfp4", axis=0)[0])
    assert np.any(want_codes != ocp)  # seeded: some blocks move
    np.testing.assert_array_equal(np.asarray(got.scale), want_codes)
    assert got.fmt == "mxfp4" and got.axis == 0


def test_a_column_the_full_gram_says_got_worse_keeps_the_ocp_codes():
    # Two blocks whose inputs are strongly anti-correlated: each block alone prefers a code
    # the cross-block terms undo; the full-Gram check must fall back to OCP's for that column.
    rng = np.random.default_rng(11)
    z = rng.standard_normal((256, 32))
    x = np.concatenate([z, -z + 0.05 * rng.standard_normal((256, 32))], axis=1)
    w = np.tile(rng.uniform(4.6, 7.9, (32, 1)), (2, 6)).astype(np.float32)
    w[:, 1:] *= rng.uniform(0.5, 1.0, (1, 5)).astype(np.float32)
    got = exponent_search(w, _tq("mxfp4"), x.T @ x)
    want_codes, keep = numpy_exponent_search(w.astype(np.float64), x)
    np.testing.assert_array_equal(np.asarray(got.scale), want_codes)
    ocp = _deq(quantize(w, "mxfp4", axis=0))
    assert np.all(
        column_errors(_deq(got) - w, x.T @ x) <= column_errors(ocp - w, x.T @ x) * (1 + 1e-9)
    )


def test_the_exponent_search_on_hand_made_columns():
    # mxfp4, two blocks of 32 rows, every weight and Gram entry dyadic: each error below is
    # exact in float32 and float64. Every block holding a value has amax in [4, 8), so OCP's
    # code is 127 (scale 1, grid {0, .5, 1, 1.5, 2, 3, 4, 6}); one up is 128 (scale 2, top
    # 12), one down 126 (scale 1/2, top 3). 4.5 rounds to 4 at 127 and 128 (error -0.5;
    # -1.5 at 126); 7.5 to 6 at 127 (-1.5), 8 at 128 (+0.5), 3 at 126 (-4.5); 0.75 to 0.5
    # or 1 at 127 and to 1 at 128 (error 0.25 either way), exactly at 126.
    w = np.zeros((64, 3), np.float32)
    gram = np.eye(64)
    # Column 0: a = 4.5 (row 0, G 2) in block 0, b = 7.5 (row 32, G 1) in block 1, G[0, 32]
    # = -1. Block 1 alone prefers 128 (0.25 < 2.25); over the full Gram the two choices tie
    # (OCP: 2 * 0.25 + 2.25 + 2 * (-1) * (-0.5) * (-1.5) = 1.25; searched: 2 * 0.25 + 0.25 +
    # 2 * (-1) * (-0.5) * 0.5 = 1.25), and a tie keeps the search.
    w[0, 0], w[32, 0], gram[0, 0], gram[0, 32], gram[32, 0] = 4.5, 7.5, 2.0, -1.0, -1.0
    # Column 1: the same with G 4 on a and G[1, 33] = -1.5: OCP 1 + 2.25 - 2.25 = 1.0,
    # searched 1 + 0.25 + 0.75 = 2.0: the cross-block terms undo block 1's gain, OCP's kept.
    w[1, 1], w[33, 1], gram[1, 1], gram[1, 33], gram[33, 1] = 4.5, 7.5, 4.0, -1.5, -1.5
    # Column 2, block 0: 7.5 (row 2, G 1) and ten 0.75 (rows 3-12, G 32 each): OCP 2.25 +
    # 320 * 0.0625 = 22.25, one up 0.25 + 20 = 20.25, one down 20.25 + 0 = 20.25: up and
    # down tie below OCP, and the first tried (one up: nothing saturates) is kept. Block 1
    # is all zeros: OCP's code 0 (the smallest scale), which every candidate keeps.
    w[2, 2], w[3:13, 2] = 7.5, 0.75
    gram[3:13, 3:13] = 32 * np.eye(10)
    assert np.all(np.linalg.eigvalsh(gram) > 0)  # a Gram matrix: positive definite
    got = exponent_search(w, _tq("mxfp4"), gram)
    np.testing.assert_array_equal(np.asarray(got.scale), [[127, 127, 128], [128, 127, 0]])
    assert np.all(_deq(got)[32:, 2] == 0)


def test_a_block_at_the_smallest_e8m0_scale_is_not_searched_down_into_the_largest():
    # E8M0 code 0 (2^-127) is the bottom: one step down is clipped to 0 (codes computed in
    # int32), not wrapped round to 254 (2^127, where every element rounds to 0). Built so
    # that zeros would win if they were a candidate: mxfp8 weights with amax just below
    # 2^-118 (OCP's code 0), orthogonal to the direction v that dominates the Gram
    # 2^125 (v vᵀ + 2^-20 I): the rounding error has a component along v, the weight none.
    rng = np.random.default_rng(17)
    v = rng.choice([-1.0, -0.5, 0.5, 1.0], 32)
    w = rng.standard_normal(32)
    w -= v * (w @ v) / (v @ v)
    w = (w / np.abs(w).max() * 2.0**-118 * 0.97).astype(np.float32)[:, None]
    x = np.concatenate([2.0**62.5 * v[None, :], 2.0**52.5 * np.eye(32)])  # x.T @ x as above
    assert np.asarray(compute_scale_zero_point(w, "mxfp8", axis=0)[0]).item() == 0
    got = exponent_search(w, _tq("mxfp8"), x.T @ x)
    want_codes, keep = numpy_exponent_search(w.astype(np.float64), x, fmt="mxfp8")
    np.testing.assert_array_equal(np.asarray(got.scale), want_codes)
    assert want_codes.item() in (0, 1)


@pytest.mark.parametrize("dtype", [np.int32, np.float16, np.float64, "bfloat16"])
def test_the_exponent_search_reads_any_real_weight_as_float32(dtype):
    # An integer or narrower/wider float weight is searched as its float32 values.
    rng = np.random.default_rng(18)
    x = _x(rng, 128, 64)
    w = np.round(rng.standard_normal((64, 4)) * 6).astype(dtype)
    got = exponent_search(w, _tq("mxfp4"), x.T @ x)
    want = exponent_search(w.astype(np.float32), _tq("mxfp4"), x.T @ x)
    np.testing.assert_array_equal(np.asarray(got.scale), np.asarray(want.scale))
    np.testing.assert_array_equal(_deq(got), _deq(want))


def test_awq_weight_rounds_as_its_rule_says():
    rng = np.random.default_rng(12)
    x = _x(rng, 64, 32)
    w = rng.standard_normal((32, 4)).astype(np.float32)
    gram = x.T @ x
    how = _tq("int4", 8, symmetric=False)
    kw = dict(gram=gram, awq_scaled=True)
    np.testing.assert_array_equal(_deq(awq_weight(w, how, **kw)), _deq(clip_search(w, how, gram)))
    for symmetric in (False, True):
        plain = _tq("int4", 8, symmetric=symmetric)
        np.testing.assert_array_equal(
            _deq(awq_weight(w, plain, clip=False, **kw)),
            _deq(quantize(w, "int4", axis=0, group_size=8, symmetric=symmetric)),
        )
    mx = _tq("mxfp4")
    np.testing.assert_array_equal(
        np.asarray(awq_weight(w, mx, **kw).scale), np.asarray(exponent_search(w, mx, gram).scale)
    )


@pytest.mark.parametrize("missing", [{"awq_scaled": False}, {"gram": None}, {}])
def test_an_unfolded_awq_weight_is_refused_naming_what_to_run(missing):
    # {}: awq_scaled not given at all (a weight is unfolded unless the caller says so)
    kw = {"gram": np.eye(4), "awq_scaled": True, **missing} if missing else {"gram": np.eye(4)}
    with pytest.raises(ValueError) as err:
        awq_weight(np.ones((4, 2), np.float32), _tq("int8"), **kw)
    assert str(err.value) == (
        "layers/0/mlp/up_proj: algorithm 'awq' needs its input's scale searched and folded "
        "first; run tenantq.quant.site_inputs.site_inputs(params, plan, config, stats) and pass "
        "its inputs to apply_plan"
    )


def test_awq_refuses_a_weight_not_quantized_along_its_input():
    with pytest.raises(ValueError) as err:
        awq_weight(
            np.ones((4, 2), np.float32), _tq("int8", axis=1), gram=np.eye(4), awq_scaled=True
        )
    assert (
        str(err.value) == "layers/0/mlp/up_proj: AWQ applies to linear weights [in, out] (axis 0)"
    )


def test_the_exponent_search_is_only_for_mx_formats():
    with pytest.raises(ValueError) as err:
        exponent_search(np.ones((32, 2), np.float32), _tq("int4", 32), np.eye(32))
    assert str(err.value) == "layers/0/mlp/up_proj: the exponent search is for MX formats, not int4"


def test_the_scale_search_does_not_round_a_float64_checkpoint_to_float32_before_folding():
    # fold multiplies the checkpoint's own float64 values by s, then rounds once to float32.
    # Rounding the weight to float32 first (then the float64 product) is a second rounding
    # that moves values found by `_top_of_an_mx_block` off 4 at α = 2/4 (the mxfp4 block scale
    # one binade lower): the search must score the values fold stores, not those.
    rng = np.random.default_rng(13)
    n, grid = 32, 4
    x = _x(rng, 64, n)
    m = np.abs(x).mean(axis=0)
    s = m**0.5 / np.sqrt(m.max() ** 0.5 * m.min() ** 0.5)  # α = 2/4
    top = _top_of_an_mx_block(
        4 / s, lambda v: np.float32(v * s), lambda v: np.float32(np.float32(v) * s)
    )  # fmt: skip
    assert 3 <= np.sum(~np.isnan(top)) <= n - 3  # seeded: some rows, not all
    g = rng.choice([0.5, 1.0, 1.5, 2.0, 3.0], (n, 6)) / s[:, None]  # on the grid once folded
    w = np.where(np.isnan(top)[:, None], g, top[:, None]) * rng.choice([-1, 1], (n, 6))
    params = {"a": w, "norm": np.ones(n)}
    plans = {"a": _tq("mxfp4", path="a")}
    site = FoldSite("site", ("a",), "norm", "norm")
    got_s, got = search_scale(params, None, site, _site_stats(x, ("a",)), plans, grid=grid,
                              clip=False)  # fmt: skip
    want_s, want = numpy_folded_scale_search(x, params, site, plans, grid)
    rounded = {"a": w.astype(np.float32).astype(np.float64), "norm": np.ones(n)}
    _, rounded_alpha = numpy_folded_scale_search(x, rounded, site, plans, grid)
    assert got == want == 0.5 and rounded_alpha != want  # seeded: the rounding decides
    np.testing.assert_allclose(got_s, want_s, rtol=1e-12)
