"""tenantq.evals: the quality suite - what a plan breaks, measured through the quantized cache.

`load_suite` reads a suite (data, not code); `Evaluator(model_path, suite)` loads the model and
the bf16 baseline once and `evaluate(plan)` returns an `EvalResult` (flat summary with CIs and
verdicts, gates, per-example Arrow table, timings, memory report). Statistics: `evals.stats`.
"""

from tenantq.evals.evaluator import EvalResult, Evaluator, Gate
from tenantq.evals.suite import Suite, load_suite

__all__ = ["EvalResult", "Evaluator", "Gate", "Suite", "load_suite"]
