"""What GPTQ takes in: activation order among rows of equal Hessian diagonal, a bf16 weight, and
the name an unnamed weight's errors give. The numpy GPTQ of the paper (Algorithm 1) is the
reference, as in test_gptq_reference.py."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from test_gptq_reference import numpy_gptq

from tenantq.numerics import dequantize
from tenantq.quant.gptq import gptq_quantize


@pytest.mark.slow  # a jitted GPTQ sweep over 64 rows: ~3 s quiet, 9 s at load 18
def test_activation_order_keeps_rows_of_equal_hessian_diagonal_in_input_order():
    # 64 correlated inputs whose H diagonal takes only three values (a non-negative diagonal
    # added to a PSD matrix keeps it PSD): rows go by decreasing diagonal and, among equal
    # ones, in input order (a stable sort, as the reference). Another order among the ties
    # pushes the errors elsewhere and rounds other codes: numpy's default sort (introsort)
    # does not keep the input order of 64 tied keys.
    rng = np.random.default_rng(11)
    x = rng.standard_normal((256, 3)) @ rng.standard_normal((3, 64))
    x += 0.3 * rng.standard_normal((256, 64))
    h = 2 * x.T @ x / 256
    top = np.ceil(np.diag(h).max())
    levels = top + rng.integers(0, 3, 64)  # three tied groups of ~21 rows
    h += np.diag(levels - np.diag(h))
    h = h.astype(np.float32)
    assert np.array_equal(np.diag(h), levels)
    w = rng.standard_normal((64, 4)).astype(np.float32)
    got = gptq_quantize(w, h, "int4", act_order=True, damp=0.01, block_rows=16)
    want = numpy_gptq(w, h, 0.01, act_order=True)
    # float32 against float64 arithmetic: 1e-4 on weights of order 1 (test_gptq_reference.py)
    np.testing.assert_allclose(np.asarray(dequantize(got), np.float64), want, rtol=0, atol=1e-4)


@pytest.mark.slow  # four jitted GPTQ sweeps: ~4 s quiet, 11 s at load 18
def test_a_bf16_weight_is_rounded_as_its_float32_values():
    # GPTQ computes in float32 whatever the weight's dtype: a bf16 checkpoint's weight gives
    # exactly the codes and scales of the same values held in float32 (bf16 -> float32 is
    # exact; scales taken in bf16 would round max|w| / 7 to 8 bits).
    rng = np.random.default_rng(5)
    x = rng.standard_normal((128, 16))
    h = (2 * x.T @ x / 128).astype(np.float32)
    w16 = jnp.asarray(rng.standard_normal((16, 6)), jnp.bfloat16)
    w32 = np.asarray(w16, np.float32)
    for group in (None, 8):
        got = gptq_quantize(w16, h, "int4", group_size=group, block_rows=8)
        want = gptq_quantize(w32, h, "int4", group_size=group, block_rows=8)
        assert got.scale.dtype == want.scale.dtype
        np.testing.assert_array_equal(np.asarray(got.scale), np.asarray(want.scale))
        np.testing.assert_array_equal(np.asarray(dequantize(got)), np.asarray(dequantize(want)))


def test_an_unnamed_weights_errors_name_it_weight():
    h = np.eye(4)
    h[0, 3] = np.inf
    with pytest.raises(ValueError) as err:
        gptq_quantize(np.ones((4, 2), np.float32), h, "int8")
    assert str(err.value) == "weight: the calibration Hessian has non-finite entries"


def test_a_hessian_of_another_size_is_refused_naming_both_shapes():
    with pytest.raises(ValueError) as err:
        gptq_quantize(np.ones((4, 2), np.float32), np.eye(3), "int8")
    assert str(err.value) == (
        "GPTQ needs weight [in, out] and hessian [in, in]; got (4, 2) and (3, 3)"
    )
