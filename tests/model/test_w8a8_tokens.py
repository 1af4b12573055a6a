"""W8A8 scales activations per token: a quiet token beside a 1000x louder one keeps its accuracy.

For y = x @ W with W quantized per output channel and x per token (row), each output obeys
|y^ - y|_rj <= sum_i |x_ri| e^W_ij + e^x_ri |W_ij| + e^x_ri e^W_ij, where the element error
bounds come from the format's definition with the row's (the column's) own amax:
  int8: half a step, amax / 127 / 2;
  fp8 E4M3: 2^-4 relative (3 mantissa bits) plus half the subnormal step, 2^-10 amax / 448.
Float32 accumulation adds at most n * 2^-23 * sum |x| |W| (n = 256 terms).
A per-tensor activation scale would give the quiet row the loud row's step (1000x coarser):
its int8 codes all round to zero, a 100% error, far outside this bound.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tenantq.model.layers import Linear
from tenantq.numerics import quantize

IN, OUT = 256, 32
F32_SLACK = IN * 2.0**-23
# Expected relative error of y for N(0, 1) rows and N(0, 1/IN) weights, with independent
# rounding errors on both operands, times two. int8: amax ~ 2.9 sd over 256 elements, an
# error uniform in half a step, amax / 127 / sqrt(12) ~ 0.0066 sd per operand, sqrt(2) of that
# for y: ~1% (measured 0.95%). E4M3: a uniform error within half an ulp of 3 mantissa bits,
# ~2^-3 / sqrt(12) ~ 3.6% relative at most per operand, ~0.7 of that averaged over a binade,
# sqrt(2) for y: ~3.5% (measured 3.3%).
REL_LIMIT = {"int8": 0.02, "fp8_e4m3": 0.07}


def _element_bound(a: np.ndarray, fmt: str, amax: np.ndarray) -> np.ndarray:
    if fmt == "int8":
        return np.broadcast_to(amax / 127 / 2, a.shape)
    return 2.0**-4 * np.abs(a) + 2.0**-10 * amax / 448  # fp8_e4m3


# int8's codes span 127 steps: a token 1000x quieter than the tensor's amax rounds to zero
# under one scale per tensor. E4M3 spans 2^-9..448 (about 2^17) per scale, so a 1000x gap
# still fits in one; 10^5 (past the 2^15 of its normal range) does not.
@pytest.mark.parametrize(("fmt", "loud"), [("int8", 1e3), ("fp8_e4m3", 1e5)])
def test_a_quiet_token_keeps_its_own_activation_scale(fmt: str, loud: float) -> None:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((IN, OUT)) / np.sqrt(IN)).astype(np.float32)
    quiet = rng.standard_normal(IN)
    x = np.stack([quiet, loud * rng.standard_normal(IN)]).astype(np.float32)
    layer = Linear("layers/0/mlp/up_proj", quantize(w, fmt, axis=0), dtype=jnp.float32,
                   activations=fmt)  # fmt: skip
    got = np.asarray(layer(jnp.asarray(x)), np.float64)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    want = x64 @ w64
    ex = _element_bound(x64, fmt, np.abs(x64).max(axis=1, keepdims=True))  # per token
    ew = _element_bound(w64, fmt, np.abs(w64).max(axis=0, keepdims=True))  # per channel
    magnitude = np.abs(x64) @ np.abs(w64)
    bound = np.abs(x64) @ ew + ex @ np.abs(w64) + ex @ ew + F32_SLACK * magnitude
    err = np.abs(got - want)
    assert (err <= bound).all(), f"{fmt}: error / bound per token {(err / bound).max(axis=1)}"
    # The quiet token's relative error stays at its format's own level: the worst-case bound
    # above is loose where outputs cancel (E4M3: ~70% of max|y|), this one is not.
    rel = np.linalg.norm(err[0]) / np.linalg.norm(want[0])
    assert 0 < rel < REL_LIMIT[fmt], rel
