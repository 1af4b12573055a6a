"""The calibration set's `sequential` switch reaches the Evaluator's Calibrator: with it, a plan's
params come from `site_inputs_sequential` on the calibration windows, and the one-shot statistics
(collected once per model and data, cached) are never taken."""

from __future__ import annotations

import numpy as np

from tenantq.evals.calibrated import CalibrationData, Calibrator
from tenantq.numerics import dequantize
from tenantq.quant import site_inputs
from tenantq.quant.apply import apply_plan
from tenantq.quant.plan import QuantPlan, Rule
from tenantq.quant.site_inputs import site_inputs_sequential
from tenantq.testing import tiny_config, tiny_params

PLAN = QuantPlan(rules=(Rule("layers/.*", "int4", group_size=16, algorithm="gptq"),))


def test_sequential_calibration_data_gives_the_sequential_params(tmp_path, monkeypatch):
    config, params = tiny_config(), tiny_params()
    windows = np.random.default_rng(0).integers(3, config.vocab_size, (4, 32)).astype(np.int32)
    calibrator = Calibrator(
        tmp_path, config, None, params, model_id="tiny", data=CalibrationData(sequential=True),
        cache_dir=tmp_path,
    )  # fmt: skip
    calibrator._windows = windows  # the tiny model has no train split to draw from

    def one_shot():
        raise AssertionError("sequential calibration took the one-shot statistics")

    monkeypatch.setattr(calibrator, "statistics", one_shot)
    calls = []

    def spy(
        *args, **kwargs
    ):  # the real site_inputs_sequential, its result kept (run once, not twice)
        calls.append((args, site_inputs_sequential(*args, **kwargs)))
        return calls[-1][1]

    monkeypatch.setattr(site_inputs, "site_inputs_sequential", spy)
    got = calibrator.params_for(PLAN)
    ((args, (cal, _)),) = calls
    assert args[1] is PLAN and args[3] is windows
    want = apply_plan(cal.params, PLAN, config, inputs=cal.inputs)
    for path in ("layers/0/attn/q_proj", "layers/1/mlp/down_proj"):
        np.testing.assert_array_equal(dequantize(got[path]), dequantize(want[path]))
    assert not any(tmp_path.iterdir())  # nothing cached: the statistics depend on the plan
