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

from tenantq.numerics import dequantize
from tenantq.quant.gptq import gptq_quantize

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
