"""AWQ at MX formats (issue 11): the per-block E8M0 exponent search and its bound vs RTN.

OCP MX v1.0 (section 6.3) scales a block by 2^(floor(log2 amax) - emax_elem), so for E2M1
(largest value 6) the block's amax lands in [4, 8) x scale and the top of that range
saturates; AWQ's search at MX tries the exponent one up and one down and keeps a choice
only where the full Gram says it beats the OCP rule.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tenantq.numerics import dequantize, quantize
from tenantq.quant import input_stats as cal
from tenantq.quant.apply import apply_plan
from tenantq.quant.awq import column_errors, exponent_search, output_error
from tenantq.quant.plan import QuantPlan, Rule, TensorQuant
from tenantq.quant.site_inputs import site_inputs

MXFP4 = TensorQuant("t", "mxfp4", 0, None, True, "awq", None)


def test_a_saturating_block_moves_its_exponent_up():
    # Every value 7.5: OCP's exponent floor(log2 7.5) - 2 = 0 gives scale 1, and 7.5
    # saturates to E2M1's 6 (error 1.5 each). One up, scale 2: 7.5 / 2 = 3.75 rounds to 4,
    # i.e. 8 (error 0.5 each): 9x less squared error, exact arithmetic.
    w = np.full((32, 1), 7.5, np.float32)
    gram = np.eye(32)
    ocp = dequantize(quantize(w, "mxfp4", axis=0))
    assert np.all(np.asarray(ocp) == 6.0)
    searched = dequantize(exponent_search(w, MXFP4, gram))
    assert np.all(np.asarray(searched) == 8.0)
    assert output_error(searched, w, gram) == pytest.approx(output_error(ocp, w, gram) / 9)


def test_the_search_never_loses_to_the_ocp_rule_column_by_column():
    # Correlated inputs (the cross-block Gram terms the per-block choice ignores) and
    # outlier rows (as AWQ-scaled weights have).
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 8)).astype(np.float32)
    w[5] *= 12.0  # outlier rows, as activations-scaled weights have
    x = rng.standard_normal((512, 64)).astype(np.float32)
    x[:, 1::2] += x[:, ::2]
    gram = x.T.astype(np.float64) @ x
    ocp = np.asarray(dequantize(quantize(w, "mxfp4", axis=0)), np.float64)
    searched = np.asarray(dequantize(exponent_search(w, MXFP4, gram)), np.float64)
    # Per column the OCP exponents are a candidate and the full-Gram check keeps the better:
    # never worse, to float64 summation order (1e-9 relative).
    ocp_err = column_errors(ocp - w, gram)
    assert np.all(column_errors(searched - w, gram) <= ocp_err * (1 + 1e-9))
    # and it helps: measured 0.90x here (seeded); 0.95 fails a search that never moves.
    assert output_error(searched, w, gram) < 0.95 * output_error(ocp, w, gram)


def test_exponent_search_is_only_for_mx():
    how = TensorQuant("layers/0/mlp/up_proj", "int4", 0, 32, True, "awq", None)
    with pytest.raises(ValueError, match="up_proj: the exponent search is for MX formats"):
        exponent_search(np.ones((32, 2), np.float32), how, np.eye(32))


@pytest.mark.slow
def test_awq_mxfp4_layer_error_at_most_rtn_on_a_reference_layer(reference_float32):
    # Layer 0 of the shipped model, statistics of 8 x 128 train-split tokens. On those
    # calibration inputs AWQ's total error over the layer's 7 linears is <= RTN's: at each
    # site α = 0 (s = 1) is on the grid and changes nothing, every tensor the fold touches
    # is scored as it will be quantized, and the exponent search is per column <= RTN.
    # Measured here 0.62x (the bench: 0.62x over all 28 linears, README); 0.9 guards
    # against a search that stops helping.
    from tenantq.evals.windows import calibration_windows

    path, config, params, tok = reference_float32
    windows, _ = calibration_windows(tok, config, num_sequences=8, seq_tokens=128)
    sites, _ = cal.compute_statistics(config, params, windows, dtype=jnp.float32)
    stats = cal.CalibrationStats("m", "d", sites)
    errors = {}
    for algorithm in ("rtn", "awq"):
        plan = QuantPlan(rules=(Rule("layers/0/.*", "mxfp4", algorithm=algorithm),))
        prepared = site_inputs(params, plan, config, stats, awq_grid=5)
        quantized = apply_plan(prepared.params, plan, config, inputs=prepared.inputs)
        errors[algorithm] = {
            p: output_error(
                prepared.effective_weight(p, dequantize(quantized[p]), config),
                params[p],
                stats.for_path(p).gram,
            )
            for p in plan.resolve(config)
        }
    assert len(errors["awq"]) == 7
    rtn_total, awq_total = sum(errors["rtn"].values()), sum(errors["awq"].values())
    assert awq_total <= rtn_total * (1 + 1e-6), (awq_total, rtn_total)
    assert awq_total < 0.9 * rtn_total, errors


def test_a_quantized_producer_is_scored_with_its_consumers():
    # o_proj-like consumer o reads x / s; its producer v (an up_proj-like linear whose
    # columns the fold divides by s) is quantized too. Under E8M0 scales a non-power-of-two
    # column scale changes v's rounding, so the search scores v as well: its choice minimises
    # o's + v's error over the grid, so it is <= that at α = 0 (s = 1) and <= that of the
    # choice scored on o alone (both grid points) — strictly here (seeded: 0.937 vs 0.960 of
    # the s = 1 total), which fails if the producer's term is dropped.
    from tenantq.quant.awq import search_scale
    from tenantq.quant.folding import FoldSite, fold
    from tenantq.quant.input_stats import InputStats

    site = FoldSite("o_in", ("o",), "v", "columns")
    how_o, how_v = (TensorQuant(p, "mxfp4", 0, None, True, "awq", None) for p in ("o", "v"))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 64)) * np.exp(rng.standard_normal(64))  # uneven channels
    gram_o = x.T @ x
    x_v = rng.standard_normal((256, 64))
    gram_v = x_v.T @ x_v
    params = {
        "o": rng.standard_normal((64, 32)).astype(np.float32),
        "v": (rng.standard_normal((64, 64)) * 3).astype(np.float32),
    }
    absmax = np.abs(x).max(0)
    stats = InputStats("o_in", ("o",), 256, absmax, absmax, np.abs(x).mean(0), gram_o)

    def total(s):
        folded = fold(params, None, site, s)
        o_hat = dequantize(exponent_search(folded["o"], how_o, gram_o / np.outer(s, s)))
        v_hat = dequantize(exponent_search(folded["v"], how_v, gram_v))
        return output_error(np.asarray(o_hat) / s[:, None], params["o"], gram_o) + output_error(
            np.asarray(v_hat) * s[None, :], params["v"], gram_v
        )

    with_v, _ = search_scale(
        params, None, site, stats, {"o": how_o}, grid=10, source=(how_v, gram_v)
    )
    o_only, _ = search_scale(params, None, site, stats, {"o": how_o}, grid=10)
    assert total(with_v) <= total(np.ones(64)) * (1 + 1e-6)
    assert total(with_v) < 0.99 * total(o_only)
