"""GPTQ against a straightforward numpy GPTQ written from the paper (Frantar et al. 2022,
Algorithm 1): the Hessian damped on its diagonal only, the upper Cholesky factor of its
inverse, one input row rounded at a time with its error pushed onto the rows after it.

The reference does no blocking (the paper's lazy batch updates are an exact reordering of
the same arithmetic) and runs in float64; the library runs in float32, so the rounded
weights must agree to float32 precision (bound 1e-4 absolute on weights of order 1, measured
~4e-7), code for code.
"""

from __future__ import annotations

import numpy as np
import pytest

from tenantq.numerics import compute_scale_zero_point, dequantize, quantize_with_scale_zero_point
from tenantq.quant.gptq import gptq_quantize, gptq_weight
from tenantq.quant.plan import TensorQuant

QMAX = 7  # symmetric int4: codes in [-7, 7], scale = max|w| / 7 (the codec's rule)


def numpy_gptq(w, h, damp, group=None, act_order=False):
    """Algorithm 1 of the paper for weights [in, out]: our rows are the paper's columns."""
    w = np.array(w, np.float64)
    h = np.array(h, np.float64)
    n = w.shape[0]
    perm = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(n)
    back = np.argsort(perm)
    h, w = h[perm][:, perm], w[perm]
    dead = np.diag(h) == 0  # an input that never fires: H_ii = 1, its weights zeroed
    h[dead, dead] = 1.0
    w[dead] = 0.0
    h += damp * np.mean(np.diag(h)) * np.eye(n)  # λ on the diagonal only
    u = np.linalg.cholesky(np.linalg.inv(h)).T
    original = w[back]  # static groups (act order) take scales from the original rows
    scale = np.abs(w).max(axis=0) / QMAX
    q = np.zeros_like(w)
    for i in range(n):
        if group and act_order:
            g = perm[i] // group
            scale = np.abs(original[g * group : (g + 1) * group]).max(axis=0) / QMAX
        elif group and i % group == 0:  # a group's scale is fixed when it starts
            scale = np.abs(w[i : i + group]).max(axis=0) / QMAX
        q[i] = np.clip(np.round(w[i] / scale), -QMAX, QMAX) * scale
        err = (w[i] - q[i]) / u[i, i]
        w[i:] -= np.outer(u[i, i:], err)
    return q[back]


@pytest.mark.slow  # three jitted GPTQ sweeps: ~10 s on a quiet core
@pytest.mark.parametrize(
    ("group", "act_order", "damp"), [(None, False, 0.1), (8, False, 0.01), (8, True, 0.05)]
)
def test_gptq_rounds_as_the_papers_algorithm_does(group, act_order, damp):
    rng = np.random.default_rng(7)
    # Correlated inputs (rank 3 plus noise), one input channel that never fires.
    x = rng.standard_normal((256, 3)) @ rng.standard_normal((3, 32))
    x += 0.3 * rng.standard_normal((256, 32))
    x[:, 5] = 0.0
    h = 2 * x.T @ x / 256
    w = rng.standard_normal((32, 8)).astype(np.float32)
    got = gptq_quantize(
        w, h.astype(np.float32), "int4", group_size=group, act_order=act_order, damp=damp,
        block_rows=8,  # four lazy-update blocks
    )  # fmt: skip
    want = numpy_gptq(w, h, damp, group=group, act_order=act_order)
    np.testing.assert_allclose(np.asarray(dequantize(got), np.float64), want, rtol=0, atol=1e-4)
    assert not np.any(want[5])  # the dead input's row is zero


def numpy_gptq_codec(w, h, damp, fmt, group, symmetric=True, act_order=False):
    """Algorithm 1 again, the rounding of each row given its group's scale left to the codec
    (formats whose grid is not a hand formula: MX, nvfp4, asymmetric int). Scales as the
    library fixes them: per channel or static groups from the original (dead-zeroed) rows,
    otherwise from a group's rows as updated so far when the group starts; nvfp4's tensor
    scale from the whole weight, up front."""
    w = np.array(w, np.float64)
    h = np.array(h, np.float64)
    n = w.shape[0]
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    w[dead] = 0.0
    perm = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(n)
    back = np.argsort(perm)
    h, w = h[perm][:, perm], w[perm]
    h += damp * np.mean(np.diag(h)) * np.eye(n)
    u = np.linalg.cholesky(np.linalg.inv(h)).T
    original = w[back].astype(np.float32)
    kw = dict(axis=0, group_size=group, symmetric=symmetric)
    fixed = {}
    if fmt == "nvfp4":
        fixed["tensor_scale"] = compute_scale_zero_point(original, fmt, **kw)[0].tensor
    q = np.zeros_like(w)
    for i in range(n):
        if group is None or act_order:  # the scales of the original rows, fixed up front
            g = 0 if group is None else perm[i] // group
            rows = original if group is None else original[g * group : (g + 1) * group]
            scale, zp = compute_scale_zero_point(rows, fmt, **kw, **fixed)
        elif i % group == 0:  # a group's scale is fixed when it starts
            scale, zp = compute_scale_zero_point(
                w[i : i + group].astype(np.float32), fmt, **kw, **fixed
            )
        row = w[i][None, :].astype(np.float32)
        q[i] = np.asarray(
            dequantize(
                quantize_with_scale_zero_point(row, fmt, scale, zp, axis=0, group_size=group)
            )
        )[0]
        err = (w[i] - q[i]) / u[i, i]
        w[i:] -= np.outer(u[i, i:], err)
    return q[back]


