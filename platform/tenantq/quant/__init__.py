"""tenantq.quant: plans, `apply_plan`, calibration statistics and the calibrated algorithms.

`import tenantq.quant` stays free of JAX (the capacity planner reads plans without it). GPTQ,
AWQ and SmoothQuant register themselves with `register_algorithm` when `tenantq.quant.apply`
loads (it imports them at its end), so every caller of `apply_plan`/`quantize_tensor` sees them.
"""
