"""GPTQ's behaviours on tiny layers: group scales fixed at their start, damping retries, dead rows
(its output-error bounds, slow, are in test_gptq_bounds.py)."""

from __future__ import annotations

import numpy as np
import pytest

from tenantq.numerics import compute_scale_zero_point, dequantize
from tenantq.quant import gptq
from tenantq.quant.gptq import gptq_quantize


def _correlated_inputs(rng, tokens, n):
    # Rank-2 structure plus noise: correlated channels are what GPTQ's error feedback uses.
    z, mix = rng.standard_normal((tokens, 2)), rng.standard_normal((2, n))
    return (z @ mix + 0.3 * rng.standard_normal((tokens, n))).astype(np.float32)


def test_group_scale_fixed_when_the_group_starts():
    # Group 0 starts before any error feedback, so its scale is the original rows' scale;
    # group 1 starts after group 0's errors moved its rows, so its scale differs from
    # the original rows' (it would equal it if scales were computed up front).
    rng = np.random.default_rng(2)
    x = _correlated_inputs(rng, 512, 64)
    w = rng.standard_normal((64, 8)).astype(np.float32)
    gram = x.T.astype(np.float64) @ x
    q = gptq_quantize(w, 2 * gram / 512, "int4", group_size=32)
    original, _ = compute_scale_zero_point(w, "int4", axis=0, group_size=32)
    np.testing.assert_array_equal(np.asarray(q.scale)[0], np.asarray(original)[0])
    assert not np.allclose(np.asarray(q.scale)[1], np.asarray(original)[1])


def test_gptq_rejects_mismatched_hessian():
    with pytest.raises(ValueError, match=r"weight \[in, out\] and hessian \[in, in\]"):
        gptq_quantize(np.ones((4, 2), np.float32), np.eye(3), "int8")


def test_failed_cholesky_is_retried_with_more_damping_and_logged(caplog):
    # H with one eigenvalue -0.05 (mean diag ~1): λ = 0.01 leaves it indefinite, λ = 0.1 does
    # not, so the retry must give exactly GPTQ at damp=0.1, and the log names the tensor
    rng = np.random.default_rng(0)
    basis, _ = np.linalg.qr(rng.standard_normal((8, 8)))
    h = (basis * np.array([1.5, 1.2, 1.1, 1.0, 1.0, 0.9, 0.8, -0.05])) @ basis.T
    w = rng.standard_normal((8, 4)).astype(np.float32)
    with caplog.at_level("WARNING", logger="tenantq.quant.gptq"):
        q = gptq_quantize(w, h, "int8", damp=0.01, name="layers/0/mlp/up_proj")
    assert "layers/0/mlp/up_proj: GPTQ's Cholesky failed at damp=0.01; retrying with damp=0.1" in (
        caplog.text
    )
    np.testing.assert_array_equal(
        np.asarray(dequantize(q)), np.asarray(dequantize(gptq_quantize(w, h, "int8", damp=0.1)))
    )
    with pytest.raises(ValueError, match="layers/1/attn/q_proj: GPTQ's Cholesky of H"):
        gptq_quantize(w, -np.eye(8) * 5 + h, "int8", name="layers/1/attn/q_proj")


@pytest.mark.parametrize("act_order", [False, True])
def test_dead_rows_are_zeroed_before_the_scales_are_taken(act_order):
    # row 2's input never fires (H row/column 0) and holds 100s: per-channel int8 scales must
    # come from the live rows (|w| <= ~3), so live rows keep int8's resolution there and the
    # dead row is stored as 0; a scale taken over the dead row would be ~30x too coarse
    rng = np.random.default_rng(1)
    x = _correlated_inputs(rng, 64, 6)
    x[:, 2] = 0.0
    w = rng.standard_normal((6, 3)).astype(np.float32)
    w[2] = 100.0
    q = gptq_quantize(w, 2 * x.T @ x / 64, "int8", act_order=act_order)
    live = np.delete(w, 2, axis=0)
    want, _ = compute_scale_zero_point(np.where(np.arange(6)[:, None] == 2, 0.0, w), "int8", axis=0)
    np.testing.assert_allclose(np.asarray(q.scale), np.asarray(want), rtol=1e-6)
    assert float(np.abs(np.asarray(q.scale)).max()) <= np.abs(live).max() / 127 * (1 + 1e-6)
    np.testing.assert_array_equal(np.asarray(dequantize(q))[2], 0.0)


def _indefinite_singular_hessian():
    # The reviewer's case: 4 tokens over 8 inputs (rank <= 4), two collinear inputs, and one
    # slightly negative diagonal entry: H + 0·I has no Cholesky factor.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    x[:, 5] = x[:, 4]
    h = 2 * x.T @ x / 4
    h[7, 7] = -1e-3
    return rng.standard_normal((8, 3)).astype(np.float32), h


@pytest.mark.parametrize("damp", [-0.01, float("nan"), float("inf")])
def test_negative_or_non_finite_damp_is_refused_naming_the_option(damp):
    # Damping x 10 from a negative start grows more negative: before the check this looped
    # forever. One line naming the tensor and the option, before any factorisation.
    w, h = _indefinite_singular_hessian()
    with pytest.raises(ValueError, match=r"^layers/0/mlp/up_proj: GPTQ option damp=") as err:
        gptq_quantize(w, h, "int8", damp=damp, name="layers/0/mlp/up_proj")
    assert "\n" not in str(err.value)


def test_damping_retries_are_capped_however_small_the_start(caplog):
    # From damp=1e-30 reaching MAX_DAMP takes 31 growths; the cap stops at MAX_RETRIES retries.
    w, h = _indefinite_singular_hessian()
    h = h - 20 * np.eye(8) * np.mean(np.diag(h))  # no damping up to MAX_DAMP fixes this
    with caplog.at_level("WARNING", logger="tenantq.quant.gptq"), pytest.raises(ValueError):
        gptq_quantize(w, h, "int8", damp=1e-30, name="layers/0/mlp/up_proj")
    assert caplog.text.count("retrying") == gptq.MAX_RETRIES