# mxfp4: its 32-row block is the group whatever group_size says; nvfp4 (16-row blocks, one
# tensor scale); int8 asymmetric per channel (zero points), 20 rows in blocks of 8 (padded);
# int4 in groups of 8 over 20 rows (a partial last group) with activation order.
@pytest.mark.slow  # four jitted sweeps and a reference rounding row by row: ~10 s quiet
@pytest.mark.parametrize(
    ("fmt", "group", "symmetric", "act_order", "n"),
    [
        ("mxfp4", 8, True, False, 64),
        ("nvfp4", None, True, False, 32),
        ("int8", None, False, False, 20),
        ("int4", 8, True, True, 20),
    ],
)
def test_gptq_rounds_as_the_papers_algorithm_in_every_scaled_format(
    fmt, group, symmetric, act_order, n
):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((128, 3)) @ rng.standard_normal((3, n))
    x += 0.3 * rng.standard_normal((128, n))
    x[:, 2] = 0.0  # an input that never fires
    h = 2 * x.T @ x / 128
    w = rng.standard_normal((n, 6)).astype(np.float32)
    w[2] = 50.0  # the dead row would coarsen its channel's scale if it were not zeroed first
    got = gptq_quantize(
        w, h.astype(np.float32), fmt, group_size=group, symmetric=symmetric,
        act_order=act_order, damp=0.02, block_rows=8,
    )  # fmt: skip
    spec_group = {"mxfp4": 32, "nvfp4": 16}.get(fmt, group)
    want = numpy_gptq_codec(w, h, 0.02, fmt, spec_group, symmetric, act_order)
    assert got.fmt == fmt and got.shape == w.shape and (got.zero_point is None) == symmetric
    np.testing.assert_allclose(np.asarray(dequantize(got), np.float64), want, rtol=0, atol=1e-4)
    assert not np.any(want[2])


@pytest.mark.parametrize("symmetric", [False, True])
def test_a_plans_gptq_rule_passes_its_format_group_and_options(symmetric):
    how = TensorQuant("layers/0/mlp/up_proj", "int4", 0, 8, symmetric, "gptq", None)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((64, 3)) @ rng.standard_normal((3, 16))
    x += 0.1 * rng.standard_normal((64, 16))
    h = (2 * x.T @ x / 64).astype(np.float32)
    w = rng.standard_normal((16, 4)).astype(np.float32)
    got = gptq_weight(w, how, hessian=h, damp=3.0, act_order=True)
    want = gptq_quantize(w, h, "int4", group_size=8, symmetric=symmetric, damp=3.0, act_order=True)
    np.testing.assert_array_equal(np.asarray(dequantize(got)), np.asarray(dequantize(want)))
    assert got.group_size == 8 and (got.zero_point is None) == symmetric
    default = gptq_quantize(w, h, "int4", group_size=8, symmetric=symmetric)
    assert not np.array_equal(np.asarray(dequantize(default)), np.asarray(dequantize(want)))
    np.testing.assert_array_equal(
        np.asarray(dequantize(gptq_weight(w, how, hessian=h))), np.asarray(dequantize(default))
    )


def test_a_plans_gptq_rule_names_its_tensor_when_the_damping_cannot_help(caplog):
    how = TensorQuant("layers/1/attn/q_proj", "int8", 0, None, True, "gptq", None)
    h = -5.0 * np.eye(8, dtype=np.float32)  # no damping up to MAX_DAMP makes it definite
    with caplog.at_level("WARNING", logger="tenantq.quant.gptq"), pytest.raises(ValueError) as err:
        gptq_weight(np.ones((8, 2), np.float32), how, hessian=h)
    assert str(err.value).startswith("layers/1/attn/q_proj: GPTQ's Cholesky of H + λI failed")
    assert "layers/1/attn/q_proj: GPTQ's Cholesky failed at damp=0.01" in caplog.text


def test_a_gptq_rule_without_a_hessian_says_what_to_run():
    how = TensorQuant("layers/0/mlp/up_proj", "int4", 0, 8, True, "gptq", None)
    with pytest.raises(ValueError) as err:
        gptq_weight(np.ones((4, 2), np.float32), how)
    assert str(err.value) == (
        "layers/0/mlp/up_proj: algorithm 'gptq' needs calibration statistics (its input's "
        "Hessian); run tenantq.quant.site_inputs.site_inputs(params, plan, config, stats) and pass "
        "its inputs to apply_plan"
    )
    how = TensorQuant("embed", "int8", 1, None, True, "gptq", None)
    with pytest.raises(ValueError) as err:
        gptq_weight(np.ones((4, 2), np.float32), how, hessian=np.eye(4))
    assert str(err.value) == "embed: GPTQ applies to linear weights [in, out] (axis 0)"


def test_gptq_refuses_a_format_without_scales():
    with pytest.raises(ValueError) as err:
        gptq_quantize(np.ones((4, 2), np.float32), np.eye(4), "bf16")
    assert str(err.value) == "GPTQ rounds to a scaled format; bf16 is a plain cast (use rtn)"
