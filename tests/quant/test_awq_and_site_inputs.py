"""AWQ's search never loses to RTN on its calibration error; `site_inputs` + `apply_plan`
end to end."""

from __future__ import annotations

import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from tenantq.numerics import dequantize, quantize
from tenantq.quant import input_stats as cal
from tenantq.quant.apply import apply_plan, registered_algorithms
from tenantq.quant.awq import clip_search, output_error
from tenantq.quant.plan import QuantPlan, Rule, TensorQuant
from tenantq.quant.site_inputs import site_inputs


@pytest.fixture(scope="module")
def stats(config, params, windows):
    sites, _ = cal.compute_statistics(config, params, windows, dtype=jnp.float32)
    return cal.CalibrationStats("m", "d", sites)


def _plan(algorithm: str, fmt: str = "int4", group_size: int | None = 16) -> QuantPlan:
    return QuantPlan(rules=(Rule("layers/.*", fmt, group_size=group_size, algorithm=algorithm),))


def test_algorithms_are_available_when_apply_loads_and_quant_imports_no_jax():
    code = (
        "import sys, tenantq.quant, tenantq.quant.plan; assert 'jax' not in sys.modules; "
        "from tenantq.quant.apply import registered_algorithms as r; print(sorted(r()))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['awq', 'gptq', 'rtn', 'smoothquant']"
    assert {"gptq", "awq", "smoothquant"} <= set(registered_algorithms())


def test_the_algorithm_table_holds_exactly_the_plans_algorithm_names():
    # A rule may name only plan.ALGORITHM_NAMES; each must have a function in the one table,
    # and the table must hold nothing a plan cannot name.
    from tenantq.quant.algorithms import ALGORITHMS
    from tenantq.quant.plan import ALGORITHM_NAMES

    assert tuple(ALGORITHMS) == ALGORITHM_NAMES


@pytest.mark.parametrize("algorithm", ["awq", "gptq", "smoothquant"])
def test_calibrated_rule_without_statistics_says_what_to_run(config, params, algorithm):
    with pytest.raises(ValueError, match=rf"algorithm '{algorithm}' needs .*site_inputs\("):
        apply_plan(params, _plan(algorithm, "int8", None), config)


@pytest.mark.slow
def test_awq_error_at_most_rtn_on_every_consumer(config, params, stats):
    # α = 0 on AWQ's grid (4 points here, to keep the test short) is s = 1 (plain rounding)
    # and clipping ratio 1.0 is no clipping, so
    # on the calibration Gram AWQ's output error can only tie or beat RTN's (bound: <=, plus
    # float32 rounding of 1e-6 relative).
    plan = _plan("awq")
    cal_ = site_inputs(params, plan, config, stats, awq_grid=4)
    quantized = apply_plan(cal_.params, plan, config, inputs=cal_.inputs)
    rtn = apply_plan(params, _plan("rtn"), config)
    wins = 0
    for path in plan.resolve(config):
        gram = stats.for_path(path).gram
        w = np.asarray(params[path], np.float32)
        awq_err = output_error(
            cal_.effective_weight(path, dequantize(quantized[path]), config), w, gram
        )
        rtn_err = output_error(dequantize(rtn[path]), w, gram)
        assert awq_err <= rtn_err * (1 + 1e-6), (path, awq_err, rtn_err)
        wins += awq_err < 0.99 * rtn_err
    assert wins >= len(plan.resolve(config)) // 2  # and it really helps on most tensors


def test_folded_params_compute_the_same_function(config, params, stats, windows):
    from tenantq.engine import Engine

    cal_ = site_inputs(params, _plan("awq"), config, stats, awq_grid=4)
    # Every site the plan's "layers/.*" rule covers is folded (not the LM head's input).
    assert set(cal_.fold_scales) == set(stats.sites) - {"head/in"}

    def logits(p):
        p32 = {k: jnp.asarray(v, jnp.float32) for k, v in p.items()}
        return Engine(config, p32, dtype="float32").logits(windows.tolist())

    a, b = logits(params), logits(cal_.params)
    np.testing.assert_allclose(b, a, atol=1e-4 * np.abs(a).max())  # float32 rounding only


def test_clip_search_never_worse_than_no_clip():
    # Ratio 1.0 is among the candidates, so per group the chosen error is <= the unclipped
    # one, hence also in total (block-diagonal part of G; exact arithmetic bound).
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 64)).astype(np.float32)
    w = rng.standard_normal((64, 16)).astype(np.float32)
    w[3, :] *= 8  # an outlier row that makes clipping worth it
    gram = x.T.astype(np.float64) @ x
    how = TensorQuant("t", "int4", 0, 16, True, "awq", None)
    clipped = dequantize(clip_search(w, how, gram))
    plain = dequantize(quantize(w, "int4", axis=0, group_size=16))
    assert output_error(clipped, w, gram) <= output_error(plain, w, gram) * (1 + 1e-6)


def test_mixed_folding_on_one_input_is_refused(config, params, stats):
    plan = QuantPlan(
        rules=(
            Rule("layers/0/attn/q_proj", "int8", algorithm="smoothquant"),
            Rule("layers/0/attn/k_proj", "int8", algorithm="awq"),
        )
    )
    with pytest.raises(ValueError, match="must agree on a scaling algorithm"):
        site_inputs(params, plan, config, stats)
