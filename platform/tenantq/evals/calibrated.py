"""Calibrated params for the Evaluator: statistics once per (model, dataset), then per plan.

A plan whose rules name gptq, awq or smoothquant (or ask for static W8A8 activation scales)
needs calibration statistics; `Calibrator` draws the calibration windows (default: 128 x 512
tokens of the reference model's train split, issue 11), collects the statistics the first
time a plan needs them (or reads them from the Parquet cache), and turns each such plan into
quantized params with `quant.site_inputs.site_inputs` + `quant.apply.apply_plan`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from tenantq.model.files import CACHE_DIR
from tenantq.quant.calibration_set import CalibrationData


def needs_calibration(plan, config) -> bool:
    """True when some tensor's rule uses a calibrated algorithm or static activation scales."""
    if plan is None:
        return False
    return any(
        how.algorithm != "rtn" or getattr(how, "activation_scale", "dynamic") == "static"
        for how in plan.resolve(config).values()
    )


class Calibrator:
    """Statistics of one model on one calibration set, collected on first use (see module doc)."""

    def __init__(
        self,
        model_path: str | Path,
        config,
        tokenizer,
        params: dict[str, Any],
        *,
        model_id: str,
        data: CalibrationData | None = None,
        cache_dir: str | Path = CACHE_DIR,
    ):
        self.model_path = Path(model_path)
        self.config = config
        self.tokenizer = tokenizer
        self.params = params
        self.model_id = model_id
        self.data = data or CalibrationData()
        self.cache_dir = Path(cache_dir) / "calibration"
        self._stats = None
        self._windows = None

    def statistics(self):
        """The `CalibrationStats` (computed once; from the disk cache when present)."""
        if self._stats is None:
            from tenantq.engine.sharding import on_every_host
            from tenantq.evals.data import array_hash
            from tenantq.quant.input_stats import collect_statistics

            windows = self.windows()
            self._stats = collect_statistics(
                self.model_path, windows, model_id=self.model_id, data_hash=array_hash(windows),
                cache_dir=self.cache_dir, params=self.params, agree=on_every_host,
            )  # fmt: skip
        return self._stats

    def windows(self) -> np.ndarray:
        """The calibration windows [num_sequences, seq_tokens] (drawn once)."""
        if self._windows is None:
            from tenantq.evals.windows import calibration_windows

            self._windows, _ = calibration_windows(
                self.tokenizer, self.config, source=self.data.data,
                num_sequences=self.data.sequences, seq_tokens=self.data.sequence_tokens,
                seed=self.data.seed,
            )  # fmt: skip
        return self._windows

    def params_for(self, plan) -> dict[str, Any]:
        """`plan` applied once to the model's params where its rules ask for calibration
        (the Engine takes these quantized params as they are); the unchanged full-precision
        params when no rule does (the Engine then applies the plan, plain RTN, once)."""
        return self.prepared(plan)[0]

    def prepared(self, plan) -> tuple[dict[str, Any], dict[str, Any], str]:
        """(params to run, the folded full-precision params, their identity) for `plan`.

        The folded params are the model after the plan's smoothquant/awq folds (1/s into a
        norm or v_proj, s into the consumers), before any weight is quantized: what the
        engine's activations, and so its cached K/V, come from up to the weights' rounding.
        Their identity is the model's when nothing is folded, else a new hash of the model
        identity and every fold's scales (the folds are deterministic given both, sequential
        or not: the scales themselves are hashed)."""
        if not needs_calibration(plan, self.config):
            return self.params, self.params, self.model_id
        from tenantq.quant.apply import apply_plan
        from tenantq.quant.site_inputs import site_inputs, site_inputs_sequential

        if self.data.sequential:
            cal, _ = site_inputs_sequential(self.params, plan, self.config, self.windows())
        else:
            cal = site_inputs(self.params, plan, self.config, self.statistics())
        run = apply_plan(cal.params, plan, self.config, inputs=cal.inputs)
        if not cal.fold_scales:
            return run, self.params, self.model_id
        h = hashlib.sha256(self.model_id.encode())
        for name in sorted(cal.fold_scales):
            h.update(name.encode())
            h.update(np.ascontiguousarray(cal.fold_scales[name], np.float32).tobytes())
        return run, cal.params, h.hexdigest()
