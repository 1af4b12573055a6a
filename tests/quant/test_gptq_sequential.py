"""Sequential calibration (`quant.site_inputs.site_inputs_sequential`): layer l's statistics, and so
its GPTQ Hessian, come from the inputs the already-quantized layers < l produce (Frantar et al.
2022, section 4), checked against a recomputation that runs the decoder's own modules by hand."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tenantq.model.decoder import Block, OwnTokensKV
from tenantq.numerics import dequantize
from tenantq.quant import input_stats as cal
from tenantq.quant.apply import apply_plan, quantize_tensor
from tenantq.quant.plan import QuantPlan, Rule
from tenantq.quant.site_inputs import site_inputs, site_inputs_sequential

PLAN = QuantPlan(rules=(Rule("layers/.*", "int4", group_size=16, algorithm="gptq"),))


def _gram(x) -> np.ndarray:
    x = np.asarray(x, np.float64).reshape(-1, np.shape(x)[-1])
    return x.T @ x


def _inputs_by_hand(config, params, quantized, windows, layer):
    """(attn/in, mlp/in) activations of `layer` when layers < `layer` run with the quantized
    weights (dequantized) and `layer` itself at full precision; float32, one batch."""
    tokens = jnp.asarray(windows)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    run = {p: np.asarray(dequantize(v)) if hasattr(v, "fmt") else v for p, v in quantized.items()}
    x = jnp.asarray(params["embed"], jnp.float32)[tokens]
    for i in range(layer):
        block = Block(config, i, run, dtype=jnp.float32, activations={})
        x = block(x, positions, OwnTokensKV(positions))
    block = Block(config, layer, params, dtype=jnp.float32, activations={})
    h = block.input_norm(x)
    x = x + block.attn(h, positions, OwnTokensKV(positions))
    return h, block.post_attn_norm(x)


def test_sequential_hessian_is_xtx_of_inputs_from_the_quantized_prefix(config, params, windows):
    seq, seen = site_inputs_sequential(params, PLAN, config, windows, dtype=jnp.float32)
    quantized = apply_plan(seq.params, PLAN, config, inputs=seq.inputs)
    n = windows.size
    for layer in range(config.num_layers):
        attn_in, mlp_in = _inputs_by_hand(config, params, quantized, windows, layer)
        for site, x in ((f"layers/{layer}/attn/in", attn_in), (f"layers/{layer}/mlp/in", mlp_in)):
            # float32 accumulation over 128 tokens: 1e-4 relative (as test_calibration's
            # layer-0 check); a layer fed full-precision inputs misses by > 1% (below).
            np.testing.assert_allclose(seen.sites[site].gram, _gram(x), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(
            seq.inputs[f"layers/{layer}/attn/q_proj"]["hessian"],
            2.0 * _gram(attn_in) / n, rtol=1e-4, atol=1e-4,
        )  # fmt: skip


def test_sequential_differs_from_one_shot_exactly_after_the_first_quantized_layer(
    config, params, windows
):
    sites, _ = cal.compute_statistics(config, params, windows, dtype=jnp.float32)
    one_shot = site_inputs(params, PLAN, config, cal.CalibrationStats("m", "d", sites))
    seq, _ = site_inputs_sequential(params, PLAN, config, windows, dtype=jnp.float32)
    for path in ("layers/0/attn/q_proj", "layers/0/mlp/gate_proj"):
        # the embedding is not in the plan: layer 0 reads the same input either way
        np.testing.assert_allclose(
            seq.inputs[path]["hessian"], one_shot.inputs[path]["hessian"], rtol=1e-5, atol=1e-6
        )
    h_seq = seq.inputs["layers/1/attn/q_proj"]["hessian"]
    h_one = one_shot.inputs["layers/1/attn/q_proj"]["hessian"]
    # int4 g16 on layer 0 moves layer 1's input: far more than float32 noise (1e-4)
    assert np.abs(h_seq - h_one).max() > 1e-2 * np.abs(h_one).max()


def test_a_planned_embedding_is_rounded_before_layer_0_reads_it(config, params, windows):
    plan = QuantPlan(
        rules=(Rule("embed", "int4", group_size=16),
               Rule("layers/.*", "int4", group_size=16, algorithm="gptq"))
    )  # fmt: skip
    seq, _ = site_inputs_sequential(params, plan, config, windows, dtype=jnp.float32)
    embed = np.asarray(dequantize(quantize_tensor(params["embed"], plan.resolve(config)["embed"])))
    h = cal.compute_statistics(config, {**params, "embed": embed}, windows, dtype=jnp.float32)
    np.testing.assert_allclose(
        seq.inputs["layers/0/attn/q_proj"]["hessian"],
        h[0]["layers/0/attn/in"].hessian, rtol=1e-5, atol=1e-6,
    )  # fmt: skip


def test_sequential_refuses_an_unknown_static_statistic(config, params, windows):
    with pytest.raises(ValueError, match="static_statistic='median'; valid: absmax, percentile"):
        site_inputs_sequential(params, PLAN, config, windows, static_statistic="median")
