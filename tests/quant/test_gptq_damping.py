"""GPTQ's damping option at its edges: damp = 0 (undamped GPTQ) is allowed and, when the
undamped Cholesky fails, retried from the default damping; out-of-range values are refused."""

from __future__ import annotations

import numpy as np
import pytest

from tenantq.numerics import dequantize
from tenantq.quant import gptq
from tenantq.quant.gptq import damped_inverse_factor, gptq_quantize


def _indefinite_singular_hessian():
    # 4 tokens over 8 inputs (rank <= 4), two collinear inputs, one slightly negative diagonal
    # entry: H + 0·I has no Cholesky factor, H + 0.01·mean(diag H)·I has one.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    x[:, 5] = x[:, 4]
    h = 2 * x.T @ x / 4
    h[7, 7] = -1e-3
    return rng.standard_normal((8, 3)).astype(np.float32), h


def test_zero_damp_that_fails_is_retried_from_the_default_damping(caplog):
    # Ten times 0 is 0: without a start value the retry could not grow (it used to stop after
    # one try). The first retry goes to DEFAULT_DAMP (0.01), then x 10 as for any damping;
    # this Hessian factorises at 1 (0 -> 0.01 -> 0.1 -> 1, each logged), and the result is
    # exactly GPTQ at that damping.
    w, h = _indefinite_singular_hessian()
    with caplog.at_level("WARNING", logger="tenantq.quant.gptq"):
        q = gptq_quantize(w, h, "int8", damp=0.0, name="layers/0/mlp/up_proj")
        _, _, used = damped_inverse_factor(h, 0.0)
    assert used == 100 * gptq.DEFAULT_DAMP
    assert "layers/0/mlp/up_proj: GPTQ's Cholesky failed at damp=0; retrying with damp=0.01" in (
        caplog.text
    )
    assert "up_proj: GPTQ's Cholesky failed at damp=0.1; retrying with damp=1" in caplog.text
    np.testing.assert_array_equal(
        np.asarray(dequantize(q)), np.asarray(dequantize(gptq_quantize(w, h, "int8", damp=used)))
    )


def test_zero_damp_on_a_positive_definite_hessian_is_undamped(caplog):
    # 64 tokens over 8 inputs: H is positive definite, so damp = 0 factorises at once (no
    # retry) and U is the Cholesky factor of H⁻¹ itself: Uᵀ U = H⁻¹ (float32: 1e-3 relative).
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 8))
    h = 2 * x.T @ x / 64
    with caplog.at_level("WARNING", logger="tenantq.quant.gptq"):
        u, _, used = damped_inverse_factor(h, 0.0)
    assert used == 0.0 and "retrying" not in caplog.text
    u = np.asarray(u, np.float64)
    np.testing.assert_allclose(u.T @ u, np.linalg.inv(h), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("damp", [-0.01, 10.5, float("nan")])
def test_damp_outside_zero_to_max_is_refused_naming_the_option_and_range(damp):
    w, h = _indefinite_singular_hessian()
    with pytest.raises(ValueError) as err:
        gptq_quantize(w, h, "int8", damp=damp, name="layers/0/mlp/up_proj")
    assert str(err.value) == (
        f"layers/0/mlp/up_proj: GPTQ option damp={damp!r}; it must be a number in [0, 10] "
        "(default 0.01)"
    )


def test_the_largest_damping_is_allowed():
    # damp = MAX_DAMP (10) is inside [0, 10]: a positive definite H factorises at it at once.
    rng = np.random.default_rng(2)
    x = rng.standard_normal((32, 4))
    _, _, used = damped_inverse_factor(2 * x.T @ x / 32, gptq.MAX_DAMP)
    assert used == gptq.MAX_DAMP == 10.0


def test_a_non_finite_hessian_is_refused_naming_the_tensor():
    h = np.eye(4)
    h[1, 2] = np.nan
    with pytest.raises(ValueError) as err:
        gptq_quantize(np.ones((4, 2), np.float32), h, "int8", name="layers/0/mlp/down_proj")
    assert str(err.value) == (
        "layers/0/mlp/down_proj: the calibration Hessian has non-finite entries"
    )
    with pytest.raises(ValueError) as err:  # unnamed, it is "weight"
        damped_inverse_factor(h)
    assert str(err.value) == "weight: the calibration Hessian has non-finite entries"


def test_a_hessian_no_damping_makes_definite_is_refused_saying_what_to_do():
    # -5·I: H + λI with λ = damp · mean diag H = -5·damp stays negative at any damping, so
    # every retry fails up to MAX_DAMP (0.01 -> 0.1 -> 1 -> 10) and the error names the last
    # damping tried and the two ways out, in one line.
    with pytest.raises(ValueError) as err:
        damped_inverse_factor(-5.0 * np.eye(4, dtype=np.float32), name="layers/2/mlp/down_proj")
    assert str(err.value) == (
        "layers/2/mlp/down_proj: GPTQ's Cholesky of H + λI failed up to damp=10 (λ = damp · "
        "mean diag H); the Hessian is far from positive semi-definite: recollect the "
        "calibration statistics or use rtn for this tensor"
    )


def test_each_damping_retry_is_logged_as_one_line_naming_the_tensor_and_both_dampings(caplog):
    # -5·I fails at every damping (as above): three retries, 0.01 -> 0.1 -> 1 -> 10, each logged
    # once, exactly; the fourth (100 > MAX_DAMP) is not tried, so not logged.
    with caplog.at_level("WARNING", logger="tenantq.quant.gptq"), pytest.raises(ValueError):
        damped_inverse_factor(-5.0 * np.eye(4, dtype=np.float32), name="layers/2/mlp/down_proj")
    assert [r.getMessage() for r in caplog.records] == [
        f"layers/2/mlp/down_proj: GPTQ's Cholesky failed at damp={a}; retrying with damp={b}"
        for a, b in (("0.01", "0.1"), ("0.1", "1"), ("1", "10"))
    ]
