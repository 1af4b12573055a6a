"""tenantq.quant: plans, `apply_plan`, calibration statistics and the calibrated algorithms.

`import tenantq.quant` stays free of JAX (the capacity planner reads plans without it). The
algorithms a rule may name (rtn, GPTQ, AWQ, SmoothQuant) are one literal table,
`tenantq.quant.algorithms.ALGORITHMS`, which `apply_plan`/`quantize_tensor` look up.
"""
