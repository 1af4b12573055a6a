"""GPTQ's output error: close to the integer least-squares optimum on tiny layers, below
RTN's in every scaled format (slow: enumeration and 128-row layers; the fast behaviour
tests, which the mutation target runs, are in test_gptq.py and test_gptq_reference.py)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tenantq.numerics import dequantize, quantize
from tenantq.quant.gptq import gptq_quantize


def _output_error(w_hat, w, gram) -> float:
    d = np.asarray(w_hat, np.float64) - w
    return float(np.einsum("ic,ij,jc->", d, gram, d))  # ||X W - X W_hat||_F^2


def _correlated_inputs(rng, tokens, n):
    # Rank-2 structure plus noise: correlated channels are what GPTQ's error feedback uses.
    z, mix = rng.standard_normal((tokens, 2)), rng.standard_normal((2, n))
    return (z @ mix + 0.3 * rng.standard_normal((tokens, n))).astype(np.float32)


@pytest.mark.slow
def test_gptq_near_the_least_squares_optimum_on_tiny_layers():
    # 16 layers of 5 inputs x 3 outputs, int4 with one scale per output channel. With the
    # scale fixed, the best codes minimise (w - s q)ᵀ G (w - s q) over q in {-7..7}^5: 15^5
    # candidates per column, enumerated. GPTQ is greedy (no closed-form guarantee), so the
    # bound is measured: summed error 1.82x the optimum here (RTN: 3.98x); the test allows
    # 2.0x, and requires GPTQ to stay under 0.6x RTN.
    codes = np.array(list(itertools.product(range(-7, 8), repeat=5)), np.float64)
    total = {"gptq": 0.0, "rtn": 0.0, "optimum": 0.0}
    for seed in range(16):
        rng = np.random.default_rng(seed)
        x = _correlated_inputs(rng, 64, 5)
        w = rng.standard_normal((5, 3)).astype(np.float32)
        gram = x.T.astype(np.float64) @ x
        q = gptq_quantize(w, 2 * gram / 64, "int4", damp=0.0)
        scale = np.asarray(q.scale, np.float64)[0]
        for c in range(3):
            d = codes * scale[c] - w[:, c]
            total["optimum"] += np.einsum("ki,ij,kj->k", d, gram, d).min()
        total["gptq"] += _output_error(dequantize(q), w, gram)
        total["rtn"] += _output_error(dequantize(quantize(w, "int4", axis=0)), w, gram)
    assert total["gptq"] <= 2.0 * total["optimum"], total
    assert total["gptq"] <= 0.6 * total["rtn"], total


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fmt", "group_size"),
    [("int4", 32), ("int8", None), ("nvfp4", None), ("mxfp4", None), ("fp8_e4m3", None)],
)
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn_on_output_error(fmt, group_size, act_order):
    # 128 correlated inputs: GPTQ minimises exactly this error greedily, RTN ignores it, so
    # GPTQ must come out below RTN in every format (measured 0.4-0.9x; bound: below 1x).
    rng = np.random.default_rng(1)
    x = _correlated_inputs(rng, 1024, 128)
    w = (rng.standard_normal((128, 32)) / 11).astype(np.float32)
    gram = x.T.astype(np.float64) @ x
    q = gptq_quantize(w, 2 * gram / 1024, fmt, group_size=group_size, act_order=act_order)
    rtn = quantize(w, fmt, axis=0, group_size=group_size)
    assert q.fmt == fmt and q.shape == w.shape and q.scale.shape == rtn.scale.shape
    assert _output_error(dequantize(q), w, gram) < _output_error(dequantize(rtn), w, gram)
